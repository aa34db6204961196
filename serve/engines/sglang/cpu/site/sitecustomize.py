"""Put on PYTHONPATH only for SGLang started on a CPU (`serve.engines.sglang.cpu.launch_env`): every interpreter of
that SGLang (its server, and the scheduler and detokenizer it spawns) installs the CPU runtime pieces before SGLang
imports anything. A version refusal is printed here and enforced by the launcher (`python -m serve.engines.sglang.cpu`),
which exits with it before SGLang starts."""

import os
import sys

from serve.engines.sglang.cpu import ENV_FLAG

if os.environ.get(ENV_FLAG) == "1":
    try:
        from serve.engines.sglang.cpu.runtime import install

        install()
    except RuntimeError as exc:
        print(f"[specdec sglang-cpu] {exc}", file=sys.stderr)
