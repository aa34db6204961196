"""The baseline and the finalists re-measured at every concurrency level of the study, through the trial's own
measure+check path, gathered into the per-level input of the promotion rule (`pipeline.decide.levels.decide_levels`).

The search measures at the first level only (`StudyConfig.search_concurrency`): a level as a search dimension would
spread a small budget over a product of spaces, and TPE would compare throughputs that differ by level, not by
config. The answer a serving team deploys is per level, so the few finalists pay for the other levels here.

Launches: each run of a config starts one fresh engine (`launch_fresh`), and that engine measures the run at every
level (flush, warm-up, measure, per level: pipeline/trial/launches.py). A config's runs must agree with each other
(`promotion.spread_limit`, fastest over slowest at the first level, pipeline/decide/spread.py): when they do not,
the run farthest from their median is measured again in one more fresh engine and replaced, at most
`promotion.spread_reruns` times; the replaced run is recorded too (`<label>-replaced`, tag `run_replaced` saying
why) and the console says so; the replacement takes the replaced run's slot in the order.

Order: the baseline's and the finalists' fresh engines are interleaved, ABBA-style (`pipeline.decide.spread.run_order`:
B F1 F2 | F2 F1 B | B F1 F2 ...), so whatever moves the machine over the stage's minutes moves both sides alike; each
finalist run is paired with the baseline run of its round, and the speed-up and its spread come from those pairs
(`pipeline.decide.levels`). Every run records its slot (`run_order` tag, 1-based; `run_order_kind`; `engine_sequence`:
the how-manieth engine of the stage it ran in, which differs from the slot for a replacement) and the console names
it as each engine starts. The baseline's first run leads the stage, and each
finalist is judged against the baseline's runs at the SAME level once they are all in, by the study's
equivalence mode: `exact`, each run against the baseline's first successful run at that level; `baseline-noise`, the
sign test over the finalist's runs at that level with the baseline's other runs there as its noise
(`pipeline.decide.noise`); `deterministic`, already checked in the search on deterministic-inference engines (whose
outputs do not depend on the level), so the runs' figures are recorded but do not gate, unless the baseline has no
deterministic pass: then the search compared nothing, and no finalist is equivalent (fail closed: no promotion). The baseline's runs against
each other at each level are the engine's own divergence: logged on the study run (`baseline_self_*_c<level>`
metrics) and as `NOISE_ARTIFACT`, with each finalist's divergence from the baseline beside it.

Under open-loop arrivals (`workload.arrival.mode: poisson`, one level only) every re-run goes through the same path,
so it replays the trials' seeded Poisson schedule: the baseline and each finalist see the same arrival times, and
their runs carry the offered and drawn rates (`offered_rate_per_s`, `arrival_rate_per_s`) beside `req_per_s`.

A resumed study measures its finalist stage again from the start: once the new stage's runs are all logged, the
finalist runs under the study run that another stage logged (tag `finalist_stage`) are deleted, so an interrupted
stage's runs never stand beside the new set.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import TrialConfig
from pipeline.console_log import say
from pipeline.records.console import rerun_name
from pipeline.decide.equivalence import EquivalenceReport, judge
from pipeline.decide.levels import Candidate, LevelInput, RunFigures
from pipeline.decide.noise import SelfDivergence, run_outputs, self_divergence
from pipeline.decide.spread import RunOrder, run_order, suspect_run
from pipeline.measure.summary import RequestRecord, to_table
from pipeline.measure.window import window_record
from pipeline.records.gaps import missing
from pipeline.records.tracking import KIND_TAG, REPLACED_TAG
from pipeline.trial.lifecycle import Checked, measure_and_check
from pipeline.trial.gate import DETERMINISTIC_ARTIFACT, NOT_COMPARED_DETERMINISTIC, baseline_pass, effective_mode
from pipeline.trial.replicas import launch_fresh
from pipeline.trial.context import TrialContext
from pipeline.vocabulary.outcome import Outcome

NOISE_ARTIFACT = "study/baseline_noise.json"  # the baseline's self-divergence and the finalists' divergence, per level
STAGE_TAG = "finalist_stage"  # which finalist stage logged a run (a resumed study's new stage replaces the old's)
ORDER_TAG, ORDER_KIND_TAG, SEQUENCE_TAG = "run_order", "run_order_kind", "engine_sequence"


@dataclass
class Pass:
    """One run of one config at one level."""

    label: str
    level: int
    config: TrialConfig
    checked: Checked
    started_at: float
    replaced: str = ""  # why a fresh run replaced this one (its runs disagreed); "" = it counts
    order: int = 0  # its slot in the stage's measuring order (0-based); a replacement takes the replaced run's
    sequence: int = 0  # the how-manieth fresh engine of the stage it ran in (0-based)
    order_kind: RunOrder = "interleaved"
    stage: str = ""  # the stage that measured it (STAGE_TAG)

    @property
    def tput_tok_s(self) -> float:
        """Its throughput; 0 when it was not measured."""
        summary = self.checked.summary
        return RunFigures.from_metrics(dict(summary.to_metrics())).tput_tok_s if self.measured and summary else 0.0

    @property
    def measured(self) -> bool:
        c = self.checked
        return c.summary is not None and c.measurement.failure is None and c.outcome is not Outcome.INVALID

    @property
    def records(self) -> list[RequestRecord]:
        return self.checked.measurement.records if self.checked.outcome is Outcome.COMPLETE else []


@dataclass
class Remeasured:
    """One config's re-runs at one level: each run's figures (tput 0 = the run failed), whether every run was
    equivalent to the baseline's outputs, and the failures' reasons."""

    runs: list[RunFigures] = field(default_factory=list)
    equivalent: bool = True
    failures: list[str] = field(default_factory=list)


def run_label(name: str, level: int, k: int, several_levels: bool) -> str:
    """A re-run's MLflow run name: `<name>-run<k>`, with `-c<level>` before it when the study has several levels."""
    return f"{name}-c{level}-run{k}" if several_levels else f"{name}-run{k}"


def measure_stage(ctx: TrialContext, entries: Sequence[tuple[str, TrialConfig]], runs: int, levels: Sequence[int],
                  order: RunOrder = "interleaved", stage: str = ""
                  ) -> list[tuple[dict[int, list[Pass]], dict[int, list[Pass]]]]:
    """`runs` fresh engines for each of `entries` (the baseline first), started in `order` (`run_order`), each
    measuring at every level in turn (`measure_and_check` without the search's comparison: lost requests and settings
    the engine rewrote are judged as in a trial); a config's runs that disagree beyond `promotion.spread_limit` at the
    first level are measured again (module docstring). Per entry: (the runs that count, the runs replaced), per level,
    run k of every entry at index k."""
    several = len(levels) > 1
    policy = ctx.study.promotion
    plan = run_order(len(entries), runs, order)
    started = 0

    def one_run(c: int, k: int, slot: int) -> dict[int, Pass]:
        nonlocal started
        name, config = entries[c]
        say(f"  {name} run {k}: slot {slot + 1} of {len(plan)} in the {order} order (fresh engine {started + 1} "
            "of the stage)")
        sequence, started = started, started + 1
        launch_fresh(ctx.study.name)  # a fresh engine per run; the run's other levels share it
        got: dict[int, Pass] = {}
        for level in levels:
            at_level = TrialConfig.model_validate({**config.model_dump(), "concurrency": level})
            label = run_label(name, level, k, several)
            started_at = time.time()
            checked = measure_and_check(ctx, at_level, label, Path(ctx.output_dir) / "finalists" / label)
            got[level] = Pass(label, level, at_level, checked, started_at, order=slot, sequence=sequence,
                              order_kind=order, stage=stage)
        return got

    out: list[dict[int, list[Pass]]] = [{level: [] for level in levels} for _ in entries]
    replaced: list[dict[int, list[Pass]]] = [{level: [] for level in levels} for _ in entries]
    for slot, (c, k) in enumerate(plan):  # run k of each config comes after its run k-1 in either order
        for level, p in one_run(c, k, slot).items():
            out[c][level].append(p)
    first = levels[0]
    for c in range(len(entries)):
        for extra in range(policy.spread_reruns):
            suspect = suspect_run([p.tput_tok_s for p in out[c][first]], policy.spread_limit)
            if suspect is None:
                break
            why = suspect.line(policy.spread_limit)
            say(f"  {rerun_name(out[c][first][suspect.index].label)}: {why}; measured again in a fresh engine "
                f"({extra + 1} of at most {policy.spread_reruns})")
            slot = out[c][first][suspect.index].order
            for level, p in one_run(c, runs + extra, slot).items():
                old = out[c][level][suspect.index]
                replaced[c][level].append(dataclasses.replace(old, label=f"{old.label}-replaced",
                                                              replaced=f"replaced by {p.label}: {why}"))
                out[c][level][suspect.index] = p
    return list(zip(out, replaced))


def _reference(passes: Sequence[Pass]) -> tuple[list[RequestRecord] | None, list[list[RequestRecord]]]:
    """(the baseline's first successful run at a level, its other successful runs)."""
    good = [p.records for p in passes if p.records]
    return (good[0], good[1:]) if good else (None, [])


def judge_level(ctx: TrialContext, config: TrialConfig, passes: Sequence[Pass],
                baseline: Sequence[Pass]) -> list[tuple[bool | None, str, EquivalenceReport | None]]:
    """Each run's (equivalent: None = not compared, reason, report) against the baseline at the same level."""
    study = ctx.study
    if config.spec.algorithm == "none" or study.workload.temperature > 0:
        return [(True, "", None) for _ in passes]
    reference, others = _reference(baseline)
    if reference is None:
        return [(False, "not compared: no baseline run succeeded at this level", None) for _ in passes]
    mode, policy = effective_mode(study), study.promotion
    if mode == "deterministic" and baseline_pass(ctx, DETERMINISTIC_ARTIFACT) is None:
        why = f"not compared: {NOT_COMPARED_DETERMINISTIC}; no promotion without a comparison"
        return [(False, why, None) for _ in passes]
    runs = [p.records for p in passes if p.records]
    if mode == "baseline-noise" and runs:
        pooled = judge("baseline-noise", reference, runs, baseline_others=others, alpha=policy.equivalence_alpha)
        return [(pooled.passed, pooled.reason, pooled) if p.records else (None, "", None) for p in passes]
    out: list[tuple[bool | None, str, EquivalenceReport | None]] = []
    for p in passes:
        if not p.records:
            out.append((None, "", None))
            continue
        report = judge("exact", reference, [p.records], threshold=policy.equivalence_threshold)
        if mode == "deterministic":  # checked in the search, where outputs do not depend on the batch
            report = report.model_copy(update={
                "mode": mode, "passed": True,
                "reason": "checked in the search on deterministic-inference engines; this run against the "
                          f"baseline at its level, for the record: {report.reason}"})
        out.append((report.passed, report.reason, report))
    return out


def _log(ctx: TrialContext, name: str, p: Pass, verdict: tuple[bool | None, str, EquivalenceReport | None],
         compared: bool) -> Remeasured:
    """Record one run in MLflow; its contribution to the level's `Remeasured`."""
    c, m = p.checked, p.checked.measurement
    passed, why, report = verdict
    outcome, reason = c.outcome, c.reason
    out = Remeasured()
    if outcome is Outcome.COMPLETE and compared and passed is False:
        outcome, reason = Outcome.NOT_EQUIVALENT, why
    if outcome is not Outcome.COMPLETE:
        out.equivalent = False
        if outcome is not Outcome.NOT_EQUIVALENT:
            out.failures.append(f"{p.label}: {outcome.value}: {reason[:200]}")
    figures = (RunFigures.from_metrics(dict(c.summary.to_metrics())) if p.measured and c.summary is not None
               else RunFigures(tput_tok_s=0.0))
    texts = {"engine.log": m.engine_log, "timings.json": json.dumps(m.timings, indent=2)}
    # the run's window checks, as a trial's: the promotion rule decides on these figures
    window_metrics, window_tags, window_texts = window_record(m.windows)
    disturbed = window_tags.get("measurement_flag") == "disturbed" if window_tags else None
    out.runs.append(figures.model_copy(update={"order": p.order, "disturbed": disturbed,
                                               "step_ratio": window_metrics.get("window_step_ratio")}))
    texts.update(window_texts)
    metrics = dict(c.summary.to_metrics()) if c.summary else {}
    metrics.update({f"time_{k}": v for k, v in m.timings.items()})
    metrics["engine_launches"] = m.launches
    metrics.update(window_metrics)
    if report is not None:
        texts["equivalence.json"] = report.model_dump_json(indent=2)
        metrics["equiv_identical_share"] = report.identical_share
        if report.noise is not None and report.noise.p_value is not None:
            metrics["equiv_p_value"] = report.noise.p_value
    ctx.tracker.log_trial(
        ctx.parent_run_id, study_name=ctx.study.name, run_name=p.label, kind="finalist",
        config=p.config.model_dump(mode="json"), outcome=outcome, reason=reason, metrics=metrics,
        requests=to_table(m.records) if m.records else None, texts=texts, started_at=p.started_at,
        extra_tags={"finalist": name, "concurrency": str(p.level), "engine_launch": m.launch,
                    "arrival": ctx.study.workload.arrival.describe(p.level), **window_tags,
                    ORDER_TAG: str(p.order + 1), ORDER_KIND_TAG: p.order_kind, SEQUENCE_TAG: str(p.sequence + 1),
                    STAGE_TAG: p.stage, **({REPLACED_TAG: p.replaced[:500]} if p.replaced else {})})
    return out


def _remeasured(ctx: TrialContext, name: str, config: TrialConfig, passes: Sequence[Pass],
                baseline: Sequence[Pass], replaced: Sequence[Pass] = ()) -> tuple[Remeasured, EquivalenceReport | None]:
    compared = config.spec.algorithm != "none" and ctx.study.workload.temperature == 0
    for p in replaced:  # recorded, outside the decision: a fresh run took its place
        _log(ctx, name, p, (None, "", None), compared=False)
    verdicts = judge_level(ctx, config, passes, baseline)
    level = Remeasured()
    for p, verdict in zip(passes, verdicts):
        one = _log(ctx, name, p, verdict, compared)
        level.runs += one.runs
        level.failures += one.failures
        level.equivalent = level.equivalent and one.equivalent
    reports = [v[2] for v in verdicts if v[2] is not None]
    if compared and not reports:  # every run failed, or nothing to compare with
        level.equivalent = False
    return level, (reports[0] if reports else None)


def _divergence_entry(report: EquivalenceReport | None) -> dict[str, Any] | None:
    if report is None:
        return None
    entry: dict[str, Any] = {"passed": report.passed, "identical_share": report.identical_share,
                             "mean_prefix_fraction": report.mean_prefix_fraction, "reason": report.reason}
    if report.noise is not None:
        entry.update(p_value=report.noise.p_value, worse=report.noise.worse, better=report.noise.better,
                     mean_agreement=report.noise.candidate_mean_agreement,
                     baseline_mean_agreement=report.noise.baseline_mean_agreement)
    return entry


def log_noise(ctx: TrialContext, selves: Sequence[SelfDivergence],
              candidates: dict[str, dict[int, dict[str, Any] | None]]) -> dict[str, Any]:
    """The baseline's self-divergence per level (metrics `baseline_self_*_c<level>` on the study run) and the
    finalists' divergence from it (`NOISE_ARTIFACT`); returns the artifact's content. Never fails the study."""
    study = ctx.study
    body = {"mode": study.promotion.equivalence, "effective_mode": effective_mode(study),
            "alpha": study.promotion.equivalence_alpha if effective_mode(study) == "baseline-noise" else None,
            "baseline": [s.model_dump() for s in selves],
            "finalists": {name: {str(level): entry for level, entry in levels.items()}
                          for name, levels in candidates.items()}}
    metrics = {f"baseline_self_{key}_c{s.level}": float(value) for s in selves
               for key, value in (("identical_share", s.identical_share), ("token_agreement", s.token_agreement),
                                  ("first_div_p50", s.first_divergence_p50)) if value is not None}
    try:
        ctx.tracker.log_figures(ctx.parent_run_id, metrics, texts={NOISE_ARTIFACT: json.dumps(body, indent=2)})
    except Exception as exc:  # noqa: BLE001 - a record of the noise must not lose the study's result
        missing(f"the baseline's self-divergence (the study run's baseline_self_* metrics and {NOISE_ARTIFACT})", exc)
    return body


def measure_levels(ctx: TrialContext, baseline: TrialConfig, finalists: Sequence[tuple[str, TrialConfig]],
                   levels: Sequence[int], runs: int, order: RunOrder = "interleaved") -> list[LevelInput]:
    """Per level (in the study's order: the search level first), the baseline's and each finalist's re-runs, their
    engines started in `order` (module docstring; "sequential" measures every baseline run first, then each
    finalist's, for comparing the two orders). Once they are logged, the runs of an interrupted stage go."""
    if len(levels) > 1 or ctx.study.workload.arrival.open_loop:
        where = (f"concurrency {list(levels)}" if len(levels) > 1
                 else ctx.study.workload.arrival.describe(levels[0]))
        say(f"  {where}: baseline and {len(finalists)} finalist(s), {runs} runs each, one engine per run "
            "measuring every level")
    stage = uuid.uuid4().hex[:12]
    measured = measure_stage(ctx, [("final-baseline", baseline), *finalists], runs, levels, order, stage)
    base_passes, base_replaced = measured[0]
    base: dict[int, Remeasured] = {}
    for level in levels:
        base[level], _ = _remeasured(ctx, "final-baseline", baseline, base_passes[level], base_passes[level],
                                     base_replaced[level])
    selves = [self_divergence(level, [run_outputs(p.records) for p in base_passes[level] if p.records])
              for level in levels]
    candidates: dict[int, list[Candidate]] = {level: [] for level in levels}
    divergence: dict[str, dict[int, dict[str, Any] | None]] = {}
    for (name, config), (passes, replaced) in zip(finalists, measured[1:]):
        divergence[name] = {}
        for level in levels:
            got, report = _remeasured(ctx, name, config, passes[level], base_passes[level], replaced[level])
            divergence[name][level] = _divergence_entry(report)
            candidates[level].append(Candidate(id=name, runs=tuple(got.runs), equivalent=got.equivalent,
                                               spec=config.spec, failures=tuple(got.failures)))
    log_noise(ctx, selves, divergence)
    drop_stale_runs(ctx, stage)
    return [LevelInput(level=level, baseline=tuple(base[level].runs), baseline_failures=tuple(base[level].failures),
                       candidates=tuple(candidates[level])) for level in levels]


def drop_stale_runs(ctx: TrialContext, stage: str) -> list[str]:
    """Delete the finalist runs under the study run that `stage` did not log (an interrupted stage's, which a resumed
    study measured again); returns their names. Called once `stage`'s runs are all logged, so an interruption leaves
    two sets on record, never none. Never fails the study."""
    try:
        client = ctx.tracker.client()
        runs = client.search_runs([ctx.tracker.experiment_id()], max_results=5000,
                                  filter_string=f"tags.mlflow.parentRunId = '{ctx.parent_run_id}' and "
                                                f"tags.`{KIND_TAG}` = 'finalist'")
        stale = [r for r in runs if r.data.tags.get(STAGE_TAG) != stage]
        for run in stale:
            client.delete_run(run.info.run_id)
    except Exception as exc:  # noqa: BLE001 - a stale record must not lose the study's result
        missing("the deleted state of an interrupted stage's finalist runs (they stay beside the new ones)", exc)
        return []
    names = sorted(r.info.run_name for r in stale)
    if names:
        say(f"  deleted {len(names)} finalist run(s) an interrupted stage logged (measured again): "
            f"{', '.join(names)}")
    return names
