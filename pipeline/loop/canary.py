"""The canary decision: the candidate beside production on the same live traffic -> promote, roll back, or go on.
Pure; the loop (`pipeline.loop.cycle`) gathers the records and carries the action out.

The endpoint sends each generation request to the candidate with probability `share` (`serve.closed_loop.control`), so
both arms draw from the same traffic. Shares step up from `start_share` through `steps`; a step decides once the
candidate has answered `min_requests_per_step` requests in it (a step that cannot get them within `max_step_s` ends
the canary: rollback, "not enough traffic to decide").

At each decision, in this order:
1. errors: the candidate's error rate above production's by more than `max_error_increase` -> rollback;
2. SLA limits (`objective.constraints` of the study, `pipeline.decide.sla`): each limit's percentile over the arm's
   requests in the bucket of its level (every request for a limit without a level), checked where the candidate
   has `min_sla_requests` there. A limit the candidate breaks -> rollback, unless production breaks it too and the
   candidate is no worse there (the traffic, not the config, is then at fault; the verdict is reported);
3. throughput, with the promotion rule (`pipeline.decide.decision.decide`): the step's time is cut into `blocks`
   intervals holding equal numbers of candidate requests; in each, each arm's per-request throughput (sum of output
   tokens / sum of e2e seconds) is taken per concurrency bucket and averaged with the step's bucket mix as weights
   (buckets both arms have in that interval), because an arm's engine at a lower share runs smaller batches and
   would look faster for that alone. The blocks are the rule's runs: production is the baseline, the candidate the
   one finalist (its equivalence was gated by the re-tune study). At the last step a `promote` decision promotes;
   anything else rolls back (production stays: "keep baseline"). At an earlier step the candidate rolls back only
   when clearly slower (its median plus its noise below production's median minus the bar's raise); otherwise
   the share steps up. Promotion waits for the last step, where both arms carry equal load by default (0.5).
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from pipeline.config import PromotionPolicy, SlaConstraint
from pipeline.decide.decision import MAD_TO_SIGMA, Decision, Finalist, decide, promotion_bar, run_stats
from pipeline.decide.sla import Verdict
from serve.closed_loop.control import MAX_LEASE_S
from serve.closed_loop.live import LiveRecord, bucket_of
from serve.latency import percentile_ms
from serve.spec import FrozenModel, SpecConfig

__all__ = ["CanarySettings", "ArmFigures", "CanaryDecision", "canary_decision", "block_throughputs", "sla_figure"]

Action = Literal["promote", "rollback", "continue"]


class _Model(FrozenModel):
    model_config = ConfigDict(**FrozenModel.model_config, allow_inf_nan=False)


class CanarySettings(_Model):
    """How a candidate is rolled out on live traffic (module docstring)."""

    start_share: float = Field(0.1, gt=0, le=1, description="share of generation requests the candidate gets first")
    steps: tuple[float, ...] = Field((0.25, 0.5), description="the later shares, increasing; the last one decides "
                                                              "promotion")
    min_requests_per_step: int = Field(100, ge=10, description="candidate requests a step needs before it decides")
    blocks: int = Field(5, ge=3, description="time blocks per step compared by the promotion rule (its runs; at "
                                             "least promotion.runs)")
    max_step_s: float = Field(3600.0, gt=0, description="a step that gets too few requests in this long rolls back")
    max_error_increase: float = Field(0.01, ge=0, le=1, description="candidate error rate above production's by "
                                                                   "more than this rolls back")
    min_sla_requests: int = Field(20, ge=1, description="candidate requests in a limit's bucket before it is checked")
    lease_s: float = Field(900.0, ge=10, le=MAX_LEASE_S, description="the endpoint stops a canary nobody polled for "
                                                                     "this long (at most a day)")

    @model_validator(mode="after")
    def _increasing(self) -> CanarySettings:
        shares = self.shares
        if any(b <= a for a, b in zip(shares, shares[1:])) or any(not 0 < s <= 1 for s in shares):
            raise ValueError(f"canary shares must increase within (0, 1], got start_share={self.start_share}, "
                             f"steps={list(self.steps)}. Fix: e.g. start_share: 0.1, steps: [0.25, 0.5]")
        if self.min_requests_per_step < self.blocks:
            raise ValueError(f"min_requests_per_step={self.min_requests_per_step} is below blocks={self.blocks}: "
                             "each block needs candidate requests. Fix: raise min_requests_per_step")
        return self

    @property
    def shares(self) -> tuple[float, ...]:
        return (self.start_share, *self.steps)


class ArmFigures(_Model):
    requests: int
    errors: int
    error_rate: float
    blocks: tuple[float, ...] = Field(description="per-request throughput per time block (tok/s)")
    median: float | None = None


class CanaryDecision(_Model):
    action: Action
    step: int
    share: float
    next_share: float | None = Field(description="the share to go on with (continue), else None")
    reason: str
    production: ArmFigures
    candidate: ArmFigures
    verdicts: tuple[Verdict, ...] = ()
    decision: Decision | None = None


def sla_figure(metric: str, records: Sequence[LiveRecord]) -> float | None:
    """A `pipeline.measure.summary.Summary` latency percentile (e.g. ttft_p90_ms) over live records, in ms."""
    kind, q = metric.split("_")[0], float(metric.split("_")[1][1:])
    ok = [r for r in records if r.ok]
    if kind == "ttft":
        values = [r.ttft_s for r in ok if r.ttft_s is not None]
    elif kind == "itl":
        values = [gap for r in ok for gap in r.itl_s]
    else:
        values = [r.e2e_s for r in ok]
    return percentile_ms(values, q)


def _ratio(records: Sequence[LiveRecord]) -> float | None:
    tokens = sum(r.completion_tokens for r in records)
    seconds = sum(r.e2e_s for r in records)
    return tokens / seconds if seconds > 0 and tokens > 0 else None


def block_throughputs(production: Sequence[LiveRecord], candidate: Sequence[LiveRecord],
                      blocks: int) -> tuple[list[float], list[float]]:
    """Per time block, each arm's bucket-standardised per-request throughput (module docstring, 3). Blocks where
    the arms share no bucket are left out of both lists."""
    prod = sorted((r for r in production if r.tput_tok_s is not None), key=lambda r: r.t_ms)
    cand = sorted((r for r in candidate if r.tput_tok_s is not None), key=lambda r: r.t_ms)
    if len(cand) < blocks:
        return [], []
    size = len(cand) / blocks
    cuts = [cand[int(round(i * size)) - 1].t_ms for i in range(1, blocks)]  # last candidate time of blocks 1..n-1
    weight = Counter(bucket_of(r.concurrency) for r in (*prod, *cand))

    def block_of(t_ms: int) -> int:
        return sum(1 for cut in cuts if t_ms > cut)

    per: dict[tuple[str, int, int], list[LiveRecord]] = defaultdict(list)
    for arm, rows in (("p", prod), ("c", cand)):
        for r in rows:
            per[(arm, block_of(r.t_ms), bucket_of(r.concurrency))].append(r)
    out_p, out_c = [], []
    for b in range(blocks):
        common = [k for k in weight if per.get(("p", b, k)) and per.get(("c", b, k))]
        if not common:
            continue
        total = sum(weight[k] for k in common)
        values = []
        for arm in ("p", "c"):
            ratios = [_ratio(per[(arm, b, k)]) for k in common]
            values.append(sum(weight[k] * (x or 0.0) for k, x in zip(common, ratios)) / total)
        out_p.append(values[0])
        out_c.append(values[1])
    return out_p, out_c


def _arm(records: Sequence[LiveRecord], blocks: Sequence[float]) -> ArmFigures:
    errors = sum(1 for r in records if not r.ok)
    return ArmFigures(requests=len(records), errors=errors, error_rate=errors / len(records) if records else 0.0,
                      blocks=tuple(blocks), median=statistics.median(blocks) if blocks else None)


def _sla(constraints: Sequence[SlaConstraint], production: Sequence[LiveRecord], candidate: Sequence[LiveRecord],
         min_requests: int) -> tuple[list[Verdict], list[str]]:
    verdicts, breaches = [], []
    for limit in constraints:
        bucket = bucket_of(limit.concurrency) if limit.concurrency is not None else None
        cand = [r for r in candidate if bucket is None or bucket_of(r.concurrency) == bucket]
        prod = [r for r in production if bucket is None or bucket_of(r.concurrency) == bucket]
        if sum(1 for r in cand if r.ok) < min_requests:
            continue
        level = limit.concurrency or 0
        figure, base = sla_figure(limit.metric, cand), sla_figure(limit.metric, prod)
        if figure is None:  # e.g. a TTFT limit when no answer was streamed: nothing live to check it on
            continue
        verdict = Verdict(metric=limit.metric, concurrency=level, figure_ms=figure, max_ms=limit.max_ms,
                          ok=figure is not None and figure <= limit.max_ms)
        verdicts.append(verdict)
        production_breaks_too = base is not None and base > limit.max_ms
        if not verdict.ok and not (production_breaks_too and base is not None and figure <= base):
            where = "every level" if limit.concurrency is None else f"concurrency {bucket}"
            breaches.append(f"candidate {limit.metric} {figure:.1f} ms > limit {limit.max_ms:g} ms at {where}"
                            + (f" (production {base:.1f} ms)" if base is not None else ""))
    return verdicts, breaches


def canary_decision(settings: CanarySettings, policy: PromotionPolicy, constraints: Sequence[SlaConstraint],
                    step: int, production: Sequence[LiveRecord], candidate: Sequence[LiveRecord],
                    candidate_spec: SpecConfig, elapsed_s: float) -> CanaryDecision:
    """Decide one canary step from the records each arm answered during it (module docstring). Pure."""
    shares = settings.shares
    if not 0 <= step < len(shares):
        raise ValueError(f"canary step {step} does not exist: the settings have {len(shares)} steps {list(shares)}")
    if settings.blocks < policy.runs:
        raise ValueError(f"canary blocks={settings.blocks} is below promotion.runs={policy.runs}: the promotion rule "
                         "needs that many runs. Fix: raise canary blocks or lower promotion.runs")
    share, last = shares[step], step == len(shares) - 1
    head = f"canary step {step + 1}/{len(shares)} (share {share:g})"
    p_blocks, c_blocks = block_throughputs(production, candidate, settings.blocks)
    prod, cand = _arm(production, p_blocks), _arm(candidate, c_blocks)

    def out(action: Action, reason: str, next_share: float | None = None, verdicts: Sequence[Verdict] = (),
            decision: Decision | None = None) -> CanaryDecision:
        return CanaryDecision(action=action, step=step, share=share, next_share=next_share, reason=f"{head}: {reason}",
                              production=prod, candidate=cand, verdicts=tuple(verdicts), decision=decision)

    if len(candidate) < settings.min_requests_per_step:
        if elapsed_s > settings.max_step_s:
            return out("rollback", f"not enough traffic to decide: {len(candidate)} candidate requests in "
                                   f"{elapsed_s:.0f} s, {settings.min_requests_per_step} needed within "
                                   f"max_step_s={settings.max_step_s:g}")
        return out("continue", f"{len(candidate)} of {settings.min_requests_per_step} candidate requests", share)
    if cand.error_rate - prod.error_rate > settings.max_error_increase:
        return out("rollback", f"candidate error rate {cand.error_rate:.1%} ({cand.errors}/{cand.requests}) vs "
                               f"production {prod.error_rate:.1%} ({prod.errors}/{prod.requests}), more than "
                               f"{settings.max_error_increase:.1%} above")
    verdicts, breaches = _sla(constraints, production, candidate, settings.min_sla_requests)
    if breaches:
        return out("rollback", "breaks SLA limit(s): " + "; ".join(breaches), verdicts=verdicts)
    if len(c_blocks) < policy.runs:
        if elapsed_s > settings.max_step_s:
            return out("rollback", f"only {len(c_blocks)} time blocks where both arms answered at one concurrency; "
                                   f"the promotion rule needs {policy.runs}", verdicts=verdicts)
        return out("continue", f"{len(c_blocks)} comparable time blocks of {policy.runs}", share, verdicts)
    decision = decide(p_blocks, [Finalist(id="candidate", throughputs=tuple(c_blocks), equivalent=True,
                                          spec=candidate_spec)], policy)
    base, score = decision.baseline, decision.candidates[0]
    figures = (f"candidate score {score.score:.2f} tok/s per request (median {score.median:.2f}, MAD {score.mad:.2f}) "
               f"vs production median {base.median:.2f} (bar {decision.bar:.2f}), {len(c_blocks)} blocks")
    if last:
        if decision.kind == "promote":
            return out("promote", f"{figures}: beats the bar", verdicts=verdicts, decision=decision)
        return out("rollback", f"{figures}: does not beat the bar, production stays", verdicts=verdicts,
                   decision=decision)
    raise_by = promotion_bar(base, policy) - base.median
    optimistic = run_stats(c_blocks)
    if optimistic.median + MAD_TO_SIGMA * optimistic.mad < base.median - raise_by:
        return out("rollback", f"{figures}: clearly slower (median + noise "
                               f"{optimistic.median + MAD_TO_SIGMA * optimistic.mad:.2f} < production median - "
                               f"{raise_by:.2f})", verdicts=verdicts, decision=decision)
    return out("continue", f"{figures}: not worse, stepping up", shares[step + 1], verdicts, decision)
