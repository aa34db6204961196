"""Early stopping of a trial that cannot beat the baseline: a pure rule over a partial measurement (no Ray, no I/O).

A trial measures `total_requests` requests (concurrency 1, the default study). After each chunk the trial passes the
measure-phase records so far to `check`, which answers CONTINUE or STOP with the bound that stopped it. Two rules,
either may stop, and both compare against the baseline's *lower* bound, so a candidate is stopped only when even the
baseline's pessimistic figure beats the candidate's optimistic one:

    baseline_low = B * exp(-z * sigma / sqrt(runs))

B is the baseline's measured throughput (mean over `runs` runs), sigma the run-to-run noise (standard deviation of
log throughput between runs of one config, e.g. `pooled sigma` of the recorded grid), z the one-sided normal quantile
of `policy.alpha`.

(a) Statistical, after >= `policy.min_requests` successful requests. Per-request throughput x_i = tokens_i / e2e_i;
    with m, s the mean and standard deviation of log x_i over k requests (s floored at `policy.request_spread_floor`,
    because k identical figures are luck, not proof of zero spread):

        candidate_high = (sum tokens / sum e2e) * exp(t_{k-1, 1-alpha} * s / sqrt(k) + z * sigma)

    The first term bounds the request-to-request sampling within this run (Student t, k-1 degrees of freedom), the
    second the run-to-run effect that every request of this run shares. Sum tokens / sum e2e counts no gaps between
    requests, so it is at least the window-based `Summary.tput_tok_s` the baseline was measured with: this errs
    towards continuing. Assumption: the measured requests so far are exchangeable with the remaining ones (the
    workload's prompts are not sorted by kind).

(b) Analytic, from the accept length (needs spec counters). One verify step of N = draft_tokens + 1 query tokens
    costs at least `step_s * cost(N)`: `step_s` is the baseline's time per decoded token (one target forward) and
    cost(N) the engine's verify-cost curve relative to N = 1 (the CPU engine's `/server_info.verify_cost.relative`;
    without a curve cost = 1, i.e. verification no dearer than a decode step, which holds for SGLang on a GPU where
    the baseline's inter-token latency is the step time). The final accept length cannot exceed what it would be
    if every remaining token were accepted at the maximum N per step:

        accept_high = (T_k + R) / (V_k + R / N),  R = remaining requests * max_new_tokens
        candidate_high = accept_high / (step_s * cost(N)) * exp(z * sigma)

    This ignores drafting time and prefill, both of which only make the candidate slower, so it errs towards
    continuing; it is a bound on what the candidate could reach, not an estimate.

False-stop rate: a candidate whose true throughput is at least the baseline's is stopped by (a) only if its upper
bound or the baseline's lower bound misses, each with probability <= alpha per look, so <= 2 * alpha * looks (looks
= total_requests - min_requests + 1). With the default alpha = 0.001 and 4 measured requests (3 looks) that is
<= 0.6%; the replay (`benchmarks/search_efficiency.py replay`) measures it on the recorded grid. (b) has no sampling
error in the accept length (it is a worst case over the remaining tokens); its only noise term is the run effect.

On the recorded grid (docs/benchmarks.md, "Search"), with a modelled per-request spread, the default workload's 4
measured requests stop about half of the slower points' trials, a few of those near the baseline's speed (5% of the
faster ones) and none of the near-best ones.

Failed requests are left out of both bounds and never stop a trial here: a lost measured request already fails
the trial (pipeline/trial/lifecycle.py), which is a different outcome from PRUNED.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from statistics import NormalDist

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.measure.summary import RequestRecord

__all__ = ["Decision", "Rule", "BaselineFigures", "VerifyCost", "StoppingPolicy", "StopResult", "check",
           "t_quantile", "decode_step_s", "baseline_figures", "rule_off"]


class Decision(str, enum.Enum):
    CONTINUE = "CONTINUE"
    STOP = "STOP"


class Rule(str, enum.Enum):
    NONE = "none"
    STATISTICAL = "statistical"
    ANALYTIC = "analytic"


class BaselineFigures(BaseModel):
    """What the baseline measured: throughput (mean over `runs` runs), run-to-run noise, time per decoded token."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tput_tok_s: float = Field(gt=0, description="baseline throughput, tokens/s, as Summary.tput_tok_s")
    sigma: float = Field(ge=0, description="run-to-run standard deviation of log throughput")
    runs: int = Field(1, ge=1, description="runs averaged into tput_tok_s")
    step_s: float | None = Field(None, gt=0, description="seconds per decoded token of the baseline (a low ITL "
                                 "percentile); None turns the analytic rule off")


class VerifyCost(BaseModel):
    """The engine's verify-cost curve: cost of one forward of N query tokens relative to N = 1."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sizes: tuple[int, ...]
    relative: tuple[float, ...]

    @model_validator(mode="after")
    def _check(self) -> VerifyCost:
        if not self.sizes or len(self.sizes) != len(self.relative):
            raise ValueError(f"verify cost: sizes {list(self.sizes)} and relative {list(self.relative)} must be "
                             "non-empty and of equal length (as /server_info.verify_cost reports them)")
        if list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"verify cost: sizes {list(self.sizes)} must be increasing integers >= 1")
        if any(not math.isfinite(r) or r <= 0 for r in self.relative):
            raise ValueError(f"verify cost: relative {list(self.relative)} must be finite and > 0")
        return self

    @classmethod
    def from_server_info(cls, info: dict) -> VerifyCost | None:
        """The curve from a `/server_info` answer; None when the engine reports none (probe off, SGLang)."""
        curve = info.get("verify_cost")
        if not curve:
            return None
        return cls(sizes=tuple(curve["sizes"]), relative=tuple(curve["relative"]))

    def cost(self, n: int) -> float:
        """Relative cost of N query tokens, at least 1 (a verify step is never cheaper than a decode step: a
        measured value below 1, like N = 2 at 0.92, is noise). Between measured sizes: the smaller neighbour's cost
        (the curve rises), beyond the largest: the largest's."""
        below = [r for s, r in zip(self.sizes, self.relative) if s <= n]
        return max(1.0, below[-1] if below else 1.0)


class StoppingPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    alpha: float = Field(0.001, gt=0, lt=0.5, description="one-sided miss probability of each bound per look")
    min_requests: int = Field(2, ge=2, description="successful measured requests before rule (a) may stop")
    request_spread_floor: float = Field(0.05, ge=0, description="floor on the per-request sd of log throughput")

    @property
    def z(self) -> float:
        return NormalDist().inv_cdf(1 - self.alpha)


class StopResult(BaseModel):
    """The decision with the numbers behind it; `reason` is the sentence for MLflow and the PRUNED trial."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    decision: Decision
    rule: Rule
    requests: int
    baseline_low_tok_s: float
    statistical_high_tok_s: float | None
    analytic_high_tok_s: float | None
    partial_tok_s: float | None
    reason: str

    @property
    def stop(self) -> bool:
        return self.decision is Decision.STOP


def check(baseline: BaselineFigures, records: Sequence[RequestRecord], *, total_requests: int, draft_tokens: int,
          max_new_tokens: int, verify_cost: VerifyCost | None = None,
          policy: StoppingPolicy | None = None) -> StopResult:
    """Decide whether a trial that measured `records` (its measure-phase requests so far, of `total_requests`)
    can still beat `baseline`; see the module docstring for both rules. `draft_tokens` as
    `serve.spec.draft_token_count` (0 for the baseline: then only rule (a) applies)."""
    policy = policy or StoppingPolicy()
    for name, value, low in (("total_requests", total_requests, 1), ("draft_tokens", draft_tokens, 0),
                             ("max_new_tokens", max_new_tokens, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {name}={value!r}")
    measured = [r for r in records if r.phase == "measure"]
    if len(measured) > total_requests:
        raise ValueError(f"{len(measured)} measured records but total_requests={total_requests}: pass the trial's "
                         "planned number of measured requests")
    ok = [r for r in measured if r.ok and r.e2e_s > 0]
    failed = len(measured) - len(ok)
    z = policy.z
    base_low = baseline.tput_tok_s * math.exp(-z * baseline.sigma / math.sqrt(baseline.runs))
    partial = sum(r.completion_tokens for r in ok) / sum(r.e2e_s for r in ok) if ok else None
    stat_high = _statistical_high(ok, baseline.sigma, policy) if len(ok) >= policy.min_requests else None
    analytic_high = (_analytic_high(ok, baseline.step_s, baseline.sigma, total_requests - len(measured),
                                    draft_tokens, max_new_tokens, verify_cost, z)
                     if draft_tokens and baseline.step_s else None)
    head = (f"after {len(ok)} of {total_requests} measured requests"
            + (f" ({failed} failed, left out)" if failed else ""))
    base_txt = (f"the baseline's lower bound {base_low:.2f} tok/s ({baseline.tput_tok_s:.2f} tok/s over "
                f"{baseline.runs} run(s), sigma {baseline.sigma:.3f}, alpha {policy.alpha:g})")
    for rule, high in ((Rule.ANALYTIC, analytic_high), (Rule.STATISTICAL, stat_high)):
        if high is not None and high < base_low:
            what = ("the best throughput its accept length so far allows" if rule is Rule.ANALYTIC
                    else "its throughput's upper confidence bound")
            return StopResult(decision=Decision.STOP, rule=rule, requests=len(ok), baseline_low_tok_s=base_low,
                              statistical_high_tok_s=stat_high, analytic_high_tok_s=analytic_high,
                              partial_tok_s=partial,
                              reason=f"stopped {head}: {what}, {high:.2f} tok/s, is below {base_txt}")
    bounds = ", ".join(f"{n} bound {v:.2f} tok/s" for n, v in (("statistical", stat_high),
                                                                ("analytic", analytic_high)) if v is not None)
    return StopResult(decision=Decision.CONTINUE, rule=Rule.NONE, requests=len(ok), baseline_low_tok_s=base_low,
                      statistical_high_tok_s=stat_high, analytic_high_tok_s=analytic_high, partial_tok_s=partial,
                      reason=f"continue {head}: {bounds or 'no bound yet'}; {base_txt}")


def _statistical_high(ok: Sequence[RequestRecord], sigma: float, policy: StoppingPolicy) -> float:
    k = len(ok)
    logs = [math.log(r.completion_tokens / r.e2e_s) if r.completion_tokens else -math.inf for r in ok]
    if any(math.isinf(v) for v in logs):
        # A request that produced no token has no log throughput; fall back to the ratio and the floor.
        spread = policy.request_spread_floor
    else:
        centre = sum(logs) / k
        spread = max(policy.request_spread_floor, math.sqrt(sum((v - centre) ** 2 for v in logs) / (k - 1)))
    ratio = sum(r.completion_tokens for r in ok) / sum(r.e2e_s for r in ok)
    exponent = t_quantile(1 - policy.alpha, k - 1) * spread / math.sqrt(k) + policy.z * sigma
    # With 1-2 degrees of freedom and widely spread requests the bound exceeds any float: no proof, continue.
    return ratio * math.exp(exponent) if exponent < 700 else math.inf


def _analytic_high(ok: Sequence[RequestRecord], step_s: float, sigma: float, remaining_requests: int,
                   draft_tokens: int, max_new_tokens: int, verify_cost: VerifyCost | None, z: float) -> float | None:
    spec = [r for r in ok if r.spec_verify_ct]
    n_query = draft_tokens + 1
    tokens = sum(r.completion_tokens for r in spec)
    steps = sum(r.spec_verify_ct or 0 for r in spec)
    # Successful requests without spec counters (finished in prefill) could still have accepted everything.
    remaining = (remaining_requests + len(ok) - len(spec)) * max_new_tokens
    if steps + remaining / n_query <= 0:
        return None
    accept_high = min(float(n_query), (tokens + remaining) / (steps + remaining / n_query))
    cost = verify_cost.cost(n_query) if verify_cost else 1.0
    return accept_high / (step_s * cost) * math.exp(z * sigma)


def decode_step_s(records: Sequence[RequestRecord]) -> float | None:
    """Seconds per decoded token of the baseline, for the analytic rule: the lowest per-request
    (e2e - ttft) / (completion tokens - 1) over its successful measured requests. The lowest, not the mean, because
    a smaller step makes the candidate's bound higher (errs towards continuing); per request rather than from the
    ITL gaps because a stream may deliver two tokens in one network read (a gap near 0 would be no step at all).
    None when no request decoded two tokens."""
    steps = [(r.e2e_s - r.ttft_s) / (r.completion_tokens - 1) for r in records
             if r.phase == "measure" and r.ok and r.ttft_s is not None and r.completion_tokens >= 2
             and r.e2e_s > r.ttft_s]
    return min(steps) if steps else None


def baseline_figures(tput_tok_s: float | None, records: Sequence[RequestRecord], sigma: float) -> BaselineFigures | None:
    """The baseline trial's figures from its summary throughput and its measured requests (one run); None when it
    measured no throughput (nothing to compare with: no trial is stopped)."""
    if not tput_tok_s or tput_tok_s <= 0 or not math.isfinite(tput_tok_s):
        return None
    return BaselineFigures(tput_tok_s=tput_tok_s, sigma=sigma, runs=1, step_s=decode_step_s(records))


def rule_off(*, enabled: bool, algorithm: str, concurrency: int) -> str | None:
    """Why the rule does not apply to a trial, or None when it does. Pure.
    The baseline is never stopped (every other trial is judged against it). At concurrency > 1 the statistical
    bound's sum tokens / sum e2e is a per-request rate while the baseline's throughput adds up the requests in
    flight, so the two cannot be compared: the rule is for the search level 1."""
    if not enabled:
        return "early stopping is off (budget.early_stopping: false)"
    if algorithm == "none":
        return "the baseline is never stopped"
    if concurrency != 1:
        return (f"early stopping applies at search concurrency 1 only (this study searches at {concurrency}): the "
                "rule's per-request bounds cannot be compared with a throughput of several requests in flight")
    return None


def t_quantile(p: float, df: int) -> float:
    """Quantile of Student's t with integer `df` >= 1 (exact CDF for integer df, A&S 26.7.3-4, then bisection);
    no SciPy in the core dependencies."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df >= 1, got p={p!r}, df={df!r}")
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    target = 2 * p - 1  # P(|T| < t)
    low, high = 0.0, 1.0
    while _t_abs_cdf(high, df) < target:
        high *= 2
    for _ in range(200):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_abs_cdf(mid, df) < target else (low, mid)
    return (low + high) / 2


def _t_abs_cdf(t: float, df: int) -> float:
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for j in range(1, df // 2):
            term *= c2 * (2 * j - 1) / (2 * j)
            total += term
        return s * total
    term, total = 1.0, 1.0 if df > 1 else 0.0
    for j in range(1, (df - 1) // 2):
        term *= c2 * (2 * j) / (2 * j + 1)
        total += term
    return 2 / math.pi * (theta + s * math.cos(theta) * total)
