"""The study's equivalence gate as a trial runs it (the modes and their verdicts: `pipeline.decide.equivalence`): the
mode as the study's engine kind runs it (`effective_mode`, `gate_for`), and the baseline's reference pass, which
later trials compare with (`reference_pass`: on a fresh launch for `baseline-noise`, with the deterministic-inference
flags for `deterministic`) and a compared trial's own deterministic pass, each one more pass of the config
(`gate_pass`) through the trial's own (`pipeline.trial.engine_pass.measure_config`).

Finalists are compared with the baseline's re-runs at their own level instead (`pipeline.study.finalists`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.config import StudyConfig, TrialConfig
from pipeline.decide.equivalence import NOT_COMPARED_DETERMINISTIC, Gate, mode_as_run
from pipeline.decide.noise import self_metrics
from pipeline.measure.measurement import Measurement
from pipeline.measure.summary import RequestRecord, records_json
from pipeline.records.trial_runs import DETERMINISTIC_ARTIFACT, PASS_ARTIFACTS, stored_pass_records
from pipeline.trial.context import TrialContext
from pipeline.trial.engine_pass import measure_config
from pipeline.trial.replicas import launch_fresh
from serve.engines import engine_for
from serve.engines.base import Engine, ReplicaConfig

# DETERMINISTIC_ARTIFACT and NOT_COMPARED_DETERMINISTIC: the finalists' stage asks the gate what a trial asks (has the
# baseline its deterministic pass, and what is said where it has none)
__all__ = ["DETERMINISTIC_ARTIFACT", "NOT_COMPARED_DETERMINISTIC", "References", "baseline_pass",
           "deterministic_flags", "effective_mode", "gate_for", "gate_pass", "reference_pass"]


def deterministic_flags(study: StudyConfig, engine: Engine) -> list[str] | None:
    """What the study's engine kind (`engine`) adds to start deterministically ([] = batch-invariant as it is)."""
    settings = study.engine
    return engine.deterministic_flags(ReplicaConfig(engine=settings.kind, model=study.model.target,
                                                    dtype=study.model.dtype, device=settings.device))


def effective_mode(study: StudyConfig) -> str:
    """The study's equivalence mode as it runs: `deterministic` on a batch-invariant engine is `exact`."""
    return mode_as_run(study.promotion.equivalence, deterministic_flags(study, engine_for(study.engine.kind)))


def gate_for(ctx: TrialContext, config: TrialConfig) -> Gate:
    """The study's equivalence mode as it applies to `config`'s trial."""
    study = ctx.study
    return Gate(setting=study.promotion.equivalence, algorithm=config.spec.algorithm,
                temperature=study.workload.temperature, threshold=study.promotion.equivalence_threshold,
                alpha=study.promotion.equivalence_alpha, flags=tuple(deterministic_flags(study, ctx.engine) or ()))


def gate_pass(ctx: TrialContext, gate: Gate, config: TrialConfig, label: str, log_dir: Path,
              which: str) -> Measurement:
    """One more pass of `config` as the study's mode asks for it (`which`): `noise` on a freshly launched engine (the
    reference's noise comes from another launch, as every trial's does), `deterministic` on an engine started with
    the deterministic-inference flags."""
    if which == "noise":
        launch_fresh(ctx.study.name)
    return measure_config(ctx.with_flags(gate.flags) if which == "deterministic" else ctx, config, f"{label}-{which}",
                          log_dir / which)


@dataclass(frozen=True)
class References:
    """What the baseline's reference pass adds to its run: the pass's requests as an artifact, metrics (its noise
    pass against its first: `self_*`, the engine's own divergence at the search level), launches, and why it failed
    (None: fine; then no artifact is recorded, and no trial can be compared with it)."""

    texts: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    launches: int = 0
    problem: str | None = None


def reference_pass(ctx: TrialContext, gate: Gate, config: TrialConfig, label: str, log_dir: Path,
                   first: Sequence[RequestRecord]) -> References:
    """After the baseline trial's measurement (`first`): the pass later trials compare with (`Gate.reference_pass`).
    None of it for any other config or mode."""
    which = gate.reference_pass
    if which is None:
        return References()
    m = gate_pass(ctx, gate, config, label, log_dir, which)
    problem = m.failure_text()
    if problem:
        return References(launches=m.launches, problem=problem)
    metrics = self_metrics(config.concurrency, first, m.records) if which == "noise" else {}
    return References({PASS_ARTIFACTS[which]: records_json(m.records)}, metrics, m.launches)


def baseline_pass(ctx: TrialContext, artifact: str) -> list[RequestRecord] | None:
    """The baseline trial's stored pass `artifact` of the study `ctx` runs (the finalists' check of the baseline's
    deterministic pass)."""
    return stored_pass_records(ctx.tracker, ctx.parent_run_id, artifact)
