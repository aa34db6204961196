"""MLflow model-registry action of promotion: register a serving config, move aliases, roll back, load.

A "model version" here is a serving config (engine, model, speculative settings), not weights. MLflow 3 refuses
`register_model("runs:/<id>/<dir>")` for a plain folder, so the config is logged as an artifact folder of the study
run and registered with `create_model_version(source=<artifact uri>)`; `models:/<name>@production` then downloads
to that folder (`serving_config.json`). Alias `production` is the served one, `previous` the one before it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from pipeline.errors import PipelineError
from pipeline.record import Tracker
from serve.production import CONFIG_FILE, PRODUCTION, load_serving_config  # noqa: F401 - re-exported

PREVIOUS = "previous"


def _alias_version(client: Any, name: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def register_config(tracker: Tracker, run_id: str, name: str, serving: dict[str, Any],
                    move_production: bool) -> str | None:
    """Register `serving` as a new version of `name`. Moves `production` to it when `move_production`, or when no
    version is in production yet (a first study's baseline becomes what the endpoint serves). Returns the version."""
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
    existing = client.search_model_versions(f"name='{name}'")
    artifact_path = f"serving_config_v{len(existing) + 1}"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / artifact_path
        folder.mkdir()
        (folder / CONFIG_FILE).write_text(json.dumps(serving, indent=2))
        client.log_artifacts(run_id, str(folder), artifact_path)
    run = client.get_run(run_id)
    version = client.create_model_version(name, source=f"{run.info.artifact_uri}/{artifact_path}", run_id=run_id,
                                          tags={"decision": str(serving.get("decision")),
                                                "algorithm": str(serving["trial"]["spec"]["algorithm"])})
    set_production(tracker, name, str(version.version))
    return str(version.version)


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
