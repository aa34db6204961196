#!/usr/bin/env bash
# The GPU checks in one run. First, with torch alone (no SGLang, model, Ray or pytest needed; under 5 minutes on one
# GPU): tests/gpu/check_tree_verify.py, the tree verify of NGRAM drafts as SGLang lays it out, through fa3's masked
# and causal paths and the CPU engine's, against a dense reference (docs/gpu-check.md).
# Then, only with SPECDEC_GPU_MODEL (the project and SGLang installed), bounded at 10 minutes (two engine starts of a
# 0.5B model on one GPU take 2-4 minutes, a node's first start more for its JIT compiles): the decided attention
# backend read back from /server_info, and an NGRAM breadth-4 trial's greedy outputs equal to the baseline's under it.
#   bash tests/gpu/check_gpu.sh                                                        # the torch-only check
#   SPECDEC_GPU_MODEL=/models/Qwen2.5-0.5B-Instruct bash tests/gpu/check_gpu.sh [pytest args]
# Optional: SPECDEC_GPU_MLA_MODEL=<an MLA model that fits one GPU> adds the MLA checks (more minutes).
# PYTHON: the interpreter (default python3); CHECK_DEVICE: cuda (default) or cpu.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
timeout 300 "$PY" tests/gpu/check_tree_verify.py --device "${CHECK_DEVICE:-cuda}"
if [[ -z "${SPECDEC_GPU_MODEL:-}" ]]; then
    echo "check_gpu.sh: SPECDEC_GPU_MODEL is not set (a local model folder, e.g. /models/Qwen2.5-0.5B-Instruct):" \
         "the SGLang backend checks (tests/gpu/test_backend_tree_mask.py) were not run"
    exit 0
fi
# addopts cleared: the project's pytest options need pytest-xdist, which a GPU machine may not have
exec timeout 600 "$PY" -m pytest -q -s -x -p no:cacheprovider -o addopts="" tests/gpu/test_backend_tree_mask.py "$@"
