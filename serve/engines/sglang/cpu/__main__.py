"""`python -m serve.engines.sglang.cpu serve --model-path ... [SGLang flags]`: SGLang's own `sglang serve`, on a CPU.

Run by the SGLang CPU venv's interpreter with `launch_env()` (the SGLang adapter builds both for `device: cpu`). It
refuses any SGLang but the supported version with exit code 2 and the fix, before SGLang starts; then hands the
command line to SGLang's CLI unchanged. The runtime pieces are already installed by sitecustomize (they must be in
SGLang's spawned processes too), and installed here again in case this interpreter skipped site customisation.
"""

import sys

from serve.engines.sglang.cpu.runtime import install


def main() -> int:
    try:
        install()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from sglang.cli.main import main as sglang_main

    sys.argv = ["sglang", *sys.argv[1:]]
    sglang_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
