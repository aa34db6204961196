"""An engine start's phases, as the replica reports them to the trial waiting for it.

A start runs: `stopping` (the previous engine's process group, waited for: on a GPU it holds memory), `preflight`
(the engine kind's `prepare` on the replica's node: node checks, the engine's own parser), `waiting_for_gpus` (until
an earlier engine's memory is free), `loading` (process spawned until `/health` answers: weights, graphs, JIT
compiles) and `corpus` (an NGRAM external corpus loaded over `POST /add_external_corpus`). Each has its own limit,
which the replica enforces and reports, so the waiting trial's deadline follows the phase instead of guessing one
total (a big model's load alone may take most of `start_timeout_s`).

`prepare` implementations run inside the replica's start and may move it to a later phase with `report_phase`
(e.g. an engine that waits for free GPUs after its preflight); outside a start it does nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextvars import ContextVar

__all__ = ["PHASES", "StartState", "report_phase", "reporting"]

PHASES = ("stopping", "preflight", "waiting_for_gpus", "loading", "corpus")

_reporter: ContextVar[Callable[[str, float], None] | None] = ContextVar("phase_reporter", default=None)


def report_phase(name: str, limit_s: float) -> None:
    """Enter phase `name` (one of PHASES), which may last `limit_s` seconds; a no-op outside a replica's start."""
    if name not in PHASES:
        raise ValueError(f"unknown start phase {name!r}; one of {PHASES}")
    reporter = _reporter.get()
    if reporter is not None:
        reporter(name, limit_s)


def reporting(callback: Callable[[str, float], None]) -> object:
    """Make `report_phase` call `callback` in this context (the replica's start thread); returns the reset token."""
    return _reporter.set(callback)


class StartState:
    """One replica's engine starts, as the trial polling it sees them: the phase now, its limit and elapsed time, the
    seconds each finished phase took, and the outcome. Thread-safe: the start runs in a worker thread while the
    replica's routes read it. `seq` grows at every change, so a poller can wait for the next one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.seq = 0
        self.running = False
        self.done = False
        self.error: str | None = None
        self.shared = False
        self.phase: str | None = None
        self.limit_s = 0.0
        self._since = 0.0
        self.phases: dict[str, float] = {}

    def begin(self) -> None:
        with self._lock:
            self.seq += 1
            self.running, self.done, self.error, self.shared = True, False, None, False
            self.phase, self.limit_s, self.phases = None, 0.0, {}

    def enter(self, name: str, limit_s: float) -> None:
        """Close the current phase and open `name`; `report_phase`'s callback during a start."""
        with self._lock:
            now = time.monotonic()
            self._close(now)
            self.phase, self.limit_s, self._since = name, float(limit_s), now
            self.seq += 1

    def finish(self, error: str | None) -> None:
        with self._lock:
            self._close(time.monotonic())
            self.phase, self.running, self.done, self.error = None, False, True, error
            self.seq += 1

    def _close(self, now: float) -> None:
        if self.phase is not None:
            self.phases[self.phase] = self.phases.get(self.phase, 0.0) + (now - self._since)

    def snapshot(self) -> dict[str, object]:
        """{"seq", "running", "done", "ok", "error", "shared", "phase", "phase_elapsed_s", "phase_limit_s",
        "phases"}: `phases` holds the finished phases' seconds (the current one's so far in `phase_elapsed_s`)."""
        with self._lock:
            elapsed = time.monotonic() - self._since if self.phase is not None else 0.0
            return {"seq": self.seq, "running": self.running, "done": self.done,
                    "ok": (self.error is None) if self.done else None, "error": self.error, "shared": self.shared,
                    "phase": self.phase, "phase_elapsed_s": round(elapsed, 3), "phase_limit_s": self.limit_s,
                    "phases": {k: round(v, 3) for k, v in self.phases.items()}}
