"""What a study tells the person at the terminal, and what it keeps for later, through the standard `logging` module.

Every line the study's driver writes goes to the `specdec` logger at one of three levels:

- `headline` (HEADLINE, between WARNING and ERROR): the decision and the links printed after it;
- `warn` (WARNING): what went wrong without stopping the study (a record not logged, an interrupted study's resume
  command);
- `say` (INFO): progress a person follows (one line per trial, the tables, the slow phases);
- `detail` (DEBUG): internals that explain a figure (a fit's coefficients, an engine's start phases, pip's output).

The console shows WARNING and up with `--quiet`, INFO and up by default, everything with `--verbose`; errors that
stop a command still go to stderr where each command prints them. The log file (`study.log` in the study's folder) always gets everything,
with times, and no progress bar: the only progress the driver writes is whole lines. Records from before the folder
is known (the model fetch, the checks) are held and written to the file when it opens.

A library call that never set this up (`run_study` from a script or a test) prints INFO and up to stdout, as the
study always has.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from pathlib import Path
from typing import Literal

LOGGER = logging.getLogger("specdec")
HEADLINE = 35
logging.addLevelName(HEADLINE, "HEADLINE")
LOG_FILE = "study.log"
Verbosity = Literal["quiet", "normal", "verbose"]
LEVELS: dict[str, int] = {"quiet": logging.WARNING, "normal": logging.INFO, "verbose": logging.DEBUG}
HELD = 100_000  # records held before the log file opens (a fetch's pip output is a few hundred lines)


class StdoutHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stdout` is when a record comes (pytest's capture, a redirected stream), bare text."""

    def __init__(self, level: int) -> None:
        super().__init__(sys.stdout)
        self.setLevel(level)
        self.setFormatter(logging.Formatter("%(message)s"))

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:  # noqa: ANN001
        pass


def console_handler() -> StdoutHandler | None:
    return next((h for h in LOGGER.handlers if isinstance(h, StdoutHandler)), None)


def ensure_console() -> None:
    """The library default: INFO and up to stdout, until a command line sets its own level."""
    if console_handler() is None:
        LOGGER.addHandler(StdoutHandler(logging.INFO))
        LOGGER.setLevel(logging.DEBUG)
        LOGGER.propagate = False


def setup_console(verbosity: Verbosity = "normal") -> None:
    """A command line's console at `verbosity`, and a buffer holding every record until `attach_log_file`."""
    for handler in list(LOGGER.handlers):
        LOGGER.removeHandler(handler)
        handler.close()
    LOGGER.addHandler(StdoutHandler(LEVELS[verbosity]))
    LOGGER.addHandler(logging.handlers.MemoryHandler(HELD, flushLevel=logging.CRITICAL + 1, flushOnClose=False))
    LOGGER.setLevel(logging.DEBUG)
    LOGGER.propagate = False


def progress_bars_on_terminal_only() -> None:
    """No progress bar unless stderr is a terminal: a bar redrawn with carriage returns is one unreadable line per
    redraw in a captured log (CI, nohup, a service manager). tqdm's (Hugging Face downloads, a model load in this
    process) and the Hub's; a setting the user's environment already has is kept."""
    if not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def attach_log_file(folder: Path) -> Path:
    """Open `<folder>/study.log` (appended to: a resumed study continues its log), write the held records to it, and
    send every later record there too. Returns the file's path."""
    path = folder / LOG_FILE
    folder.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.DEBUG)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    for held in [h for h in LOGGER.handlers if isinstance(h, logging.handlers.MemoryHandler)]:
        held.setTarget(handler)
        held.flush()
        LOGGER.removeHandler(held)
        held.close()
    LOGGER.addHandler(handler)
    return path


def say(text: str) -> None:
    ensure_console()
    LOGGER.info(text)


def detail(text: str) -> None:
    ensure_console()
    LOGGER.debug(text)


def warn(text: str) -> None:
    ensure_console()
    LOGGER.warning(text)


def headline(text: str) -> None:
    ensure_console()
    LOGGER.log(HEADLINE, text)


def flush() -> None:
    for handler in LOGGER.handlers:
        handler.flush()
