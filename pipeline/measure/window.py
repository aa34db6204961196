"""Was a measurement window disturbed? Two usage snapshots of the engine's node around the window
(`serve.replica.usage`, read by the replica on the engine's node) and the window's own requests, judged. Pure.

A closed-loop measurement keeps the engine busy for the whole window: every second of it the engine either runs or
waits for a core. Other work on the node shows as the engine's **run-queue wait** (its threads runnable but not
running) and as **steal** (a hypervisor running another guest on our cores). Either one beyond its limit means the
figure measured the machine, not the config: the trial re-measures the window (at most `workload.remeasure` times)
and says so; a window still disturbed after that is recorded with its flag, never silently.

A core can also be there and still run slow: a neighbour on the host's other hyperthread or its memory bus shows in
neither the run-queue wait nor steal. So on an engine that measured its own round table and times its own rounds
(the CPU engine: `solo_plain_rounds`/`solo_plain_ms` in `/server_info`), a window's **lone plain decode steps are
timed against that calibration** (`step_ratio`: their mean time over the table's plain step at their mean context;
the forward only, as the table measured it, without the HTTP and streaming around it). Beyond `STEP_LIMIT` the
figure measured a slower machine than the engine was calibrated on, and the window is re-measured and flagged as
for the other two. (A baseline measured that way fixes every prediction of simulate-first and every `vs_baseline`:
on one 2-core AMD EPYC a first baseline streamed its tokens 37.5 ms apart against 25.5 ms in its own three re-runs,
with no wait and no steal, and the first prediction missed by 30%.)

The window's own spread (per-request throughput: the median and the median absolute deviation over it) travels
with the figure: the search, early stopping and simulate-first read it as the measurement's noise.

Limits (docs/benchmarks.md, "Repeatability"; `workload.wait_limit` sets the first): on a quiet 2-core machine a
study's engine waits for a core in under WAIT_LIMIT of its runnable time, with the load generator, Serve and Ray's
daemons beside it; a busy core beside the study pushes it well past.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import Field

from pipeline.measure.server_info import PlainSteps
from pipeline.measure.summary import RequestRecord
from serve.replica.usage import Usage
from serve.spec import FrozenModel

__all__ = ["STEAL_LIMIT", "STEP_LIMIT", "WAIT_LIMIT", "Window", "flag", "judge_window", "request_spread",
           "step_ratio", "window_record"]

WAIT_LIMIT = 0.15  # share of the engine's runnable time spent waiting for a core
STEAL_LIMIT = 0.05  # share of the node's CPU time taken by the hypervisor
MIN_ENGINE_CPU_S = 0.2  # engine CPU seconds below which its wait share is not judged
STEP_LIMIT = 1.5  # a plain decode step's measured time over the engine's calibrated one (`workload.step_limit`)
MIN_STEP_ROUNDS = 8  # fewer timed steps in a window say too little about the machine


class Window(FrozenModel):
    """One measurement window's checks. `disturbed` is None when the node could not be read (not Linux, or no
    engine process on this node): such a window is recorded as unchecked."""

    wall_s: float = Field(ge=0)
    engine_cores: float | None = None  # engine CPU seconds per wall second
    wait_share: float | None = None  # run-queue wait / (run + wait) of the engine's threads
    # of that share, what the engine's own threads make it wait: their runnable time beyond the node's cores (an
    # engine of several busy processes, vLLM's API server, engine core and OpenMP threads, waits for itself)
    own_wait_share: float | None = None
    steal_share: float | None = None  # steal / all CPU time of the node
    others_cores: float | None = None  # the node's busy CPU seconds outside the engine, per wall second
    load1: float | None = None
    requests: int = 0
    tput_median: float | None = None  # per-request throughput (completion tokens / e2e), tok/s
    tput_mad: float | None = None
    step_ratio: float | None = None  # the window's lone plain steps over the engine's calibrated step
    disturbed: bool | None = None
    reasons: tuple[str, ...] = ()

    @property
    def spread(self) -> float | None:
        """The per-request throughput's MAD relative to its median."""
        if self.tput_median is None or self.tput_mad is None or self.tput_median <= 0:
            return None
        return self.tput_mad / self.tput_median

    def line(self) -> str:
        """One line for the console and the trial's record."""
        parts = [f"{self.wall_s:.1f} s"]
        if self.wait_share is not None:
            own = (f" ({self.own_wait_share:.0%} for its own threads: more runnable than the cores)"
                   if self.own_wait_share else "")
            parts.append(f"engine waited {self.wait_share:.0%} of its runnable time{own}")
        if self.steal_share is not None and self.steal_share > 0.005:
            parts.append(f"steal {self.steal_share:.0%}")
        if self.others_cores is not None:
            parts.append(f"other work {self.others_cores:.2f} cores")
        if self.step_ratio is not None:
            parts.append(f"steps {self.step_ratio:.2f}x calibrated")
        verdict = {None: "unchecked", False: "clean", True: "DISTURBED: " + "; ".join(self.reasons)}[self.disturbed]
        return f"{verdict} ({', '.join(parts)})"


def request_spread(records: Sequence[RequestRecord]) -> tuple[float | None, float | None]:
    """(median, MAD) of the successful requests' throughput (completion tokens / e2e seconds)."""
    rates = [r.completion_tokens / r.e2e_s for r in records if r.ok and r.e2e_s > 0 and r.completion_tokens > 0]
    if not rates:
        return None, None
    median = statistics.median(rates)
    return median, statistics.median(abs(x - median) for x in rates)


def step_ratio(before: PlainSteps | None, after: PlainSteps | None,
               calibrated_ms: Callable[[float], float], min_rounds: int = MIN_STEP_ROUNDS) -> float | None:
    """The window's lone plain decode steps over the engine's calibrated step: the mean of the rounds between two
    snapshots of the engine's counters (`ServerInfo.plain_steps`) over `calibrated_ms(mean context)`. None when the
    engine keeps no such counters or timed fewer than `min_rounds`."""
    if before is None or after is None:
        return None
    rounds = after.rounds - before.rounds
    if rounds < min_rounds:
        return None
    expected = calibrated_ms((after.context - before.context) / rounds)
    if expected <= 0:
        return None
    return (after.ms - before.ms) / rounds / expected


def judge_window(before: Usage | None, after: Usage | None, records: Sequence[RequestRecord], *,
                 wait_limit: float = WAIT_LIMIT, steal_limit: float = STEAL_LIMIT,
                 steps: float | None = None, step_limit: float = STEP_LIMIT) -> Window:
    """The window between `before` and `after` (snapshots of one node), with its measured `records`. `steps`: its
    `step_ratio`, when the engine could tell; judged against `step_limit`, also where /proc cannot be read."""
    median, mad = request_spread(records)
    base: dict[str, Any] = {"requests": sum(1 for r in records if r.ok), "tput_median": median, "tput_mad": mad}
    reasons: list[str] = []
    checked = False
    ratio = steps
    if ratio is not None:
        base["step_ratio"] = ratio
        checked = True
        if ratio > step_limit:
            reasons.append(f"the engine's plain steps took {ratio:.2f}x its own calibrated step (limit "
                           f"{step_limit:.2f}x): the machine ran slower than when the engine measured its round table")
    if before is None or after is None or after.at_s <= before.at_s:
        return Window(wall_s=0.0, **base, disturbed=bool(reasons) if checked else None, reasons=tuple(reasons))
    wall = after.at_s - before.at_s
    out: dict[str, Any] = {"wall_s": wall, "load1": after.load1, **base}
    engine_cpu = None
    if before.engine_cpu_s is not None and after.engine_cpu_s is not None:
        engine_cpu = max(0.0, after.engine_cpu_s - before.engine_cpu_s)
        out["engine_cores"] = engine_cpu / wall
    # An engine that barely ran (hung, dead, or a window of a few milliseconds) has no wait share worth judging.
    if (engine_cpu is not None and engine_cpu >= MIN_ENGINE_CPU_S and before.engine_wait_s is not None
            and after.engine_wait_s is not None):
        wait = max(0.0, after.engine_wait_s - before.engine_wait_s)
        if engine_cpu + wait > 0:
            share = wait / (engine_cpu + wait)
            out["wait_share"] = share
            checked = True
            # Runnable time beyond cores x wall is waited for whatever else runs: only the wait past it is other
            # work's. The CPU engine's demand stays under the cores (this is 0 and nothing changes); vLLM's asked
            # 3.2-3.3 core-seconds a second of a 2-core node with 0.2 cores of other work beside it, 43-47% waited.
            own = max(0.0, engine_cpu + wait - after.cpus * wall) / (engine_cpu + wait)
            if own > 0:
                out["own_wait_share"] = own
            if share - own > wait_limit:
                beyond = f", {share - own:.0%} beyond its own threads' demand" if own > 0 else ""
                reasons.append(f"the engine waited for a core {share:.0%} of its runnable time{beyond} (limit "
                               f"{wait_limit:.0%}): other work held the CPU")
    if before.node is not None and after.node is not None:
        busy = after.node.busy_s - before.node.busy_s
        total = busy + (after.node.idle_s - before.node.idle_s) + (after.node.steal_s - before.node.steal_s)
        if total > 0:
            steal = max(0.0, after.node.steal_s - before.node.steal_s) / total
            out["steal_share"] = steal
            checked = True
            if steal > steal_limit:
                reasons.append(f"the hypervisor took {steal:.0%} of the CPU time (steal; limit {steal_limit:.0%})")
        if engine_cpu is not None:
            out["others_cores"] = max(0.0, busy - engine_cpu) / wall
    return Window(**out, disturbed=bool(reasons) if checked else None, reasons=tuple(reasons))


def window_record(windows: Sequence[Window]) -> tuple[dict[str, float], dict[str, str], dict[str, str]]:
    """MLflow metrics, tags and artifact texts of a pass's windows (the recorded one last), the same for a trial and
    a finalist re-run: `window_remeasured` (windows measured again), the recorded window's checks and the
    per-request spread (`tput_spread`); tag `measurement_window` is its line, `measurement_flag` "clean",
    "re-measured", "disturbed" or "unchecked"; `windows.json` every window."""
    if not windows:
        return {}, {}, {}
    last = windows[-1]
    metrics: dict[str, float] = {"window_remeasured": float(len(windows) - 1)}
    for name, value in (("window_wait_share", last.wait_share), ("window_steal_share", last.steal_share),
                        ("window_others_cores", last.others_cores), ("window_engine_cores", last.engine_cores),
                        ("window_step_ratio", last.step_ratio), ("tput_spread", last.spread)):
        if value is not None:
            metrics[name] = float(value)
    return (metrics, {"measurement_window": last.line()[:500], "measurement_flag": flag(windows)},
            {"windows.json": json.dumps([w.model_dump(mode="json") for w in windows], indent=2)})


def flag(windows: Sequence[Window]) -> str:
    """"disturbed" when the recorded window still was; "re-measured" when an earlier one was; "unchecked" when none
    could be judged; else "clean"."""
    if not windows:
        return "unchecked"
    if windows[-1].disturbed:
        return "disturbed"
    if len(windows) > 1:
        return "re-measured"
    return "unchecked" if windows[-1].disturbed is None else "clean"
