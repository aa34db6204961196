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

A split (`up_to` set) runs two engines at once, each as many GPUs as the replica holds (`ServingRoom`). Where the
serving side cannot hold both, the split is not chosen: one config is served at every level, the one of the split's
two (`config`, and `above` or the baseline) whose worst speed-up over the levels is highest, the lower level's
winner kept where it is within the promotion margin of that; `ServingPolicy.unsplit` says why.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pipeline.config import SLA_METRICS, PromotionPolicy, SlaConstraint
from pipeline.decide.decision import Decision, Finalist, decide, run_stats
from pipeline.decide.sla import Verdict, broken, check, median_figure
from pipeline.decide.spread import paired_ratios
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
    # the run's slot in its stage's measuring order (pipeline/decide/spread.py); when the baseline's and a
    # finalist's runs all carry one, the finalist's speed-up comes from run-by-run pairs; None = not recorded
    order: int | None = Field(None, ge=0)
    # whether other work disturbed the run's recorded window (its `measurement_flag` was "disturbed"); None = not
    # recorded. The decision's caveat counts these (pipeline.decide.headline.disturbance)
    disturbed: bool | None = None
    # the recorded window's plain steps over the engine's calibrated step (`window_step_ratio`); None where the engine
    # timed none (a speculative run, an engine without a round table): what the search's baseline gap is read against
    step_ratio: float | None = Field(None, gt=0)

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
    """One config at one level, as the level table shows it. `speedup` = the median of its runs' paired ratios
    (`run_ratios`) when its runs were paired with the baseline's, else its median / the baseline's median."""

    id: str
    median_tok_s: float
    score: float
    speedup: float | None
    latencies_ms: dict[str, float | None]
    verdicts: tuple[Verdict, ...]
    refused: str | None = None
    winner: bool = False
    runs_tok_s: tuple[float, ...] = ()  # each re-run's throughput (the speed-up's spread); empty in older records
    run_ratios: tuple[float, ...] = ()  # each re-run over its paired baseline run; empty when the runs were not paired
    disturbed_runs: int = Field(0, ge=0)  # of its runs, those measured in a disturbed window (RunFigures.disturbed)


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
    unsplit: str | None = Field(None, description="why the levels' split into two engines is not served (they do not "
                                "fit the serving side), so one config serves every level; None = not refused")


class ServingRoom(_Frozen):
    """What the serving side can hold: the GPUs one engine takes (`engine_gpus`, 0 for an engine without GPUs), the
    GPUs the serving side has (`gpus`), and where that count comes from (`source`, in words for the headline)."""

    engine_gpus: float = Field(ge=0)
    gpus: int = Field(ge=0)
    source: str = ""

    def split_problem(self) -> str | None:
        """Why two engines at once do not fit (None: they do). Pure."""
        need = 2 * self.engine_gpus
        if need <= self.gpus:
            return None
        return (f"two engines (one per concurrency range) of {self.engine_gpus:g} GPUs each need {need:g} GPUs and "
                f"the serving side has {self.gpus}" + (f" ({self.source})" if self.source else ""))


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
                  labels: Mapping[str, str] | None = None, room: ServingRoom | None = None) -> LevelsDecision:
    """Apply the per-level rule and derive the serving policy (module docstring). `finalists`: how the finalists were
    chosen (carried into the reason); `labels`: each config id's readable label, kept for the views
    (`pipeline.decide.headline`); `room`: what the serving side can hold (None: a split always fits). Raises
    ValueError on no levels, a repeated level, or what `decide` refuses (too few runs, duplicate ids)."""
    policy = policy or PromotionPolicy()
    if not levels:
        raise ValueError("no concurrency levels given; give at least one level's re-measured runs")
    seen = [entry.level for entry in levels]
    if len(set(seen)) != len(seen):
        raise ValueError(f"concurrency levels must be distinct, got {seen}")
    results = tuple(_decide_level(entry, policy, constraints) for entry in sorted(levels, key=lambda e: e.level))
    serving = serving_policy(results, room, policy.margin)
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
                     runs_tok_s=base.runs, disturbed_runs=sum(bool(r.disturbed) for r in entry.baseline))]
    for cand in entry.candidates:
        stats = scores[cand.id] if cand.id in scores else run_stats([r.tput_tok_s for r in cand.runs])
        paired = _paired(entry.baseline, cand.runs)
        rows.append(LevelRow(id=cand.id, median_tok_s=stats.median, score=stats.score,
                             speedup=statistics.median(paired) if paired else speedup(stats.median),
                             run_ratios=tuple(paired),
                             latencies_ms=_latencies(cand.runs), verdicts=tuple(verdicts[cand.id]),
                             refused=refused.get(cand.id),
                             winner=decision.winner == cand.id, runs_tok_s=stats.runs,
                             disturbed_runs=sum(bool(r.disturbed) for r in cand.runs)))
    reason = decision.reason
    if refused and not allowed:
        reason = "keep baseline: every finalist breaks an SLA limit at this level"
    if refused:
        reason += "; refused: " + "; ".join(f"{cid!r} {why}" for cid, why in refused.items())
    if broken(base_verdicts):
        reason += f"; note: the baseline itself {broken(base_verdicts)}"
    return LevelResult(level=entry.level, winner=decision.winner, decision=decision, rows=tuple(rows), reason=reason)


def _paired(baseline: Sequence[RunFigures], runs: Sequence[RunFigures]) -> list[float]:
    """Run k over baseline run k when every run carries its slot in the measuring order, else none."""
    if any(r.order is None for r in (*baseline, *runs)):
        return []
    return paired_ratios([r.tput_tok_s for r in baseline], [r.tput_tok_s for r in runs])


def _beats(result: LevelResult, config: str) -> bool:
    return any(c.id == config and c.beats_baseline for c in result.decision.candidates)


def serving_policy(results: Sequence[LevelResult], room: ServingRoom | None = None,
                   margin: float = 0.0) -> ServingPolicy:
    """The policy (module docstring) from per-level results sorted by level; a split that does not fit `room` is
    replaced by one config at every level (`one_config`). Pure."""
    split = split_policy(results)
    problem = room.split_problem() if room is not None and split.up_to is not None else None
    return one_config(results, split, problem, margin) if problem else split


def worst_speedup(results: Sequence[LevelResult], config: str) -> float:
    """`config`'s lowest speed-up over the levels (the baseline's is 1; a level without a figure, or where an SLA
    limit refuses it, counts as 0)."""
    if config == BASELINE:
        return 1.0
    return min(next(((r.speedup or 0.0) if r.refused is None else 0.0 for r in result.rows if r.id == config), 0.0)
               for result in results)


def one_config(results: Sequence[LevelResult], split: ServingPolicy, problem: str, margin: float) -> ServingPolicy:
    """The split's replacement when its two engines do not fit: of its two configs, the one whose worst speed-up
    over the levels is highest, the lower level's winner kept within `margin` of that (module docstring). Pure."""
    low, high = split.config or BASELINE, split.above or BASELINE
    levels = [r.level for r in sorted(results, key=lambda r: r.level)]
    worst = {c: worst_speedup(results, c) for c in (low, high)}
    chosen = low if worst[low] >= max(worst.values()) - margin else high
    text = (f"serve {chosen!r} at every measured level {levels}" if chosen != BASELINE
            else f"serve the baseline at every level {levels}")
    text += (f" (worst speed-up {worst[chosen]:.2f}x): the levels call for {split.text[len('serve '):]}, but "
             f"{problem}")
    return ServingPolicy(config=None if chosen == BASELINE else chosen, up_to=None, text=text, unsplit=problem)


def split_policy(results: Sequence[LevelResult]) -> ServingPolicy:
    """The policy the levels call for, two engines where they say so (module docstring). Pure."""
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
