"""`python -m serve.engines.cpu --model-path ID [SGLang flags]`: run the CPU engine's HTTP server.

Flags are parsed and validated before anything heavy is imported, so a bad flag fails in well under a second."""

import os
import sys

from serve.engines.cpu.command_line import ConfigError, parse_config


def main() -> int:
    try:
        config = parse_config(sys.argv[1:])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # Before torch loads OpenMP: with the default (spinning) wait policy, 2 threads on a CPU shared with other work
    # ran 3-4x slower than 1 thread here (SmolLM2-135M: 1.8-2.3 vs 6.4-7.9 tok/s); PASSIVE brought 2 threads back to
    # 5.8-7.5 tok/s. An explicit OMP_WAIT_POLICY in the environment wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from serve.engines.cpu.server import serve

    return serve(config)


sys.exit(main())
