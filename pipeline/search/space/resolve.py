"""Resolution: a sampled point (Optuna params) -> a validated TrialConfig, or the reasons it is INVALID."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from pipeline.config import StudyConfig, TrialConfig, validate_trial
from pipeline.search.space.model import TRIAL_FIELDS, FixedParam, SearchSpace, applies, default_value
from pipeline.vocabulary.resolution import Resolution
from serve.spec import DRAFT_MODEL_ALGORITHMS, Violation


def resolve(space: SearchSpace, params: dict[str, Any], study: StudyConfig) -> Resolution:
    """Optuna params (+ fixed values, study drafts and concurrency) -> TrialConfig, validated for the study's engine."""
    algorithm = params.get("algorithm")
    if algorithm not in space.algorithms:
        return Resolution(params, None, [Violation("algorithm", f"one of {space.algorithms}", f"{algorithm!r}")])
    values: dict[str, Any] = {}
    for optuna_name, name, p in space.params_for(algorithm):
        if not applies(p, values):
            continue  # the field keeps its default: the engine ignores it at this point
        if isinstance(p, FixedParam):
            values[name] = p.value
        elif optuna_name in params:
            values[name] = params[optuna_name]
        else:
            values[name] = default_value(p, values, optuna_name)
    spec: dict[str, Any] = {"algorithm": algorithm}
    trial: dict[str, Any] = {"concurrency": study.concurrency[0]}
    for name, value in values.items():
        (trial if name in TRIAL_FIELDS else spec)[name] = value
    if algorithm in DRAFT_MODEL_ALGORITHMS and not spec.get("draft_model"):
        spec["draft_model"] = study.model.drafts.get(algorithm)
    try:
        config = TrialConfig.model_validate({**trial, "spec": spec})
    except ValidationError as exc:
        return Resolution(params, None, [
            Violation(".".join(str(x) for x in e["loc"] if x != algorithm), e["msg"], repr(e.get("input")))
            for e in exc.errors(include_url=False)])
    return Resolution(params, config, validate_trial(config, study.engine.kind))
