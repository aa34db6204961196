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
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MIN_RUNS", "Suspect", "spread", "suspect_run"]

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
