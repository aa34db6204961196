"""The promotion decision: should a finalist replace the baseline? Pure and unit-tested (docs/design.md, "Promotion").

Every finalist and the baseline are re-measured (>= `policy.runs` runs each, a freshly started engine, flush +
warm-up each time). A finalist's score = median - 1.4826 x MAD of its throughputs: a noise-penalized centre, so a
config whose runs scatter is not trusted with its median.

The bar a finalist must beat (strictly) is the baseline's MEDIAN raised by the larger of the policy margin
(`margin` x median) and the baseline's own noise (1.4826 x MAD): never the baseline's noise-lowered score, which would
let a noisy baseline lower the bar until a slower config wins. So a finalist is promoted only when even its pessimistic
centre is above the baseline's typical run by more than both the required gain and the baseline's scatter.

A re-run that failed (an engine that did not answer every request; reported as a failure or as 0 tok/s) is not a
throughput: a failed baseline re-run leaves the bar unknown and the decision is "keep_baseline" with that reason
(re-run the promotion to decide); a finalist with a failed re-run cannot win. A finalist that failed an equivalence
check is disqualified (unless the policy says equivalence is not required). Of the finalists above the bar, every one
whose score is within `tie_tolerance` of the best is tied, and the one with the fewest draft tokens wins (cheaper to
verify, less to lose when the workload shifts); then the higher score, then the id. "keep_baseline" is a valid outcome.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.config import PromotionPolicy
from serve.spec import SpecConfig, draft_token_count

MAD_TO_SIGMA = 1.4826  # scales the MAD of normal data to its standard deviation


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class Finalist(_Frozen):
    """A re-measured candidate. Give its `spec` or its `draft_tokens` (draft tokens per verify step, root excluded).
    `throughputs` holds one entry per re-run (0 for a run that failed); `failures` says why runs failed."""

    id: str = Field(min_length=1)
    throughputs: tuple[float, ...]
    equivalent: bool = Field(description="every equivalence check of every run passed")
    spec: SpecConfig | None = None
    draft_tokens: int | None = Field(None, ge=0)
    failures: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> Finalist:
        if self.spec is None and self.draft_tokens is None:
            raise ValueError(f"finalist {self.id!r}: give spec or draft_tokens (needed by the tie rule), got neither")
        if self.spec is not None and self.draft_tokens not in (None, draft_token_count(self.spec)):
            raise ValueError(
                f"finalist {self.id!r}: draft_tokens={self.draft_tokens} disagrees with its spec, which asks for "
                f"{draft_token_count(self.spec)}; give one of the two")
        _check_runs(f"finalist {self.id!r}", self.throughputs)
        return self

    @property
    def n_draft_tokens(self) -> int:
        if self.draft_tokens is not None:
            return self.draft_tokens
        return draft_token_count(self.spec)  # type: ignore[arg-type]  # _check guarantees a spec here

    @property
    def failed_runs(self) -> list[str]:
        return failed_runs(self.throughputs, self.failures)


class RunStats(_Frozen):
    """Robust summary of repeated throughput runs (tok/s). `mad` is the raw median absolute deviation."""

    runs: tuple[float, ...]
    median: float
    mad: float
    score: float


class CandidateScore(RunStats):
    """One finalist's result: its stats, and why it lost (None for the winner)."""

    id: str
    draft_tokens: int
    equivalent: bool
    beats_baseline: bool
    lost_because: str | None


class Decision(_Frozen):
    """The outcome: promote `winner`, or keep the baseline. `bar` is the score a finalist had to beat (None when a
    failed baseline re-run left it unknown)."""

    kind: Literal["promote", "keep_baseline"]
    winner: str | None
    baseline: RunStats
    bar: float | None
    candidates: tuple[CandidateScore, ...]
    policy: PromotionPolicy
    reason: str


def run_stats(throughputs: Sequence[float]) -> RunStats:
    """Median, MAD and score = median - 1.4826 x MAD of repeated throughput runs."""
    runs = tuple(float(x) for x in throughputs)
    _check_runs("runs", runs)
    median = statistics.median(runs)
    mad = statistics.median(abs(x - median) for x in runs)
    return RunStats(runs=runs, median=median, mad=mad, score=median - MAD_TO_SIGMA * mad)


def promotion_bar(baseline: RunStats, policy: PromotionPolicy) -> float:
    """What a finalist's score must beat: the baseline median plus max(margin x |median|, 1.4826 x MAD)."""
    return baseline.median + max(policy.margin * abs(baseline.median), MAD_TO_SIGMA * baseline.mad)


def failed_runs(throughputs: Sequence[float], failures: Sequence[str] = ()) -> list[str]:
    """Every failed re-run: the reasons given, plus a note for each 0 tok/s run without one."""
    zeros = sum(1 for x in throughputs if x == 0)
    return list(failures) + [f"a re-run measured 0 tok/s"] * max(0, zeros - len(failures))


def decide(
    baseline_throughputs: Sequence[float], finalists: Sequence[Finalist], policy: PromotionPolicy | None = None,
    baseline_failures: Sequence[str] = (),
) -> Decision:
    """Apply the promotion rule (module docstring). Raises ValueError on too few runs or duplicate ids."""
    policy = policy or PromotionPolicy()
    if len(baseline_throughputs) < policy.runs:
        raise ValueError(
            f"baseline has {len(baseline_throughputs)} throughput run(s); policy.runs={policy.runs} requires "
            f"at least {policy.runs} (re-measure it, or lower promotion.runs)")
    seen: set[str] = set()
    for f in finalists:
        if f.id in seen:
            raise ValueError(f"finalist id {f.id!r} appears twice; finalist ids must be unique")
        seen.add(f.id)
        if len(f.throughputs) < policy.runs:
            raise ValueError(
                f"finalist {f.id!r} has {len(f.throughputs)} throughput run(s); policy.runs={policy.runs} "
                f"requires at least {policy.runs} (re-measure it, or lower promotion.runs)")

    base = run_stats(baseline_throughputs)
    stats = {f.id: run_stats(f.throughputs) for f in finalists}
    base_failed = failed_runs(base.runs, baseline_failures)
    if base_failed:
        return _baseline_failed(base, base_failed, finalists, stats, policy)

    bar = promotion_bar(base, policy)
    allowed = [f for f in finalists
               if (f.equivalent or not policy.require_equivalence) and not f.failed_runs]
    beating = [f for f in allowed if stats[f.id].score > bar]

    winner: Finalist | None = None
    tied: list[Finalist] = []
    if beating:
        best = max(stats[f.id].score for f in beating)
        band = best - policy.tie_tolerance * abs(best)
        tied = [f for f in beating if stats[f.id].score >= band]
        winner = min(tied, key=lambda f: (f.n_draft_tokens, -stats[f.id].score, f.id))

    noise = MAD_TO_SIGMA * base.mad
    raise_text = (f"{policy.margin:.1%} margin" if policy.margin * abs(base.median) >= noise
                  else f"its noise 1.4826 x MAD = {noise:.2f}, wider than the {policy.margin:.1%} margin")
    bar_text = f"{bar:.2f} tok/s (baseline median {base.median:.2f} + {raise_text})"
    beating_ids = {f.id for f in beating}
    tied_ids = {f.id for f in tied}
    candidates = []
    for f in finalists:
        s = stats[f.id]
        lost = None
        if winner is None or f.id != winner.id:
            lost = _why_lost(f, s, winner, stats, beating_ids, tied_ids, policy, bar_text)
        candidates.append(_candidate(f, s, beats=f.id in beating_ids, lost=lost))

    return Decision(
        kind="promote" if winner else "keep_baseline", winner=winner.id if winner else None, baseline=base, bar=bar,
        candidates=tuple(candidates), policy=policy,
        reason=_reason(winner, stats, tied, finalists, allowed, policy, bar_text))


def _candidate(f: Finalist, s: RunStats, beats: bool, lost: str | None) -> CandidateScore:
    return CandidateScore(**s.model_dump(), id=f.id, draft_tokens=f.n_draft_tokens, equivalent=f.equivalent,
                          beats_baseline=beats, lost_because=lost)


def _baseline_failed(base: RunStats, failures: list[str], finalists: Sequence[Finalist], stats: dict[str, RunStats],
                     policy: PromotionPolicy) -> Decision:
    why = (f"{len(failures)} of {len(base.runs)} baseline re-run(s) failed ({'; '.join(failures)}), so the "
           "baseline's throughput is unknown and no finalist can be shown faster")
    candidates = tuple(_candidate(f, stats[f.id], beats=False, lost=why) for f in finalists)
    return Decision(kind="keep_baseline", winner=None, baseline=base, bar=None, candidates=candidates, policy=policy,
                    reason=f"keep baseline: {why}; re-run the promotion (python -m pipeline.tune ... --resume) "
                           "once the engine answers every request")


def _check_runs(where: str, runs: Sequence[float]) -> None:
    if not runs:
        raise ValueError(f"{where}: no throughput runs given")
    bad = [x for x in runs if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0]
    if bad:
        raise ValueError(f"{where}: throughputs must be finite numbers >= 0 (tok/s), got {bad} in {list(runs)}")


def _describe(f: Finalist, s: RunStats) -> str:
    return f"{f.id!r} scored {s.score:.2f} tok/s (median {s.median:.2f}, MAD {s.mad:.2f}, {len(s.runs)} runs)"


def _why_lost(
    f: Finalist, s: RunStats, winner: Finalist | None, stats: dict[str, RunStats], beating_ids: set[str],
    tied_ids: set[str], policy: PromotionPolicy, bar_text: str,
) -> str:
    if f.failed_runs:
        return f"{len(f.failed_runs)} of its re-runs failed ({'; '.join(f.failed_runs)}), so it cannot be promoted"
    if policy.require_equivalence and not f.equivalent:
        return "failed an equivalence check (outputs differ from the baseline's), so it cannot be promoted"
    if f.id not in beating_ids or winner is None:
        return f"score {s.score:.2f} does not beat the bar {bar_text}"
    if f.id in tied_ids:
        if f.n_draft_tokens > winner.n_draft_tokens:
            return (f"tied with {winner.id!r} (score {s.score:.2f} within {policy.tie_tolerance:.1%} of the best) "
                    f"but uses more draft tokens ({f.n_draft_tokens} > {winner.n_draft_tokens})")
        return (f"tied with {winner.id!r} on score band and draft tokens ({f.n_draft_tokens}); "
                "lost the tie-break (higher score, then id)")
    best = max(beating_ids, key=lambda i: (stats[i].score, i))
    return (f"score {s.score:.2f} beats the bar but trails the best, {best!r} ({stats[best].score:.2f}), by more than "
            f"the {policy.tie_tolerance:.1%} tie tolerance")


def _reason(
    winner: Finalist | None, stats: dict[str, RunStats], tied: list[Finalist], finalists: Sequence[Finalist],
    allowed: list[Finalist], policy: PromotionPolicy, bar_text: str,
) -> str:
    allowed_ids = {f.id for f in allowed}
    failed = sorted(f.id for f in finalists if f.failed_runs)
    disqualified = sorted(f.id for f in finalists if f.id not in allowed_ids and not f.failed_runs)
    if not finalists:
        return "keep baseline: no finalists were given"
    if winner is not None:
        text = f"promote: {_describe(winner, stats[winner.id])}, which beats the bar {bar_text}"
        if winner.equivalent:
            text += "; its outputs passed every equivalence check"
        else:
            text += "; its outputs FAILED an equivalence check (allowed because policy.require_equivalence=False)"
        if len(tied) > 1:
            others = sorted(f.id for f in tied if f.id != winner.id)
            text += (f"; chosen over {others} (scores within {policy.tie_tolerance:.1%} of the best) for the fewest "
                     f"draft tokens ({winner.n_draft_tokens})")
    elif not allowed:
        text = "keep baseline: no finalist is eligible"
    else:
        best = max(allowed, key=lambda f: stats[f.id].score)
        text = (f"keep baseline: no finalist beats the bar {bar_text}; "
                f"the best eligible, {_describe(best, stats[best.id])}")
    if disqualified:
        text += f"; disqualified for failing an equivalence check: {disqualified}"
    if failed:
        text += f"; disqualified for a failed re-run: {failed}"
    return text
