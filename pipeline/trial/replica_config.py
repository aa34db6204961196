"""The replica a trial's config runs as: the study's engine settings with the trial's spec. Its own module, light to
import (no Ray, no MLflow), for the study's checks before anything starts (the dry run) as for the trial itself."""

from __future__ import annotations

from pathlib import Path

from pipeline.config import StudyConfig, TrialConfig
from serve.engines.base import ReplicaConfig

__all__ = ["replica_config"]


def replica_config(study: StudyConfig, trial: TrialConfig, log_dir: Path) -> ReplicaConfig:
    engine = study.engine
    return ReplicaConfig(
        engine=engine.kind, model=study.model.target, dtype=study.model.dtype, device=engine.device,
        attention_backend=engine.attention_backend, spec=trial.spec,
        max_running_requests=trial.max_running_requests, threads=engine.threads, cpus=engine.cpus,
        weights=engine.weights,
        tp_size=engine.tp_size,
        replica_cpus=engine.replica_cpus, replica_resources=engine.replica_resources, extra_flags=engine.extra_flags,
        env=engine.env, start_timeout_s=engine.start_timeout_s, log_dir=str(log_dir))
