"""What a study prints while it runs: one line per finished trial (its config label, outcome, figure and how it
compares with the baseline and the best so far), and progress through the long phases of a trial or a finalist
re-run (starting the engine, warming up, measuring) when one takes long -- on a GPU node a model load takes minutes.

Phases travel through the trial's own folder: `note_phase` appends one JSON line to `<folder>/phases.jsonl` (the
trial process may be a Tune worker whose stdout the driver does not forward), and the driver reads them back
(`PhaseWatcher`: Tune's callback during the search, `phase_echo` during the finalists' re-runs). A phase that ends
quickly prints nothing; one still open after `SLOW_S` seconds prints a line, then one every `EVERY_S`. A trial on
another node of a cluster writes its phases on that node: the driver then shows only the per-trial lines.

The line logic (`ProgressBoard`, `PhaseState`) is pure; the file and Tune parts are thin.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.console_log import detail, say
from pipeline.vocabulary.outcome import Outcome
from pipeline.vocabulary.report import TrialReport

PHASES_FILE = "phases.jsonl"
SLOW_S = 10.0  # a phase open this long gets a line
EVERY_S = 60.0  # and another one this often while it stays open
PHASE_TEXT = {"engine": "starting the engine", "warmup": "warming up", "measure": "measuring"}
# a metric as the tables, the re-run lines and the report name it (its unit), not by its record key
SHOWN_AS = {"tput_tok_s": "tok/s"}


def figure(metric: str, value: float | None) -> str:
    """`12.50 tok/s` for a metric with a unit here, else `name=12.50`; `-` for no value."""
    shown = "-" if value is None else f"{value:.2f}"
    return f"{shown} {SHOWN_AS[metric]}" if metric in SHOWN_AS else f"{metric}={shown}"


def duration(seconds: float) -> str:
    """`8 s`, `1 min 05 s`, `1 h 02 min`."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"


def rerun_name(folder: str) -> str:
    """A finalist re-run's folder or run name (`<id>[-c<level>]-run<k>`, pipeline.study.finalists.run_label) as the
    stage's console lines name the run (`<id> run <k>`), with its level. Pure."""
    found = re.fullmatch(r"(.+?)(?:-c(\d+))?-run(\d+)", folder)
    if not found:
        return folder
    ident, level, k = found.groups()
    return f"{ident} run {k}" + (f" at {level} in flight" if level else "")


# --- one line per finished trial -----------------------------------------------------------------------------------


@dataclass
class ProgressBoard:
    """The search's live view: `line()` for each finished trial. `mode` is the objective's (max or min); the
    baseline's line shows its own figure, the others their ratio to it and the best speculative trial so far."""

    total: int
    metric: str
    mode: str = "max"
    done: int = 0
    baseline: float | None = None
    best: tuple[float, str] | None = None

    def _better(self, value: float) -> bool:
        return self.best is None or (value > self.best[0] if self.mode == "max" else value < self.best[0])

    def line(self, *, label: str, algorithm: str, outcome: Outcome | None, value: float | None, reason: str = "",
             seconds: float | None = None, spread: float | None = None, flag: str = "",
             remeasured: int = 0) -> str:
        """`spread`: the per-request MAD / median of the measurement; `flag` and `remeasured`: whether other work
        disturbed its window (pipeline/measure/window.py), shown when it did. `outcome` None: the trial's report
        named none."""
        self.done += 1
        head = f"[trial {self.done}/{self.total}] {label:<40} {outcome.value if outcome else '?':<14}"
        took = f"  ({duration(seconds)})" if seconds is not None else ""
        if flag == "disturbed":
            took += f"  [DISTURBED: other work held the CPU in every window, {remeasured} re-measured]"
        elif flag == "re-measured":
            took += f"  [re-measured {remeasured}x: other work held the CPU]"
        if outcome is not Outcome.COMPLETE or value is None:
            return f"{head} {figure(self.metric, None)}{took}" + (f"  -- {reason[:200]}" if reason else "")
        shown = figure(self.metric, value) + (f" ±{spread:.0%}" if spread is not None else "")
        if algorithm == "none" and self.baseline is None:
            self.baseline = value
            return f"{head} {shown}  (the baseline){took}"
        ratio = f"  {value / self.baseline:.2f}x baseline" if self.baseline else ""
        if self._better(value):
            self.best = (value, label)
            return f"{head} {shown}{ratio}  (best so far){took}"
        best_value, best_label = self.best or (value, label)  # not None here: _better is True while there is none
        best = f"{best_value / self.baseline:.2f}x" if self.baseline else f"{best_value:.2f}"
        return f"{head} {shown}{ratio}  (best: {best}, {best_label}){took}"


# --- phases --------------------------------------------------------------------------------------------------------


def note_phase(folder: Path, phase: str, **figures: Any) -> None:
    """Append one phase event (`phase`, wall-clock `t`, figures) to the folder's phases file. Never raises: progress
    is for the console, and a trial must not fail over it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / PHASES_FILE, "a") as handle:
            handle.write(json.dumps({"phase": phase, "t": time.time(), **figures}, default=str) + "\n")
    except OSError:
        pass


@dataclass
class PhaseState:
    """One trial's (or re-run's) phases as read so far; `update` takes events in order, `due(now)` the lines to print
    now. `announce` also prints a line when the pass is measured (the finalists' re-runs, which have no Tune line)."""

    who: str
    announce: bool = False
    phase: str | None = None
    since: float = 0.0
    printed_at: float | None = None
    finished: bool = False
    pending: list[str] = field(default_factory=list)
    details: list[str] = field(default_factory=list)  # for the log file: what the engine's start spent its time on

    def update(self, event: dict[str, Any]) -> None:
        phase, at = str(event.get("phase")), float(event.get("t") or 0.0)
        if event.get("config") and not self.announce:  # a trial's folder is its Tune id: name it by its config
            self.who = str(event["config"])
        if phase == "engine":
            self.finished = False
        if phase == "ready":
            if self.phase == "engine" and at - self.since >= SLOW_S:
                self.pending.append(f"{self.who}: engine ready after {duration(at - self.since)}")
            if _start_detail(event):
                self.details.append(f"{self.who}: engine start{_start_detail(event)}")
        elif phase == "measured":
            self.finished = True
            if self.announce:
                self.pending.append(f"{self.who}: {_measured(event)}")
            return
        if phase in PHASE_TEXT:
            self.phase, self.since, self.printed_at = phase, at, None
        elif phase == "ready":
            self.phase = None

    def due(self, now: float) -> list[str]:
        out, self.pending = self.pending, []
        if self.finished or self.phase is None:
            return out
        open_for = now - self.since
        if open_for >= SLOW_S and (self.printed_at is None or now - self.printed_at >= EVERY_S):
            self.printed_at = now
            out.append(f"{self.who}: {PHASE_TEXT[self.phase]} ({duration(open_for)} so far)")
        return out


def _start_detail(event: dict[str, Any]) -> str:
    """The engine's own start phases when the replica reported them (`phases`: name -> seconds)."""
    phases = event.get("phases")
    if isinstance(phases, dict) and phases:
        return " (" + ", ".join(f"{k} {duration(float(v))}" for k, v in phases.items()
                                if isinstance(v, (int, float))) + ")"
    return ""


def _measured(event: dict[str, Any]) -> str:
    tput = event.get("tput_tok_s")
    figure = f"{float(tput):.2f} tok/s" if isinstance(tput, (int, float)) else "no throughput"
    outcome = event.get("outcome") or "?"
    raw = event.get("timings")
    timings: dict[str, Any] = raw if isinstance(raw, dict) else {}
    parts = [f"{name} {duration(float(timings[key]))}" for key, name in
             (("engine_start_s", "engine start"), ("warmup_s", "warm-up"), ("measure_s", "measure"))
             if isinstance(timings.get(key), (int, float))]
    window = event.get("window")  # pipeline.measure.window.flag: said unless clean (or unchecked: nothing to say)
    noted = f", window {window}" if window in ("re-measured", "disturbed") else ""
    return f"{figure}, {outcome}{noted}" + (f" ({', '.join(parts)})" if parts else "")


class PhaseWatcher:
    """Reads the phases files under `root` (`<root>/<name>/phases.jsonl`) as they grow and returns the lines due.
    `who(name)` names a folder in the lines."""

    def __init__(self, root: Path, who: Callable[[str], str] = str, announce: bool = False) -> None:
        self.root = root
        self.who = who
        self.announce = announce
        self.offsets: dict[Path, int] = {}
        self.states: dict[Path, PhaseState] = {}

    def take_details(self) -> list[str]:
        """The detail lines (`PhaseState.details`) read since the last call, for the log file."""
        out: list[str] = []
        for state in self.states.values():
            out, state.details = out + state.details, []
        return out

    def poll(self, now: float | None = None) -> list[str]:
        now = time.time() if now is None else now
        lines: list[str] = []
        try:
            paths = sorted(self.root.glob(f"*/{PHASES_FILE}"))
        except OSError:
            return lines
        for path in paths:
            state = self.states.get(path)
            if state is None:
                state = self.states[path] = PhaseState(who=self.who(path.parent.name), announce=self.announce)
            for event in self._new_events(path):
                state.update(event)
            lines += state.due(now)
        return lines

    def _new_events(self, path: Path) -> list[dict[str, Any]]:
        start = self.offsets.get(path, 0)
        try:
            with open(path, "rb") as handle:
                handle.seek(start)
                data = handle.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written waits for the next poll
        self.offsets[path] = start + end
        events = []
        for raw in data[:end].splitlines():
            try:
                events.append(json.loads(raw))
            except ValueError:
                continue
        return events


@contextlib.contextmanager
def phase_echo(root: Path, interval_s: float = 1.0, prefix: str = "    ",
               who: Callable[[str], str] = str) -> Iterator[PhaseWatcher]:
    """While the block runs (in this process: the finalists' re-runs), print the phase lines of the passes under
    `root`, one line per measured pass; `who(folder name)` names a pass in them."""
    watcher = PhaseWatcher(root, who=who, announce=True)
    watcher.poll()  # passes from before (a resumed study) are read now and not announced again
    watcher.take_details()
    for state in watcher.states.values():
        state.pending.clear()
        state.finished = True
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval_s):
            echo(watcher, watcher.poll(), prefix)

    thread = threading.Thread(target=loop, name="phase-echo", daemon=True)
    thread.start()
    try:
        yield watcher
    finally:
        stop.set()
        thread.join(timeout=5)
        echo(watcher, watcher.poll(), prefix)


def echo(watcher: PhaseWatcher, lines: list[str], prefix: str) -> None:
    """The console's lines, and the details behind them for the log file (pipeline/console_log.py)."""
    for line in watcher.take_details():
        detail(prefix + line)
    for line in lines:
        say(prefix + line)


# --- the search's Tune callback ------------------------------------------------------------------------------------


def progress_callback(total: int, metric: str, mode: str, trials_dir: Path) -> Any:
    """A Tune callback printing `ProgressBoard` lines as trials finish and, while they run, the slow phases their
    folders under `trials_dir` report. The trial's final report carries `label` and `reason` (pipeline.study.driver)."""
    # lazy: Ray takes seconds to import; only the paths that use the cluster pay for it
    from ray import tune

    class Progress(tune.Callback):
        def __init__(self) -> None:
            self.board = ProgressBoard(total=total, metric=metric, mode=mode)
            self.watcher = PhaseWatcher(trials_dir)
            self.polled = 0.0

        def on_step_begin(self, iteration: int, trials: list, **info: Any) -> None:
            now = time.time()
            if now - self.polled >= 1.0:
                self.polled = now
                echo(self.watcher, self.watcher.poll(now), "  ")

        def on_trial_result(self, iteration, trials, trial, result, **info):  # noqa: ANN001
            report = TrialReport.from_tune(result)
            if report.intermediate:  # a chunk's intermediate report, not a finished trial
                return
            say(self.board.line(label=report.label or str(trial.config.get("algorithm", "?")),
                                  algorithm=str(trial.config.get("algorithm", "?")), outcome=report.outcome,
                                  value=report.metric(metric), reason=report.reason, seconds=report.seconds,
                                  spread=report.tput_spread, flag=report.measurement_flag or "",
                                  remeasured=report.window_remeasured))

    return Progress()
