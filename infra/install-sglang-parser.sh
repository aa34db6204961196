#!/usr/bin/env bash
# SGLang's argument parser on a CPU machine, for preflight and the flag tests (reference/sglang-0.5.23.md §8).
# sglang pins a CUDA torch, so it goes in --no-deps, with only what `sglang.srt.server_args` imports.
# Usage: infra/install-sglang-parser.sh [PYTHON]   (default: .venv/bin/python)
set -euo pipefail
PY=${1:-.venv/bin/python}
"$PY" -m pip install --quiet --no-deps "sglang==0.5.23" "triton==3.9.0" "compressed-tensors==0.18.0"
"$PY" -m pip install --quiet msgspec orjson pybase64 pyzmq pillow ipython loguru dill regex
