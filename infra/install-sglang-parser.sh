#!/usr/bin/env bash
# SGLang's argument parser on a CPU machine, for preflight and the flag tests (reference/sglang-0.5.23.md §8).
# sglang pins a CUDA torch, so it goes in --no-deps, with only what `sglang.srt.server_args` imports.
# Usage: infra/install-sglang-parser.sh [PYTHON]   (default: .venv/bin/python)
# sglang 0.5.23 goes into that venv; 0.5.22 into ~/.cache/specdec-tuner/sglang/0.5.22 (SPECDEC_SGLANG_PARSERS).
set -euo pipefail
PY=${1:-.venv/bin/python}
"$PY" -m pip install --quiet --no-compile --no-deps "sglang==0.5.23" "triton==3.9.0" "compressed-tensors==0.18.0"
"$PY" -m pip install --quiet --no-compile msgspec orjson pybase64 pyzmq pillow ipython loguru dill regex
# Older parsers side by side (flags are rendered from each installed version's ServerArgs fields; the flag tests
# check every bundled point against each). Not importable by default: only the tests put them on PYTHONPATH.
PARSERS=${SPECDEC_SGLANG_PARSERS:-$HOME/.cache/specdec-tuner/sglang}
for version in 0.5.22; do
  [ -d "$PARSERS/$version/sglang" ] || "$PY" -m pip install --quiet --no-deps --target "$PARSERS/$version" "sglang==$version"
done
