"""A search trial's equivalence gate and the baseline's passes it needs, per `promotion.equivalence` mode.

- `exact`: a trial's measured outputs against the baseline trial's (its MLflow run's `requests.parquet`).
- `baseline-noise`: the baseline trial measures once more on a freshly launched engine (`launch_fresh`), and that
  second pass (`NOISE_ARTIFACT`) is the noise a trial's divergence is tested against (`pipeline.decide.noise`). A
  trial always runs on another launch than the baseline's first pass, so the reference must too: noise within one
  launch (same allocator state, same CUDA graphs) understates it. Cost: one launch and measurement of the baseline.
  It still measures decode kernels against decode kernels, where a trial's verify runs extend kernels over a tree
  mask, so a lossless trial may diverge systematically more than the reference: a NOT_EQUIVALENT verdict here is
  not reported to the search as a measurement (`Outcome.reports_measurement`), and finalists are judged again at every
  level against the baseline's fresh re-runs (`pipeline.study.finalists`).
- `deterministic`: the baseline and every compared trial measure once more on an engine started with the engine
  kind's deterministic-inference flags (`Engine.deterministic_flags`; SGLang's `--enable-deterministic-inference`),
  whose greedy outputs do not depend on the batch; those outputs must be identical, while the trial's throughput is
  the one measured without the flags. Cost: one more launch and measurement per compared trial and for the baseline
  (a different command line cannot share a launch). On an engine that is batch-invariant as it is (the CPU engine
  in fp32) `deterministic` is `exact`, with no extra launch.
Each measurement runs through the trial's own pass (`pipeline.trial.engine_pass.measure_config`), handed in by the
trial as a `MeasurePass`.

Finalists are compared with the baseline's re-runs at their own level instead (`pipeline.study.finalists`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.config import StudyConfig, TrialConfig
from pipeline.decide.equivalence import EquivalenceReport, judge
from pipeline.decide.noise import run_outputs, self_divergence
from pipeline.measure.summary import RequestRecord
from pipeline.records.tracking import Tracker
from pipeline.records.trial_runs import baseline_trial
from pipeline.trial.replicas import launch_fresh
from pipeline.trial.context import Measurement, TrialContext
from serve.engines import engine_for
from serve.engines.base import ReplicaConfig

__all__ = ["NOISE_ARTIFACT", "DETERMINISTIC_ARTIFACT", "NOT_COMPARED_DETERMINISTIC", "MeasurePass", "effective_mode",
           "deterministic_flags", "records_json", "records_from_json", "baseline_pass", "stored_pass", "Passes",
           "baseline_passes", "Verdict", "judge_trial"]

# One more pass of the config being judged, measured by the trial (`pipeline.trial.lifecycle`): (flags its engine
# starts with beyond the study's, run label, log folder) -> what it measured. The gate decides which passes a mode
# needs and judges them, from the study's config and run alone, never from the trial's context.
MeasurePass = Callable[[Sequence[str], str, Path], Measurement]

NOISE_ARTIFACT = "equivalence/noise_requests.json"
DETERMINISTIC_ARTIFACT = "equivalence/deterministic_requests.json"
NOT_COMPARED_DETERMINISTIC = ("the baseline has no deterministic-inference pass (it failed, or the engine refused "
                              "its flags), so no output of the search was compared with it")


def deterministic_flags(study: StudyConfig) -> list[str] | None:
    """What the study's engine kind adds to start deterministically ([] = batch-invariant as it is)."""
    engine = study.engine
    return engine_for(engine.kind).deterministic_flags(ReplicaConfig(engine=engine.kind, model=study.model.target,
                                                                     dtype=study.model.dtype, device=engine.device))


def effective_mode(study: StudyConfig) -> str:
    """The study's equivalence mode as it runs: `deterministic` on a batch-invariant engine is `exact`."""
    mode = study.promotion.equivalence
    return "exact" if mode == "deterministic" and not deterministic_flags(study) else mode


def records_json(records: Sequence[RequestRecord]) -> str:
    """A pass's measured requests as JSON (a run artifact)."""
    return json.dumps([dataclasses.asdict(r) for r in records if r.phase == "measure"])


def records_from_json(text: str) -> list[RequestRecord]:
    out = []
    for item in json.loads(text):
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in item.items()}
        out.append(RequestRecord(**fields))
    return out


def stored_pass(tracker: Tracker, parent_run_id: str, artifact: str) -> list[RequestRecord] | None:
    """The records of a pass (`artifact`) of the study's COMPLETE baseline trial, None when it has none."""
    run = baseline_trial(tracker, parent_run_id)
    text = tracker.artifact_text(run.run_id, artifact) if run is not None else None
    return records_from_json(text) if text is not None else None


def baseline_pass(ctx: TrialContext, artifact: str) -> list[RequestRecord] | None:
    """`stored_pass` of the study `ctx` runs (the finalists' check of the baseline's deterministic pass)."""
    return stored_pass(ctx.tracker, ctx.parent_run_id, artifact)


@dataclass
class Passes:
    """What the baseline's equivalence pass adds to its run: artifacts, metrics (its noise pass against its first:
    `self_*`, the engine's own divergence at the search level), launches, and why it failed (None: fine)."""

    texts: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    launches: int = 0
    problem: str | None = None


def baseline_passes(study: StudyConfig, config: TrialConfig, records: Sequence[RequestRecord], label: str,
                    log_dir: Path, measure: MeasurePass) -> Passes:
    """After the baseline trial's measurement (`records`): its noise pass (`baseline-noise`) or its deterministic
    pass, each measured by `measure`."""
    out = Passes()
    if config.spec.algorithm != "none" or study.workload.temperature > 0:
        return out
    mode = effective_mode(study)
    if mode == "baseline-noise":
        launch_fresh(study.name)  # the reference's noise comes from another launch, as every trial's does
        m = measure((), f"{label}-noise", log_dir / "noise")
        out.texts[NOISE_ARTIFACT], out.launches = records_json(m.records), m.launches
        out.problem = m.failure_text()
        if out.problem is None:
            own = self_divergence(config.concurrency, [run_outputs(records), run_outputs(m.records)])
            out.metrics = {f"self_{k}": float(v) for k, v in (("identical_share", own.identical_share),
                                                              ("token_agreement", own.token_agreement),
                                                              ("first_div_p50", own.first_divergence_p50))
                           if v is not None}
    elif mode == "deterministic":
        m = measure(deterministic_flags(study) or [], f"{label}-deterministic", log_dir / "deterministic")
        out.texts[DETERMINISTIC_ARTIFACT], out.launches = records_json(m.records), m.launches
        out.problem = m.failure_text()
    if out.problem:
        out.texts.pop(NOISE_ARTIFACT, None)
        out.texts.pop(DETERMINISTIC_ARTIFACT, None)
    return out


@dataclass
class Verdict:
    """A search trial's equivalence: `passed` None = not compared (`reason` says why)."""

    passed: bool | None
    reason: str
    report: EquivalenceReport | None = None
    launches: int = 0


def judge_trial(study: StudyConfig, tracker: Tracker, parent_run_id: str, config: TrialConfig,
                records: Sequence[RequestRecord], label: str, log_dir: Path, baseline: Sequence[RequestRecord] | None,
                measure: MeasurePass) -> Verdict:
    """A speculative trial's outputs against the baseline's, by the study's mode (module docstring). `baseline`: the
    baseline trial's measured outputs (None: it did not complete); the baseline's other passes are read from the
    study run `parent_run_id`; `measure` measures the deterministic pass."""
    policy = study.promotion
    if config.spec.algorithm == "none":
        return Verdict(True, "")
    if study.workload.temperature > 0:
        return Verdict(None, "sampling (temperature > 0): outputs are not compared")
    if baseline is None:
        return Verdict(None, "no baseline outputs to compare with (the baseline did not complete)")
    mode = effective_mode(study)
    if mode == "exact":
        report = judge("exact", baseline, [records], threshold=policy.equivalence_threshold)
        return Verdict(report.passed, report.reason, report)
    if mode == "baseline-noise":
        noise = stored_pass(tracker, parent_run_id, NOISE_ARTIFACT)
        if noise is None:
            return Verdict(None, "not compared: the baseline has no second pass to measure its own noise with")
        report = judge("baseline-noise", baseline, [records], baseline_others=[noise],
                       alpha=policy.equivalence_alpha)
        return Verdict(report.passed, report.reason, report)
    reference = stored_pass(tracker, parent_run_id, DETERMINISTIC_ARTIFACT)
    if reference is None:  # its pass failed or SGLang refused it: the trial's figure stands, it is never promoted
        return Verdict(None, f"not compared: {NOT_COMPARED_DETERMINISTIC}")
    m = measure(deterministic_flags(study) or [], f"{label}-deterministic", log_dir / "deterministic")
    if m.failure:
        return Verdict(False, f"the deterministic-inference pass failed, so equivalence is not shown: "
                              f"{m.failure_text()}", launches=m.launches)
    report = judge("deterministic", reference, [m.records], threshold=1.0)
    return Verdict(report.passed, report.reason, report, m.launches)

