"""MLflow model-registry action of promotion: register a serving config, move aliases, roll back, load.

A "model version" here is a `serve.serving.ServingConfig` (the replica the winning trial ran + provenance), not
weights. It is logged as an MLflow 3 LoggedModel of the study's experiment: params = the replica's fields (engine,
model, spec.*, tp_size, extra_flags, env_from names), tags = decision and algorithm, so the Models page shows the spec;
its artifacts hold `serving_config.json`; the study run records the workload (name + digest) as its dataset input and
the model as its output, and the re-measured medians are logged as the model's metrics on that dataset. The version is
created from the model's artifact location, so `load_serving_config("models:/<name>@production")` downloads that file.
Alias `production` is the served one, `previous` the one before it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.records.tracking import Tracker
from serve.production import CONFIG_FILE, PRODUCTION, load_serving_config  # noqa: F401 - re-exported
from serve.serving import ServingConfig, spec_params

PREVIOUS = "previous"


def _alias_version(client: Any, name: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def register_config(tracker: Tracker, run_id: str, name: str, serving: ServingConfig,
                    move_production: bool) -> str | None:
    """Register `serving` as a new version of `name`. Moves `production` to it when `move_production`, or when no
    version is in production yet (a first study's baseline becomes what the endpoint serves). Returns the version."""
    from mlflow.entities import Dataset, DatasetInput, InputTag, LoggedModelOutput
    from mlflow.exceptions import MlflowException

    client = tracker.client()
    current = None
    try:
        client.get_registered_model(name)
        current = _alias_version(client, name, PRODUCTION)
    except MlflowException:
        client.create_registered_model(name, description="specdec-tuner serving configs (engine + speculative settings)")
    if not move_production and current is not None:
        return None
    prov = serving.provenance
    tags = {"decision": prov.decision, "algorithm": serving.replica.spec.algorithm, "engine": serving.replica.engine,
            "study": prov.study, "source": prov.source, "workload_digest": prov.workload_digest}
    model = client.create_logged_model(tracker.experiment_id(), name=f"{prov.study}-serving", source_run_id=run_id,
                                       tags=tags, params=spec_params(serving), model_type="specdec-serving-config")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / CONFIG_FILE).write_text(serving.model_dump_json(indent=2))
        client.log_model_artifacts(model.model_id, tmp)
    client.finalize_logged_model(model.model_id, "READY")
    dataset = Dataset(name=prov.workload, digest=prov.workload_digest, source_type="specdec-workload",
                      source=prov.workload)
    client.log_inputs(run_id, datasets=[DatasetInput(dataset, [InputTag("mlflow.data.context", "measure")])])
    client.log_outputs(run_id, [LoggedModelOutput(model.model_id, 0)])
    for key, value in prov.medians.items():
        client.log_metric(run_id, f"serving_{key}", value, model_id=model.model_id, dataset_name=prov.workload,
                          dataset_digest=prov.workload_digest)
    # Source = the model's artifact folder, not `models:/<model id>`: the store resolves that form through the
    # process-global tracking URI, not this client's. SQL stores drop `model_id`, so it is a tag as well.
    version = client.create_model_version(name, source=model.artifact_location, run_id=run_id,
                                          tags={**tags, "model_id": model.model_id}, model_id=model.model_id)
    set_production(tracker, name, str(version.version))
    return str(version.version)


def production_version(tracker: Tracker, name: str) -> str | None:
    """The version alias `production` of `name` points at, or None."""
    return _alias_version(tracker.client(), name, PRODUCTION)


def set_production(tracker: Tracker, name: str, version: str) -> None:
    """Point `production` at `version`, keeping the version it pointed at as `previous`."""
    client = tracker.client()
    current = _alias_version(client, name, PRODUCTION)
    if current is not None and current != version:
        client.set_registered_model_alias(name, PREVIOUS, current)
    client.set_registered_model_alias(name, PRODUCTION, version)


def rollback(tracker: Tracker, name: str) -> tuple[str, str]:
    """Swap `production` and `previous`; returns (new production, new previous)."""
    client = tracker.client()
    current, previous = _alias_version(client, name, PRODUCTION), _alias_version(client, name, PREVIOUS)
    if previous is None or current is None:
        raise PipelineError(f"registered model '{name}' has no alias '{PREVIOUS}' to roll back to "
                            f"(production={current}, previous={previous})")
    client.set_registered_model_alias(name, PRODUCTION, previous)
    client.set_registered_model_alias(name, PREVIOUS, current)
    return previous, current
