"""Per-concurrency promotion: the single-level rule (`pipeline.decide.decision.decide`) at every level, SLA limits, and the
serving policy that follows. Pure and unit-tested.

Speculation pays when the accelerator idles between decode steps (low concurrency) and costs when the batch keeps it
busy, so one config is rarely the answer at every level. Input: per level, the baseline's and each finalist's
re-measured runs (throughput and latency percentiles). Per level:
- each run's latency percentile is reduced to the median over runs (`pipeline.decide.sla.median_figure`);
- a finalist that breaks an SLA limit holding at that level is refused there (reason with figure and limit) and the
  single-level rule runs over the others; the baseline is the fallback and is never refused, but its verdicts are
  shown;
- the level's winner is `decide`'s winner (None = the baseline).

The serving policy: `config` = the winner at the lowest level (None = keep the baseline everywhere). `up_to` = the
highest level such that `config` beats the baseline's bar at it and at every level below; above it, `above` = a
finalist that wins at every higher level (a second config, e.g. behind SGLang's `--max-running-requests`), else
None: speculation off above `up_to`. `up_to` is None when `config` holds at every measured level. The switch is
only known to lie between `up_to` and the next measured level.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.config import SLA_METRICS, PromotionPolicy, SlaConstraint
from pipeline.decide.decision import Decision, Finalist, decide, run_stats
from pipeline.decide.sla import Verdict, broken, check, median_figure
from serve.engines.base import ReplicaConfig
from serve.serving import RoutingPolicy
from serve.spec import SpecConfig

BASELINE = "baseline"
# Where the study's parent run holds the per-level decision (`LevelsDecision.model_dump_json()`), read by
# `python -m pipeline.compare` and the report.
LEVELS_ARTIFACT = "study/levels.json"


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class RunFigures(_Frozen):
    """One re-measured run: throughput (0 = the run failed) and its latency percentiles in ms (None = none)."""

    tput_tok_s: float = Field(ge=0)
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p90_ms: float | None = None
    itl_p99_ms: float | None = None
    e2e_p50_ms: float | None = None
    e2e_p90_ms: float | None = None
    e2e_p99_ms: float | None = None

    @classmethod
    def from_metrics(cls, metrics: dict[str, float | None]) -> RunFigures:
        """From `Summary.to_metrics()` or `Summary.model_dump()` (other keys are ignored)."""
        return cls(tput_tok_s=metrics.get("tput_tok_s") or 0.0, **{m: metrics.get(m) for m in SLA_METRICS})


class Candidate(_Frozen):
    """A finalist's re-measured runs at one level, plus what the tie rule and the equivalence rule need."""

    id: str = Field(min_length=1)
    runs: tuple[RunFigures, ...] = Field(min_length=1)
    equivalent: bool
    spec: SpecConfig | None = None
    draft_tokens: int | None = Field(None, ge=0)
    failures: tuple[str, ...] = ()

    def finalist(self) -> Finalist:
        return Finalist(id=self.id, throughputs=tuple(r.tput_tok_s for r in self.runs), equivalent=self.equivalent,
                        spec=self.spec, draft_tokens=self.draft_tokens, failures=self.failures)


class LevelInput(_Frozen):
    level: int = Field(ge=1)
    baseline: tuple[RunFigures, ...] = Field(min_length=1)
    baseline_failures: tuple[str, ...] = ()
    candidates: tuple[Candidate, ...]

    @model_validator(mode="after")
    def _not_baseline(self) -> LevelInput:
        if any(c.id == BASELINE for c in self.candidates):
            raise ValueError(f"level {self.level}: a finalist may not be named {BASELINE!r} (reserved for the "
                             "baseline row); rename it")
        return self


class LevelRow(_Frozen):
    """One config at one level, as the level table shows it. `speedup` = its median / the baseline's median."""

    id: str
    median_tok_s: float
    score: float
    speedup: float | None
    latencies_ms: dict[str, float | None]
    verdicts: tuple[Verdict, ...]
    refused: str | None = None
    winner: bool = False
    runs_tok_s: tuple[float, ...] = ()  # each re-run's throughput (the speed-up's spread); empty in older records


class LevelResult(_Frozen):
    level: int
    winner: str | None
    decision: Decision
    rows: tuple[LevelRow, ...]
    reason: str


class ServingPolicy(_Frozen):
    config: str | None = Field(description="finalist id served at low concurrency; None = the baseline everywhere")
    up_to: int | None = Field(description="highest measured level `config` still wins at; None = every level")
    above: str | None = Field(None, description="finalist id above `up_to`; None = speculation off (the baseline)")
    text: str


class LevelsDecision(_Frozen):
    """Per level, the table and the single-level decision; the serving policy; `finalists` says how the finalists
    were chosen and which objective made the final pick (`pipeline.decide.pareto.FinalistChoice.explanation`)."""

    levels: tuple[LevelResult, ...]
    policy: ServingPolicy
    finalists: str = ""
    reason: str
    labels: dict[str, str] = Field(default_factory=dict, description="config id -> its readable label (display)")


def decide_levels(levels: Sequence[LevelInput], policy: PromotionPolicy | None = None,
                  constraints: Sequence[SlaConstraint] = (), finalists: str = "",
                  labels: Mapping[str, str] | None = None) -> LevelsDecision:
    """Apply the per-level rule and derive the serving policy (module docstring). `finalists`: how the finalists were
    chosen (carried into the reason); `labels`: each config id's readable label, kept for the views
    (`pipeline.decide.headline`). Raises ValueError on no levels, a repeated level, or what `decide` refuses
    (too few runs, duplicate ids)."""
    policy = policy or PromotionPolicy()
    if not levels:
        raise ValueError("no concurrency levels given; give at least one level's re-measured runs")
    seen = [entry.level for entry in levels]
    if len(set(seen)) != len(seen):
        raise ValueError(f"concurrency levels must be distinct, got {seen}")
    results = tuple(_decide_level(entry, policy, constraints) for entry in sorted(levels, key=lambda e: e.level))
    serving = serving_policy(results)
    lines = [f"concurrency {r.level}: {r.reason}" for r in results]
    reason = f"{serving.text}. " + (f"{finalists}. " if finalists else "") + " | ".join(lines)
    return LevelsDecision(levels=results, policy=serving, finalists=finalists, reason=reason,
                          labels=dict(labels or {}))


def _latencies(runs: Sequence[RunFigures]) -> dict[str, float | None]:
    return {m: median_figure([getattr(r, m) for r in runs]) for m in SLA_METRICS}


def _decide_level(entry: LevelInput, policy: PromotionPolicy, constraints: Sequence[SlaConstraint]) -> LevelResult:
    base_lat = _latencies(entry.baseline)
    base_verdicts = check(constraints, entry.level, base_lat)
    refused: dict[str, str] = {}
    verdicts: dict[str, list[Verdict]] = {}
    for cand in entry.candidates:
        verdicts[cand.id] = check(constraints, entry.level, _latencies(cand.runs))
        why = broken(verdicts[cand.id])
        if why:
            refused[cand.id] = why
    allowed = [c.finalist() for c in entry.candidates if c.id not in refused]
    decision = decide([r.tput_tok_s for r in entry.baseline], allowed, policy,
                      baseline_failures=entry.baseline_failures)
    base = decision.baseline
    scores = {c.id: c for c in decision.candidates}

    def speedup(median: float) -> float | None:
        return median / base.median if base.median > 0 else None

    rows = [LevelRow(id=BASELINE, median_tok_s=base.median, score=base.score, speedup=1.0 if base.median else None,
                     latencies_ms=base_lat, verdicts=tuple(base_verdicts), winner=decision.winner is None,
                     runs_tok_s=base.runs)]
    for cand in entry.candidates:
        stats = scores[cand.id] if cand.id in scores else run_stats([r.tput_tok_s for r in cand.runs])
        rows.append(LevelRow(id=cand.id, median_tok_s=stats.median, score=stats.score, speedup=speedup(stats.median),
                             latencies_ms=_latencies(cand.runs), verdicts=tuple(verdicts[cand.id]),
                             refused=refused.get(cand.id),
                             winner=decision.winner == cand.id, runs_tok_s=stats.runs))
    reason = decision.reason
    if refused and not allowed:
        reason = "keep baseline: every finalist breaks an SLA limit at this level"
    if refused:
        reason += "; refused: " + "; ".join(f"{cid!r} {why}" for cid, why in refused.items())
    if broken(base_verdicts):
        reason += f"; note: the baseline itself {broken(base_verdicts)}"
    return LevelResult(level=entry.level, winner=decision.winner, decision=decision, rows=tuple(rows), reason=reason)


def _beats(result: LevelResult, config: str) -> bool:
    return any(c.id == config and c.beats_baseline for c in result.decision.candidates)


def serving_policy(results: Sequence[LevelResult]) -> ServingPolicy:
    """The policy (module docstring) from per-level results sorted by level. Pure."""
    ordered = sorted(results, key=lambda r: r.level)
    config = ordered[0].winner
    if config is None:
        wins = [f"{r.winner!r} at {r.level}" for r in ordered if r.winner]
        text = f"serve the baseline at every level (no finalist wins at concurrency {ordered[0].level})"
        if wins:
            text += f"; finalists won only at higher levels ({', '.join(wins)}), which this policy form cannot use"
        return ServingPolicy(config=None, up_to=None, text=text)
    held = 0
    while held < len(ordered) and _beats(ordered[held], config):
        held += 1
    if held == len(ordered):
        return ServingPolicy(config=config, up_to=None,
                             text=f"serve {config!r} at every measured level {[r.level for r in ordered]}")
    up_to, rest = ordered[held - 1].level, ordered[held:]
    second = rest[0].winner
    if second is not None and all(r.winner == second for r in rest):
        return ServingPolicy(config=config, up_to=up_to, above=second,
                             text=f"serve {config!r} up to concurrency {up_to}, {second!r} above {up_to} "
                                  f"(it wins at {[r.level for r in rest]})")
    lost = [r.level for r in rest if not _beats(r, config)]
    return ServingPolicy(config=config, up_to=up_to,
                         text=f"serve {config!r} up to concurrency {up_to}; speculation off above {up_to} "
                              f"({config!r} does not beat the baseline at concurrency {lost})")


def routing_policy(decision: LevelsDecision, replicas: Mapping[str, ReplicaConfig]) -> RoutingPolicy:
    """The serving policy in the form production serves (`serve.serving.RoutingPolicy`): one engine, or two with
    the switch at `up_to` requests in flight; the second engine is the finalist the policy names above `up_to`, else
    the baseline ("speculation off above N"). `replicas`: each config id's replica (BASELINE included). Pure."""
    served = decision.policy
    levels = [r.level for r in decision.levels]
    winners = {str(r.level): r.winner or BASELINE for r in decision.levels}
    source = served.config or BASELINE
    if served.config is None or served.up_to is None:
        return RoutingPolicy(text=served.text, levels=levels, winners=winners, source=source)
    high = served.above or BASELINE
    if high not in replicas:
        raise ValueError(f"the policy serves {high!r} above concurrency {served.up_to} but no replica of it was "
                         f"given (have {sorted(replicas)})")
    return RoutingPolicy(text=served.text, levels=levels, winners=winners, source=source,
                         switch_above=served.up_to, high=replicas[high], high_source=high)
