"""What every command line of the project shares: the usage line's program name, `--version`, and the default
tracking URI taken from `MLFLOW_TRACKING_URI`.

Each command runs two ways: as its console script (`specdec-tune`, installed by `pip install -e .`) and as
`python -m pipeline.tune`. The usage line names the way it was started, so that a command copied from `--help` runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "specdec-tuner"
TRACKING_ENV = "MLFLOW_TRACKING_URI"  # MLflow's own variable: a user with a tracking server has it set already


def package_version() -> str:
    """The installed distribution's version; a source tree that was never pip-installed says so."""
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def program(script: str, module: str, argv0: str | None = None) -> str:
    """The usage line's program: the console script when it was started as one, else `python -m <module>`."""
    started = os.path.basename(sys.argv[0] if argv0 is None else argv0)
    return script if started == script else f"python -m {module}"


def add_version(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}",
                        help="print the installed specdec-tuner version and exit")


def env_tracking_uri() -> str | None:
    """`MLFLOW_TRACKING_URI` when set and not blank: the default of every `--tracking-uri` the user leaves out."""
    return os.environ.get(TRACKING_ENV, "").strip() or None
