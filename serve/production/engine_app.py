"""Pieces of the production app that both the app builder (`serve.production`) and the canary (`serve.closed_loop.candidate_arm`)
use: the serving config at a registry URI or in a file, and one engine deployment of it with the endpoint's
backpressure. Kept apart so that the ingress's canary can build an engine without importing the app builder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from serve.engines.base import ReplicaConfig
from serve.production.settings import ProductionSettings
from serve.serving import SERVING_FILE, ServingConfig

__all__ = ["ENGINE_START_ATTEMPTS", "load_serving_config", "backpressure", "engine_deployment"]

ENGINE_START_ATTEMPTS = 3  # starts of a production engine before its replica fails (`start_ready_engine`)


def load_serving_config(tracking_uri: str | None, uri: str) -> ServingConfig:
    """The serving config at `models:/<name>@<alias>`, `models:/<name>/<version>` or a JSON/YAML file, validated:
    a file that is not a ServingConfig is refused with the field named."""
    if not uri.startswith("models:/"):
        import yaml

        return _validated(yaml.safe_load(Path(uri).read_text()), uri)
    import mlflow
    from mlflow.tracking import MlflowClient

    # Resolve the version with an explicit client: `download_artifacts("models:/...")` would ask the process-global
    # registry URI, not `tracking_uri`.
    name, _, ref = uri[len("models:/"):].partition("@")
    client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
    if ref:
        version = client.get_model_version_by_alias(name, ref)
    else:
        name, _, number = name.partition("/")
        version = client.get_model_version(name, number)
    folder = Path(mlflow.artifacts.download_artifacts(artifact_uri=version.source, tracking_uri=tracking_uri))
    target = folder / SERVING_FILE if folder.is_dir() else folder
    return _validated(json.loads(target.read_text()), uri)


def _validated(data: Any, where: str) -> ServingConfig:
    from pydantic import ValidationError

    if isinstance(data, dict):
        # promoted.yaml is a serving config plus where it was registered: accepted as --config-file too.
        data = {k: v for k, v in data.items() if k not in ("registered_model", "version")}
    try:
        return ServingConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(top)'}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{where} is not a serving config ({problems}). Fix: use the serving_config.json a study "
                         "wrote (deploy/ of its output folder) or a registered version") from None


def backpressure(settings: ProductionSettings) -> dict[str, Any]:
    """Serve's own queue in front of a deployment is bounded; a request beyond it gets 429 with Retry-After."""
    from ray.serve.config import BackpressureConfig

    return {"max_queued_requests": settings.max_queued_requests,
            "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=settings.retry_after_s)}


def engine_deployment(settings: ProductionSettings, replica: ReplicaConfig, name: str, surge: bool = True) -> Any:
    """One engine deployment (Serve application node) of `replica`: on a roll, `surge` starts the new replica
    before the old one stops (100% surge: twice the resources meanwhile); without it the old one stops first
    (`serve.production.roll`)."""
    from serve.replica.deployment import EngineBackend
    from serve.replica.placement import actor_options

    # @serve.deployment made EngineBackend a Deployment (mypy sees the class).
    # The replica retries its engine's start itself (`start_ready_engine`), except a load failure a retry would repeat;
    # Serve's own constructor retries could not tell one apart.
    return EngineBackend.options(  # type: ignore[attr-defined]
        name=name, num_replicas=settings.num_replicas, max_surge_percent=100 if surge else 0,
        max_constructor_retry_count=1, **backpressure(settings), ray_actor_options=actor_options(replica)
    ).bind(replica.to_replica(), start_attempts=ENGINE_START_ATTEMPTS)
