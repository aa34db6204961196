"""Drift test: is the served config still what the study measured? A one-sided CUSUM per figure and concurrency
bucket, over window means of live per-request figures, against the study's figures at the same level. Pure.

Figures: per-request accept length (completion tokens / verify steps) and per-request throughput (completion tokens /
e2e seconds), as `serve.closed_loop.live.LiveRecord` defines them and `pipeline.measure.summary` measures them in a study.

The reference (`MetricReference`, from the study's re-measured requests of the served config at one level): mean,
per-request sd, and the uncertainty of the mean, `se` = sd of the per-prompt means / sqrt(prompts) (a study repeats
the same prompts in every run, so the prompts, not the requests, are the independent draws).

The test. Live requests are taken in windows of `window` requests; x = a window's mean. The boundaries, with m the
reference mean:
    mu_a = m - z * se - tolerance * m      no drift while the live mean is at or above this
    mu_b = mu_a - min_drop * m             the drift the test is tuned to catch
and the Gaussian log-likelihood-ratio CUSUM of mu_b against mu_a,
    S = max(0, S + (mu_a - mu_b) / s^2 * ((mu_a + mu_b) / 2 - x)),    alarm when S >= threshold,
with s the standard error of a window mean: the larger of sd_ref / sqrt(window) and the live windows' own scatter
(1.4826 x the median absolute difference of consecutive window means / sqrt(2), which a step change does not
inflate and which includes any correlation between requests of one window). A larger s only slows the walk, so
both choices err towards fewer alarms.

False alarms. For Gaussian window means with known s and a live mean at mu_a, Lorden's bound gives a mean run of
at least e^threshold windows before a false alarm (e^8 = 2981 windows = 47,700 requests at the defaults); a live
mean above mu_a (no drift) runs longer. What is left is the reference's own error: m overstating the truth by more
than z * se + (tolerance + min_drop / 2) * m makes an alarm certain, which with the default z happens in well under
1% of references. `tests/unit/test_loop_drift.py` measures both together on seeded synthetic studies and traffic
(stated rates there and in docs/loop.md); detection delay after a step change is measured the same way.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Literal

from pydantic import ConfigDict, Field

from serve.closed_loop.live import LiveRecord, bucket_of
from serve.spec import FrozenModel

__all__ = ["Metric", "METRICS", "MetricReference", "DriftSettings", "DetectorState", "DriftVerdict",
           "metric_reference", "boundaries", "update", "verdict", "record_value"]

Metric = Literal["accept_length", "tput_tok_s"]
METRICS: tuple[Metric, ...] = ("accept_length", "tput_tok_s")
MAD_TO_SIGMA = 1.4826
_KEEP_WINDOWS = 64  # window means kept for the live scale estimate


class _Model(FrozenModel):
    model_config = ConfigDict(**FrozenModel.model_config, allow_inf_nan=False)


class MetricReference(_Model):
    """The study's figure at one concurrency level."""

    metric: Metric
    level: int = Field(ge=1)
    requests: int = Field(ge=1)
    prompts: int = Field(ge=1)
    mean: float = Field(gt=0)
    sd: float = Field(ge=0)
    se: float = Field(ge=0, description="uncertainty of `mean`: sd of the per-prompt means / sqrt(prompts)")


class DriftSettings(_Model):
    """Thresholds of the drift test (module docstring). The defaults are the ones docs/loop.md states rates for."""

    window: int = Field(16, ge=4, description="live requests per window mean")
    tolerance: float = Field(0.05, ge=0, lt=1, description="a drop smaller than this fraction of the study's figure "
                                                           "is not drift")
    min_drop: float = Field(0.15, gt=0, lt=1, description="further drop (fraction of the study's figure) the test "
                                                          "is tuned to detect")
    threshold: float = Field(8.0, gt=0, description="CUSUM threshold (log-likelihood ratio): mean run before a "
                                                    "false alarm >= e^threshold windows")
    reference_z: float = Field(2.0, ge=0, description="one-sided z of the study's figure's lower confidence bound")
    min_prompts: int = Field(8, ge=2, description="a level whose study measured fewer distinct prompts is not "
                                                  "tested (4-prompt references false-alarmed in 2% of 300 simulated "
                                                  "streams: drift_check --prompts 4 --seeds 300)")


class DetectorState(_Model):
    """One figure's test at one bucket; persisted between polls (the loop's state file)."""

    metric: Metric
    bucket: int
    statistic: float = 0.0
    requests: int = 0
    windows: int = 0
    pending: tuple[float, ...] = ()
    recent: tuple[float, ...] = Field((), description="the last window means (live scale estimate)")
    live_sum: float = 0.0
    alarm_at: int | None = Field(None, description="requests seen when the alarm was raised; it stays raised")
    peak: float = 0.0


class DriftVerdict(_Model):
    metric: Metric
    bucket: int
    level: int
    alarm: bool
    statistic: float
    threshold: float
    requests: int
    live_mean: float | None
    reference_mean: float
    no_drift_above: float
    drop: float | None = Field(description="1 - live mean / reference mean")
    text: str


def metric_reference(metric: Metric, level: int, values: Sequence[tuple[str, float]]) -> MetricReference | None:
    """From (prompt id, per-request value) pairs of one level; None without a value. Pure."""
    clean = [(p, float(v)) for p, v in values if v is not None and math.isfinite(v)]
    if not clean:
        return None
    numbers = [v for _, v in clean]
    mean = statistics.fmean(numbers)
    if mean <= 0:
        return None
    sd = statistics.stdev(numbers) if len(numbers) > 1 else 0.0
    by_prompt: dict[str, list[float]] = defaultdict(list)
    for prompt, value in clean:
        by_prompt[prompt].append(value)
    prompt_means = [statistics.fmean(v) for v in by_prompt.values()]
    se = statistics.stdev(prompt_means) / math.sqrt(len(prompt_means)) if len(prompt_means) > 1 else sd
    return MetricReference(metric=metric, level=level, requests=len(numbers), prompts=len(prompt_means), mean=mean,
                           sd=sd, se=se)


def boundaries(ref: MetricReference, settings: DriftSettings) -> tuple[float, float]:
    """(mu_a, mu_b): no drift at or above mu_a; the test is tuned to a live mean of mu_b."""
    mu_a = ref.mean - settings.reference_z * ref.se - settings.tolerance * ref.mean
    return mu_a, mu_a - settings.min_drop * ref.mean


def record_value(metric: Metric, record: LiveRecord) -> float | None:
    return record.accept_length if metric == "accept_length" else record.tput_tok_s


def _live_scale(recent: Sequence[float]) -> float | None:
    if len(recent) < 8:
        return None
    diffs = [abs(b - a) for a, b in zip(recent, recent[1:])]
    return MAD_TO_SIGMA * statistics.median(diffs) / math.sqrt(2)


def update(state: DetectorState, ref: MetricReference, settings: DriftSettings,
           values: Iterable[float]) -> DetectorState:
    """Feed live per-request values (in arrival order) into one detector; returns the new state. Pure."""
    mu_a, mu_b = boundaries(ref, settings)
    gap, middle = mu_a - mu_b, (mu_a + mu_b) / 2
    statistic, windows, requests, alarm_at, peak = state.statistic, state.windows, state.requests, state.alarm_at, \
        state.peak
    pending, recent, total = list(state.pending), list(state.recent), state.live_sum
    for value in values:
        pending.append(float(value))
        requests += 1
        total += float(value)
        if len(pending) < settings.window:
            continue
        mean = statistics.fmean(pending)
        pending = []
        recent = (recent + [mean])[-_KEEP_WINDOWS:]
        scale = max(ref.sd / math.sqrt(settings.window), _live_scale(recent) or 0.0)
        if scale <= 0:
            scale = max(abs(ref.mean) * 1e-3, 1e-9)  # a constant figure: any drop beyond the band is evidence
        statistic = max(0.0, statistic + gap / scale ** 2 * (middle - mean))
        windows += 1
        peak = max(peak, statistic)
        if alarm_at is None and statistic >= settings.threshold:
            alarm_at = requests
    return state.model_copy(update={"statistic": statistic, "windows": windows, "requests": requests,
                                    "pending": tuple(pending), "recent": tuple(recent), "live_sum": total,
                                    "alarm_at": alarm_at, "peak": peak})


def verdict(state: DetectorState, ref: MetricReference, settings: DriftSettings) -> DriftVerdict:
    """What the detector says now, in words a person can check (figure, reference, boundary, statistic)."""
    mu_a, _ = boundaries(ref, settings)
    live = state.live_sum / state.requests if state.requests else None
    drop = 1 - live / ref.mean if live is not None else None
    name = "accept length" if state.metric == "accept_length" else "per-request tok/s"
    where = f"{name} at concurrency {_bucket_text(state.bucket)} (study level {ref.level})"
    if live is None:
        text = f"{where}: no live requests yet"
    else:
        text = (f"{where}: live mean {live:.3g} over {state.requests} requests vs study {ref.mean:.3g} "
                f"({drop:+.1%} drop; no drift above {mu_a:.3g}); CUSUM {state.statistic:.2f} of {settings.threshold:g}")
        if state.alarm_at is not None:
            text = f"DRIFT: {text} (alarm after {state.alarm_at} requests)"
    return DriftVerdict(metric=state.metric, bucket=state.bucket, level=ref.level, alarm=state.alarm_at is not None,
                        statistic=state.statistic, threshold=settings.threshold, requests=state.requests,
                        live_mean=live, reference_mean=ref.mean, no_drift_above=mu_a, drop=drop, text=text)


def _bucket_text(bucket: int) -> str:
    low = bucket // 2 + 1
    return str(bucket) if low >= bucket else f"{low}-{bucket}"


def level_for_bucket(levels: Iterable[int], bucket: int) -> int | None:
    """The study level live requests of `bucket` are compared with: the highest level in that bucket."""
    inside = [level for level in levels if bucket_of(level) == bucket]
    return max(inside) if inside else None
