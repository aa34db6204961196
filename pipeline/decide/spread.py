"""Do a config's fresh re-runs agree? Pure.

A window's own checks (pipeline/measure/window.py) see other work on the machine and, on the CPU engine, plain
decode steps slower than the engine's calibration. They do not see one engine instance that runs slow as a whole: on a
2-core AMD EPYC one NGRAM re-run measured 30.90 tok/s against 44.73 and 45.05 in the other two, its TTFT and decode
both ~1.4x slower, in a window every check called clean (no plain steps to time: every step was a verify). The
promotion rule is robust to one such run (a median and a MAD), but a serving team reads the runs' spread.

So the runs are judged against each other: when the fastest over the slowest exceeds the limit, the run farthest
from the median (in ratio) is the suspect; the caller measures it again in a fresh engine and replaces it, recording
the replaced run with its flag (`pipeline.study.finalists`). Only measured runs count: a failed run is a failure,
recorded as one, not an outlier.

The order the runs are measured in (`run_order`): whatever moves the machine over a finalist stage's minutes (the
page cache, other work, the engine's own slow first minutes) must move the baseline and the finalists alike, so their
fresh engines are interleaved, ABBA-style: round k starts one engine per config, the baseline's first and the
finalists' in turn, and every odd round runs reversed (B F1 F2 | F2 F1 B | B F1 F2 ...). The baseline's first run
still leads the stage (the equivalence checks compare against it). Run k of a finalist is paired with run k of the
baseline, the baseline run adjacent to its round, and the ratio and its spread come from those pairs
(`paired_ratios`): a drift moves one pair by at most the finalists' count of slots, in turn up and down, where the
sequential order (every baseline run, then each finalist's) moves every pair by the whole stage one way.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["MIN_RUNS", "ORDERS", "RunOrder", "Suspect", "gap_at_equal_steps", "paired_ratios", "run_order", "spread",
           "suspect_run"]

RunOrder = Literal["interleaved", "sequential"]
ORDERS: tuple[RunOrder, ...] = ("interleaved", "sequential")

MIN_RUNS = 3  # with two runs, neither can be told to be the odd one


@dataclass(frozen=True)
class Suspect:
    index: int  # position in the throughputs given
    tput_tok_s: float
    median_tok_s: float  # the median of all the runs given
    spread: float  # their fastest over slowest

    def line(self, limit: float) -> str:
        off = max(self.tput_tok_s, self.median_tok_s) / min(self.tput_tok_s, self.median_tok_s)
        side = "below" if self.tput_tok_s < self.median_tok_s else "above"
        return (f"{self.tput_tok_s:.2f} tok/s, {off:.2f}x {side} the runs' median {self.median_tok_s:.2f} "
                f"(fastest/slowest {self.spread:.2f}, limit {limit:.2f})")


def spread(throughputs: Sequence[float]) -> float | None:
    """Fastest over slowest of the positive throughputs; None with fewer than two."""
    measured = [t for t in throughputs if t > 0]
    return max(measured) / min(measured) if len(measured) >= 2 else None


def suspect_run(throughputs: Sequence[float], limit: float) -> Suspect | None:
    """The run to measure again, or None when the measured runs (throughput > 0) are within `limit` (fastest over
    slowest) or fewer than MIN_RUNS were measured. Of two runs equally far from the median, the first."""
    measured = [(i, t) for i, t in enumerate(throughputs) if t > 0]
    if len(measured) < MIN_RUNS:
        return None
    ratio = spread([t for _, t in measured])
    if ratio is None or ratio <= limit:
        return None
    median = statistics.median(t for _, t in measured)
    index, tput = max(measured, key=lambda item: (abs(math.log(item[1] / median)), -item[0]))
    return Suspect(index=index, tput_tok_s=tput, median_tok_s=median, spread=ratio)


def run_order(configs: int, runs: int, order: RunOrder = "interleaved") -> list[tuple[int, int]]:
    """The stage's measuring order as (config index, run k), config 0 being the baseline (module docstring).
    "sequential": every run of config 0, then of config 1, ... (kept for comparing the two orders)."""
    if configs < 1 or runs < 1:
        raise ValueError(f"run_order needs configs >= 1 and runs >= 1, got configs={configs}, runs={runs}")
    if order == "sequential":
        return [(c, k) for c in range(configs) for k in range(runs)]
    if order != "interleaved":
        raise ValueError(f"run order {order!r} is not one of {list(ORDERS)}")
    out: list[tuple[int, int]] = []
    for k in range(runs):
        round_ = [(c, k) for c in range(configs)]
        out += reversed(round_) if k % 2 else round_
    return out


def paired_ratios(baseline: Sequence[float], runs: Sequence[float]) -> list[float]:
    """Each run's throughput over its paired baseline run's (run k with baseline run k), for the pairs where both
    were measured (throughput > 0)."""
    return [t / b for t, b in zip(runs, baseline) if t > 0 and b > 0]


def gap_at_equal_steps(search: tuple[float, float | None], reruns: Sequence[tuple[float, float | None]]
                       ) -> float | None:
    """How far the search's baseline run was from its re-runs' median had every window run the engine's plain steps
    at one speed: each (tok/s, step ratio) taken as tok/s x its window's step ratio (the steps' time over the
    engine's calibrated step, pipeline/measure/window.py), the same -0.1 = 10% below as the raw gap. None unless the
    search run and every measured re-run timed their steps.

    On the CPU engine a baseline window's throughput follows the speed its plain steps ran at: over four default
    studies on one 2-core AMD EPYC, tok/s x step ratio stayed within 1.3-3.0% across each study's baseline windows
    while the raw figures spread up to 19% (docs/benchmarks.md, "Three in a row"). A raw gap that this one
    does not share is the machine's speed when each window ran, which the window check measured, not the config."""
    measured = [(t, r) for t, r in reruns if t > 0]
    if not measured or search[1] is None or any(r is None for _, r in measured):
        return None
    steady = statistics.median(t * (r or 0.0) for t, r in measured)
    return search[0] * search[1] / steady - 1 if steady > 0 else None
