#!/usr/bin/env bash
# The GPU checks of the attention-backend decision in one run, bounded at 10 minutes (two engine starts of a 0.5B
# model on one GPU take 2-4 minutes, a node's first start more for its JIT compiles): the decided backend read back
# from /server_info, and an NGRAM breadth-4 trial's greedy outputs equal to the baseline's under it.
#   SPECDEC_GPU_MODEL=/models/Qwen2.5-0.5B-Instruct bash tests/gpu/check_gpu.sh [pytest args]
# Optional: SPECDEC_GPU_MLA_MODEL=<an MLA model that fits one GPU> adds the MLA checks (more minutes).
set -euo pipefail
: "${SPECDEC_GPU_MODEL:?set SPECDEC_GPU_MODEL to a local model folder, e.g. /models/Qwen2.5-0.5B-Instruct}"
cd "$(dirname "$0")/../.."
exec timeout 600 "${PYTHON:-python}" -m pytest -q -s -x -p no:cacheprovider tests/gpu/test_backend_tree_mask.py "$@"
