"""Records a study could not write (a full disk, a store that refuses writes), gathered so that its end says so.

The end of a study writes many records after the measurements are safe in MLflow: the report, the simulate-first
predictions, metrics and tags on the study run, the deploy files' copy in MLflow. Each of those writes is allowed to
fail without losing the decision, but a study with a record missing must not end as if whole: each failure is kept
here as one line (what, and the OS's or the store's own words), and the driver's exit path (`conclude`) prints them
in one block beside what is intact and exits `INCOMPLETE_EXIT` instead of 0.

The registry action is not held back by a missing record: the measured runs it rests on are intact, so a study
registers and promotes as a whole one would, and the exit code and the block say that its records are incomplete.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline.console_log import warn
from pipeline.redact import mask_url

__all__ = ["GAPS", "INCOMPLETE_EXIT", "Gap", "Gaps", "StoreTracebackFilter", "cause_line", "conclude", "exit_code",
           "first_line", "incomplete_block", "intact_records", "keeping", "missing", "quiet_store_tracebacks"]

# The exit code of a study that decided (and registered, as a whole one would) but could not write every record.
INCOMPLETE_EXIT = 3
CAUSE_CHARS = 300


@dataclass(frozen=True)
class Gap:
    """One record that was not written: `what` names it as a user finds it; `cause` is the error's one line."""

    what: str
    cause: str


def cause_line(exc: BaseException) -> str:
    """The error in one line, in its source's own words: an OSError's (errno) text, also when a library wrapped it
    (`No space left on device`); a database's own error where a store wrapped one (SQLAlchemy's `orig`:
    `(sqlite3.OperationalError) database or disk is full`, not the SQL or SQLAlchemy's advice around it); else the
    first line of the message. Pure."""
    seen: set[int] = set()
    current: BaseException | None = exc
    database = None
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.strerror:
            where = f": {current.filename}" if current.filename else ""
            return f"{current.strerror}{where}"[:CAUSE_CHARS]
        orig = getattr(current, "orig", None)
        if database is None and isinstance(orig, BaseException):
            database = f"({type(orig).__module__}.{type(orig).__name__}) {first_line(orig)}"
        current = current.__cause__ or current.__context__
    return f"{type(exc).__name__}: {database or first_line(exc)}"[:CAUSE_CHARS]


def first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else "(no message)"


class Gaps:
    """The records this process could not write, in the order they failed. Thread-safe: the simulate-first searcher
    logs from Tune's threads."""

    def __init__(self) -> None:
        self._items: list[Gap] = []
        self._lock = threading.Lock()

    def add(self, what: str, exc: BaseException) -> Gap:
        """Keep `what` as missing and say so in one line (no traceback): the study goes on."""
        gap = Gap(what=what, cause=cause_line(exc))
        with self._lock:
            self._items.append(gap)
        warn(f"{what} could not be written: {gap.cause}")
        return gap

    def items(self) -> tuple[Gap, ...]:
        with self._lock:
            return tuple(self._items)

    def drain(self) -> tuple[Gap, ...]:
        """The gaps so far, forgotten here (a next study in this process starts whole)."""
        with self._lock:
            found, self._items = tuple(self._items), []
        return found

    def clear(self) -> None:
        self.drain()

    @contextlib.contextmanager
    def keeping(self, what: str) -> Iterator[None]:
        """Run the block; an error in it is kept as `what` missing instead of ending the study."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - a record must not lose the study's result; it is said and counted
            self.add(what, exc)


GAPS = Gaps()  # the driver process's: its finalize stage and its searcher write the study's records

STORE_LOGGER = "mlflow.store.db.utils"


class StoreTracebackFilter(logging.Filter):
    """Drops the traceback MLflow's SQL store logs for a database error (a full disk: `database or disk is full`)
    before it raises the same error as an `MlflowException`: whoever catches that says it (a missing record, in one
    line), and an uncaught one still shows in full."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and str(record.msg).startswith("SQLAlchemy database error"))


def quiet_store_tracebacks() -> None:
    """Install `StoreTracebackFilter` on MLflow's SQL store logger, once per process."""
    logger = logging.getLogger(STORE_LOGGER)
    if not any(isinstance(f, StoreTracebackFilter) for f in logger.filters):
        logger.addFilter(StoreTracebackFilter())


def missing(what: str, exc: BaseException) -> Gap:
    """`GAPS.add`: the hook an `except` at the end of a study calls instead of printing the error."""
    return GAPS.add(what, exc)


def keeping(what: str) -> contextlib.AbstractContextManager[None]:
    """`GAPS.keeping`."""
    return GAPS.keeping(what)


def exit_code(code: int, gaps: Sequence[Gap]) -> int:
    """A study that would exit 0 exits `INCOMPLETE_EXIT` when a record is missing; another code (a failed study,
    an interrupted one) is kept, being the more telling. Pure."""
    return INCOMPLETE_EXIT if gaps and code == 0 else code


def incomplete_block(gaps: Sequence[Gap], intact: Sequence[str], code: int) -> str:
    """The block the console ends with when records are missing: each missing record and its cause, what is intact,
    and the exit code. Pure."""
    lines = [f"the study's records are INCOMPLETE: {len(gaps)} record(s) could not be written:"]
    lines += [f"  - {gap.what}: {gap.cause}" for gap in gaps]
    if intact:
        lines.append("intact (the decision rests on these):")
        lines += [f"  - {item}" for item in intact]
    said = ("the study decided and registered as a whole one does, but the records above are missing"
            if code == INCOMPLETE_EXIT else "the records above are missing too")
    lines.append(f"exit code {code}: {said}; fix their cause (e.g. free disk space) before the next study")
    return "\n".join(lines)


def intact_records(out: Path, tracker: Any, parent_run_id: str) -> list[str]:
    """What the study did keep, as a user finds it: its measured runs in MLflow, the deploy files, the registered
    version (from `promoted.yaml`). Reads only; a record that cannot be read is left out."""
    found: list[str] = []
    try:
        runs = tracker.trial_runs(parent_run_id)
        found.append(f"{len(runs)} measured trial and finalist run(s) in MLflow "
                     f"({mask_url(tracker.tracking_uri)}, under study run {parent_run_id})")
    except Exception:  # noqa: BLE001 - the store may be what failed; its runs are then not claimed intact
        pass
    deploy = out / "deploy"
    if deploy.is_dir() and any(deploy.iterdir()):
        found.append(f"the deploy files in {deploy}")
    try:
        promoted = yaml.safe_load((out / "promoted.yaml").read_text())
    except (OSError, yaml.YAMLError):
        promoted = None
    if isinstance(promoted, dict):
        version = promoted.get("version")
        model = promoted.get("registered_model")
        found.append(f"registered {model} version {version}" if version
                     else f"the served config in {out / 'promoted.yaml'} (nothing newly registered)")
    return found


def conclude(code: int, out: Path, tracker: Any, parent_run_id: str) -> int:
    """The study's exit code with its missing records accounted for: unchanged when every record was written, else
    the block (`incomplete_block`) on the console and `exit_code`."""
    gaps = GAPS.drain()
    if not gaps:
        return code
    final = exit_code(code, gaps)
    warn("\n" + incomplete_block(gaps, intact_records(out, tracker, parent_run_id), final))
    return final
