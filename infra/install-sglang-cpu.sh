#!/usr/bin/env bash
# SGLang 0.5.23's own server for a CPU machine, in a venv of its own (serve/engines/sglang/cpu/__init__.py says why):
# torch 2.13.0's CPU build and the pinned, CUDA-free working set of infra/requirements-sglang-cpu.txt, --no-deps.
# Idempotent: returns at once when the venv already holds exactly that set (a stamp of the requirements file).
# Usage: bash infra/install-sglang-cpu.sh [PYTHON]   (PYTHON: a 3.11 interpreter for the venv, default python3.11)
# Venv: $SPECDEC_SGLANG_CPU_VENV, else ${SPECDEC_CACHE:-~/.cache/specdec-tuner}/sglang-cpu/0.5.23/venv (the engine
# looks there). ~2.9 GB; about 1.5 min of pip on a 2-core machine with a warm pip cache.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-$(command -v python3.11 || command -v python3)}
REQS=infra/requirements-sglang-cpu.txt
VENV=${SPECDEC_SGLANG_CPU_VENV:-${SPECDEC_CACHE:-$HOME/.cache/specdec-tuner}/sglang-cpu/0.5.23/venv}
STAMP="$VENV/.specdec-requirements.sha256"
want=$(sha256sum "$REQS" | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  echo "SGLang CPU venv up to date: $VENV"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# --no-deps: sglang declares torch==2.14.1 (a CUDA build) and CUDA-only packages; the file is the whole working set.
"$VENV/bin/python" -m pip install --quiet --no-deps -r "$REQS"
"$VENV/bin/python" -c 'import torch, sglang.srt.server_args; assert torch.version.cuda is None, torch.version.cuda'
echo "$want" > "$STAMP"
echo "SGLang CPU venv ready: $VENV ($(du -sh "$VENV" | cut -f1))"
