"""The engine's own divergence (the baseline against itself) and the `baseline-noise` equivalence test. Pure.

On a GPU in bf16 under continuous batching, greedy outputs depend on the batch each token was computed in: the
baseline run twice at the same concurrency does not give the same tokens, and a lossless speculative config diverges
from the baseline the same way. So under `promotion.equivalence: baseline-noise` a config passes when its outputs
disagree with the baseline's no more than the baseline's own re-runs disagree with each other, at the same level.

Items: one output per (prompt, occurrence) of the measurement phase; a workload that cycles sends a prompt several
times, and each repeat is its own item. Agreement of two outputs = their common prefix / the longer one's length (1.0
for identical outputs, 0.0 when the first token differs).

The test (`noise_test`): one baseline run is the reference (R_0). Per item, `s` = the mean agreement of the other
baseline runs with R_0 and `c` = the mean agreement of the candidate's runs with R_0, over the same number `m` of runs
on each side (m = min(candidate runs, baseline runs - 1)). The candidate is worse on an item when c < s, better when
c > s; ties (both identical to R_0, the usual case) carry no information and are dropped. Under the null hypothesis
that the candidate's runs are just more draws of the baseline's noise (exchangeable with the baseline's runs), worse
and better are equally likely on every item, so the count of worse items among the n untied ones is Binomial(n, 1/2):
the one-sided exact sign test rejects when P(Binomial(n, 1/2) >= worse) < alpha. Its false-reject rate is at most
alpha when items diverge independently (docs/configuration.md gives the measured rate, the items-correlated case and
the power); a config that emits wrong tokens is worse on every item, p = 2^-n.
Equal `m` on both sides matters: a mean over more runs is less often exactly 1.0, which would bias the signs.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from itertools import combinations

from pydantic import BaseModel, ConfigDict, Field

from pipeline.config.policy import min_items
from pipeline.measure.summary import RequestRecord

__all__ = ["Outputs", "run_outputs", "agreement", "first_divergence", "min_items", "binomial_tail",
           "DivergenceFigures", "SelfDivergence", "NoiseVerdict", "self_divergence", "self_metrics", "pair_divergence",
           "noise_test"]

Item = tuple[int, int]  # (prompt_index, occurrence of that prompt in the run)
Outputs = Mapping[Item, tuple[int, ...]]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def run_outputs(records: Iterable[RequestRecord]) -> dict[Item, tuple[int, ...]]:
    """One run's successful measurement outputs by (prompt_index, occurrence), in the order they were sent."""
    seen: dict[int, int] = defaultdict(int)
    out: dict[Item, tuple[int, ...]] = {}
    for r in sorted((r for r in records if r.phase == "measure"), key=lambda r: (r.start_s, r.request_id)):
        k = seen[r.prompt_index]
        seen[r.prompt_index] += 1
        if r.ok:
            out[(r.prompt_index, k)] = tuple(r.output_ids)
    return out


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix: the first position where the outputs differ (= the shorter length when one is
    a prefix of the other)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def agreement(a: Sequence[int], b: Sequence[int]) -> float:
    """Common prefix / the longer output's length; 1.0 for identical outputs (two empty ones included)."""
    longest = max(len(a), len(b))
    return first_divergence(a, b) / longest if longest else 1.0


def binomial_tail(k: int, n: int) -> float:
    """P(X >= k) for X ~ Binomial(n, 1/2), exact."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n


class DivergenceFigures(_Frozen):
    """How two sets of runs disagree, item by item: the share of identical outputs, the token agreement (matched
    prefix tokens over the longer outputs' tokens, all items pooled), the mean per-item agreement, and where the
    non-identical outputs first differ (summary quantiles and the positions, capped)."""

    pairs: int = Field(description="output pairs compared (run pairs x items)")
    identical_share: float | None
    token_agreement: float | None
    mean_agreement: float | None
    divergent: int
    first_divergence_min: int | None = None
    first_divergence_p10: float | None = None
    first_divergence_p50: float | None = None
    first_divergence_p90: float | None = None
    first_divergence_max: int | None = None
    first_divergence_positions: tuple[int, ...] = Field((), description="sorted, at most 200")


class SelfDivergence(DivergenceFigures):
    """The baseline against itself at one concurrency level: every pair of its successful runs."""

    level: int
    runs: int


def _quantile(values: Sequence[int], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low, high = math.floor(pos), math.ceil(pos)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (pos - low))


def _figures(pairs: Sequence[tuple[tuple[int, ...], tuple[int, ...]]]) -> dict[str, object]:
    if not pairs:
        return dict(pairs=0, identical_share=None, token_agreement=None, mean_agreement=None, divergent=0)
    positions = [first_divergence(a, b) for a, b in pairs if a != b]
    matched = sum(first_divergence(a, b) for a, b in pairs)
    longest = sum(max(len(a), len(b)) for a, b in pairs)
    figures: dict[str, object] = dict(
        pairs=len(pairs), identical_share=1 - len(positions) / len(pairs),
        token_agreement=matched / longest if longest else 1.0,
        mean_agreement=sum(agreement(a, b) for a, b in pairs) / len(pairs), divergent=len(positions))
    if positions:
        figures.update(first_divergence_min=min(positions), first_divergence_max=max(positions),
                       first_divergence_p10=_quantile(positions, 0.1), first_divergence_p50=_quantile(positions, 0.5),
                       first_divergence_p90=_quantile(positions, 0.9),
                       first_divergence_positions=tuple(sorted(positions)[:200]))
    return figures


def self_divergence(level: int, runs: Sequence[Outputs]) -> SelfDivergence:
    """The baseline's runs at one level against each other (every pair, items present in both)."""
    pairs = [(a[k], b[k]) for a, b in combinations(runs, 2) for k in sorted(set(a) & set(b))]
    return SelfDivergence(level=level, runs=len(runs), **_figures(pairs))  # type: ignore[arg-type]


def self_metrics(level: int, first: Iterable[RequestRecord], second: Iterable[RequestRecord]) -> dict[str, float]:
    """The baseline's noise pass against its first (`self_divergence` of the two) as its trial run's `self_*`
    metrics: the engine's own divergence at the search level."""
    own = self_divergence(level, [run_outputs(first), run_outputs(second)])
    return {f"self_{k}": float(v) for k, v in (("identical_share", own.identical_share),
                                               ("token_agreement", own.token_agreement),
                                               ("first_div_p50", own.first_divergence_p50)) if v is not None}


def pair_divergence(reference: Outputs, others: Sequence[Outputs]) -> DivergenceFigures:
    """Each of `others` against `reference` (items of the reference; one missing in another run counts as an empty
    output, i.e. no agreement)."""
    pairs = [(reference[k], o.get(k, ())) for o in others for k in sorted(reference)]
    return DivergenceFigures(**_figures(pairs))  # type: ignore[arg-type]


class NoiseVerdict(_Frozen):
    """The sign test's answer: `passed` unless the candidate is significantly worse than the baseline's own noise."""

    passed: bool
    alpha: float
    p_value: float | None
    runs_compared: int = Field(description="m: candidate runs and other baseline runs used on each side")
    items: int
    worse: int
    better: int
    ties: int
    candidate_mean_agreement: float | None
    baseline_mean_agreement: float | None
    reason: str


def noise_test(reference: Outputs, baseline_others: Sequence[Outputs], candidates: Sequence[Outputs], *,
               alpha: float) -> NoiseVerdict:
    """The one-sided sign test of the module docstring. Items are those of the reference that every used baseline
    run also has (a baseline run that lost an item leaves its noise unknown there); a used candidate run without an
    item has no agreement on it. Not passed when it cannot be tested (no other baseline run, no candidate run, no
    item): equivalence that was not checked is not claimed."""
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha is the sign test's significance level and must be in (0, 0.5), got alpha={alpha!r}")
    m = min(len(candidates), len(baseline_others))
    common = dict(alpha=alpha, runs_compared=m)
    if m == 0:
        what = "no other baseline run at this level" if not baseline_others else "no candidate run"
        return NoiseVerdict(passed=False, p_value=None, items=0, worse=0, better=0, ties=0,
                            candidate_mean_agreement=None, baseline_mean_agreement=None,
                            reason=f"not compared: {what} (the baseline's noise needs at least two baseline runs)",
                            **common)
    others, cands = baseline_others[:m], candidates[:m]
    items = [k for k in sorted(reference) if all(k in o for o in others)]
    if not items:
        return NoiseVerdict(passed=False, p_value=None, items=0, worse=0, better=0, ties=0,
                            candidate_mean_agreement=None, baseline_mean_agreement=None,
                            reason="not compared: no output the baseline runs share", **common)
    worse = better = 0
    s_sum = c_sum = 0.0
    for k in items:
        s = sum(agreement(o[k], reference[k]) for o in others) / m
        c = sum(agreement(o.get(k, ()), reference[k]) for o in cands) / m
        s_sum, c_sum = s_sum + s, c_sum + c
        if c < s - 1e-12:
            worse += 1
        elif c > s + 1e-12:
            better += 1
    n = worse + better
    p = binomial_tail(worse, n)
    passed = p >= alpha
    ties = len(items) - n
    figures = (f"worse than the baseline's own re-runs on {worse} of {n} outputs where either diverged, better on "
               f"{better} ({ties} tied), p = {p:.3g} {'>=' if passed else '<'} alpha {alpha:g}; mean agreement with "
               f"the reference run {c_sum / len(items):.1%} vs the baseline's own {s_sum / len(items):.1%} "
               f"({m} run(s) each side)")
    return NoiseVerdict(passed=passed, p_value=p, items=len(items), worse=worse, better=better, ties=ties,
                        candidate_mean_agreement=c_sum / len(items), baseline_mean_agreement=s_sum / len(items),
                        reason=("passed: " if passed else "failed: ") + figures, **common)
