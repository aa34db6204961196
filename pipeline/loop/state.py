"""The loop's memory and its guards: the state file (written whole or not at all), the lock that keeps one loop per
state folder, and the operator's commands (`python -m pipeline.promote --canary ...`).

Files in the state folder (`--state-dir`, default ./runs/loop):
- `state.json`: `LoopState`, written atomically (`pipeline.atomic`) after every change; a restarted loop reads it and
  carries on from its phase (a re-tune resumes its study, a canary re-attaches to the endpoint's).
- `loop.lock`: held with `flock` for as long as a loop runs (released by the kernel when the process dies, so a
  crash never leaves a stale lock); it holds the pid of the holder for the error message of a second loop.
- `control/<unix ms>-<random>.json`: one `ControlCommand` each, written by the command line only and deleted by the
  loop once applied, so a command given while the loop is busy is never lost or applied twice. Only regular files
  are read, without blocking (a FIFO with a command's name would hang the reader); one that cannot be read as a
  command is moved to `control/unreadable/` by the loop, which says so once (`--canary status` lists them).
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Literal

from pydantic import Field, ValidationError, model_validator

from pipeline.atomic import write_text_atomic
from pipeline.errors import PipelineError
from pipeline.loop.drift import DetectorState
from serve.closed_loop.files import read_regular
from serve.spec import FrozenModel

__all__ = ["Phase", "LoopState", "ControlCommand", "LoopLock", "load_state", "save_state", "send_command",
           "pending_commands", "scan_commands", "set_aside", "STATE_FILE", "LOCK_FILE", "CONTROL_DIR",
           "UNREADABLE_DIR"]

STATE_FILE, LOCK_FILE, CONTROL_DIR, UNREADABLE_DIR = "state.json", "loop.lock", "control", "unreadable"
MAX_COMMAND_BYTES = 64 * 1024
Phase = Literal["idle", "retune", "canary", "promote", "rollback"]
Command = Literal["pause", "resume", "abort", "promote"]


class LoopState(FrozenModel):
    """Where the loop is. `phase` idle: watching for drift or the next scheduled cycle; retune: the cycle's study
    runs; canary: the candidate serves `step`'s share; promote / rollback: carrying out the outcome."""

    phase: Phase = "idle"
    cycle: int = Field(0, ge=0, description="cycles started")
    cycle_run_id: str | None = None
    cycle_started_ms: int | None = None
    trigger: str | None = None
    last_cycle_end_ms: int | None = None
    watching_since_ms: int | None = Field(None, description="first watch of this state folder (the schedule counts "
                                                            "from it until a cycle ended)")
    production_version: str | None = None
    reference_version: str | None = Field(None, description="the version whose study figures drift is tested "
                                                            "against (production's, or a re-tune's confirmation)")
    candidate_version: str | None = None
    retune_output: str | None = None
    step: int = Field(0, ge=0)
    step_started_ms: int | None = None
    paused: bool = False
    live_after: int = Field(0, ge=0, description="the live feed's cursor")
    detectors: dict[str, DetectorState] = Field(default_factory=dict)
    live_lengths: dict[str, tuple[int, ...]] = Field(default_factory=dict, description="the latest production "
                                                     "requests' prompt and completion tokens (shift signal)")
    outcome: str | None = Field(None, description="the last finished cycle's outcome")
    reason: str | None = None

    @model_validator(mode="after")
    def _phase_has_its_fields(self) -> LoopState:
        # What each phase acts on must be there: a hand-edited file without it crashed the loop deep in MLflow, on
        # every restart, instead of saying which field is missing.
        if self.phase == "idle":
            return self
        missing = [name for name, value in (("cycle_run_id", self.cycle_run_id), ("cycle", self.cycle or None))
                   if value is None]
        if self.phase in ("canary", "promote") and not (self.candidate_version or "").isdigit():
            missing.append("candidate_version")
        if missing:
            raise ValueError(f"phase {self.phase!r} needs {', '.join(missing)} (a version number for "
                             "candidate_version, a cycle >= 1 and its MLflow run id)")
        return self


class ControlCommand(FrozenModel):
    command: Command
    at_ms: int
    reason: str = ""


def load_state(folder: Path) -> LoopState:
    """The saved state, or a fresh one; a damaged file is an error naming it (never silently a fresh start)."""
    path = Path(folder) / STATE_FILE
    if not path.exists():
        return LoopState()
    try:
        return LoopState.model_validate_json(read_regular(path))
    except (ValidationError, ValueError, OSError) as exc:
        raise PipelineError(f"{path} is not a loop state file ({_first_problem(exc)}); move it away to start the "
                            "loop afresh (the endpoint keeps serving production meanwhile)") from None


def _first_problem(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(map(str, first["loc"])) or "(top level)"
        return f"{where}: {first['msg']}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def save_state(folder: Path, state: LoopState) -> None:
    write_text_atomic(Path(folder) / STATE_FILE, state.model_dump_json(indent=2))


class LoopLock:
    """`with LoopLock(folder):` -- one loop per state folder; a second gets PipelineError naming the holder."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / LOCK_FILE
        self._handle: IO[str] | None = None

    def __enter__(self) -> LoopLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise PipelineError(f"another loop runs on {self.path.parent} (pid {holder} holds {self.path}); one loop "
                                "per state folder: stop it first, or give another --state-dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        self._handle = handle
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            fcntl.flock(self._handle, fcntl.LOCK_UN)
            self._handle.close()
            self._handle = None


_SEQUENCE = itertools.count()


def send_command(folder: Path, command: Command, reason: str = "") -> Path:
    """Queue an operator command for the loop (the command line's side)."""
    # Named by nanoseconds and a per-process sequence: commands sent within one millisecond (a script) must keep
    # their order, which a random suffix after a millisecond stamp did not.
    stamp = time.time_ns()
    path = Path(folder) / CONTROL_DIR / f"{stamp:020d}-{next(_SEQUENCE):06d}-{uuid.uuid4().hex[:8]}.json"
    write_text_atomic(path, ControlCommand(command=command, at_ms=stamp // 1_000_000, reason=reason).model_dump_json())
    return path


def scan_commands(folder: Path) -> tuple[list[tuple[Path, ControlCommand]], list[tuple[Path, str]]]:
    """(queued commands, oldest first; files with a command's name that are not one, with why). Regular files only,
    read without blocking (`serve.closed_loop.files`)."""
    commands, unreadable = [], []
    for path in sorted((Path(folder) / CONTROL_DIR).glob("*.json")):
        try:
            commands.append((path, ControlCommand.model_validate(json.loads(read_regular(path, MAX_COMMAND_BYTES)))))
        except (ValidationError, ValueError, OSError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
            unreadable.append((path, why or type(exc).__name__))
    return commands, unreadable


def pending_commands(folder: Path) -> list[tuple[Path, ControlCommand]]:
    """Queued commands, oldest first (the loop's side; it deletes each one it applied)."""
    return scan_commands(folder)[0]


def set_aside(unreadable: list[tuple[Path, str]], say: Callable[[str], None], unmovable: set[Path]) -> None:
    """Move each file of `unreadable` (path, why) to `control/unreadable/`, kept for a person to see and never read
    again, saying so once; one that cannot be moved is said once per loop run (`unmovable` remembers it)."""
    for path, why in unreadable:
        target = path.parent / UNREADABLE_DIR / path.name
        try:
            target.parent.mkdir(exist_ok=True)
            os.replace(path, target)  # a rename: a FIFO is moved without being opened
        except OSError as exc:
            if path not in unmovable:
                unmovable.add(path)
                say(f"operator: {path} is not a command ({why}) and cannot be moved aside: {exc}")
            continue
        say(f"operator: {path.name} is not a command ({why}); moved to {target.parent}, not applied")
