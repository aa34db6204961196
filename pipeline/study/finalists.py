"""The baseline and the finalists re-measured at every concurrency level of the study, through the trial's own
measure+check path, gathered into the per-level input of the promotion rule (`pipeline.decide.levels.decide_levels`).

The search measures at the first level only (`StudyConfig.search_concurrency`): a level as a search dimension would
spread a small budget over a product of spaces, and TPE would compare throughputs that differ by level, not by
config. The answer a serving team deploys is per level, so the few finalists pay for the other levels here.

Under open-loop arrivals (`workload.arrival.mode: poisson`, one level only) every re-run goes through the same path,
so it replays the trials' seeded Poisson schedule: the baseline and each finalist see the same arrival times, and
their runs carry the offered and drawn rates (`offered_rate_per_s`, `arrival_rate_per_s`) beside `req_per_s`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import TrialConfig
from pipeline.decide.levels import Candidate, LevelInput, RunFigures
from pipeline.measure.summary import to_table
from pipeline.trial.lifecycle import Outcome, TrialContext, measure_and_check


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


def remeasure(ctx: TrialContext, name: str, config: TrialConfig, runs: int, level: int,
              several_levels: bool = False) -> Remeasured:
    """`runs` fresh passes of `config` at concurrency `level` through `measure_and_check` (lost requests, settings
    the engine rewrote, equivalence with the baseline's outputs read from MLflow). A speculative config compared
    with nothing (no baseline outputs) is not equivalent: it cannot be promoted."""
    out = Remeasured()
    at_level = TrialConfig.model_validate({**config.model_dump(), "concurrency": level})
    compared = config.spec.algorithm != "none" and ctx.study.workload.temperature == 0
    for k in range(runs):
        label = run_label(name, level, k, several_levels)
        started_at = time.time()
        checked = measure_and_check(ctx, at_level, label, Path(ctx.output_dir) / "finalists" / label)
        m, outcome, reason, summary = checked.measurement, checked.outcome, checked.reason, checked.summary
        if outcome is Outcome.COMPLETE and compared and checked.equivalence is None:
            outcome, reason = Outcome.NOT_EQUIVALENT, f"not compared: {reason or 'no baseline outputs'}"
        if outcome is not Outcome.COMPLETE:
            out.equivalent = False
            if outcome is not Outcome.NOT_EQUIVALENT:
                out.failures.append(f"{label}: {outcome.value}: {reason[:200]}")
        measured = summary is not None and m.failure is None and outcome is not Outcome.INVALID
        out.runs.append(RunFigures.from_metrics(dict(summary.to_metrics())) if measured and summary is not None
                        else RunFigures(tput_tok_s=0.0))
        texts = {"engine.log": m.engine_log}
        if checked.equivalence is not None:
            texts["equivalence.json"] = checked.equivalence.model_dump_json(indent=2)
        ctx.tracker.log_trial(
            ctx.parent_run_id, study_name=ctx.study.name, run_name=label, kind="finalist",
            config=at_level.model_dump(mode="json"), outcome=outcome.value, reason=reason,
            metrics=summary.to_metrics() if summary else {}, requests=to_table(m.records) if m.records else None,
            texts=texts, started_at=started_at,
            extra_tags={"finalist": name, "concurrency": str(level),
                        "arrival": ctx.study.workload.arrival.describe(level)})
    return out


def measure_levels(ctx: TrialContext, baseline: TrialConfig, finalists: Sequence[tuple[str, TrialConfig]],
                   levels: Sequence[int], runs: int) -> list[LevelInput]:
    """Per level (in the study's order: the search level first), the baseline's then each finalist's re-runs."""
    several = len(levels) > 1
    inputs = []
    for level in levels:
        if several:
            print(f"  concurrency {level}: baseline and {len(finalists)} finalist(s), {runs} runs each", flush=True)
        elif ctx.study.workload.arrival.open_loop:
            print(f"  {ctx.study.workload.arrival.describe(level)}: baseline and {len(finalists)} finalist(s), "
                  f"{runs} runs each", flush=True)
        base = remeasure(ctx, "final-baseline", baseline, runs, level, several)
        candidates = []
        for name, config in finalists:
            got = remeasure(ctx, name, config, runs, level, several)
            candidates.append(Candidate(id=name, runs=tuple(got.runs), equivalent=got.equivalent, spec=config.spec,
                                        failures=tuple(got.failures)))
        inputs.append(LevelInput(level=level, baseline=tuple(base.runs), baseline_failures=tuple(base.failures),
                                 candidates=tuple(candidates)))
    return inputs
