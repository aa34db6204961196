"""The production endpoint's Serve application (stable API): a Ray Serve app serving the promoted config,
OpenAI-compatible.

The config comes from the MLflow registry (`models:/<name>@production` by default; another alias, a version, or a
serving-config file also works). The app is an ingress (`OpenAIIngress`: auth, limits, metrics, `/v1/config`) in
front of `serve/replica/deployment.py::EngineBackend` (the engine owner the trials' replica is built on); a serving policy
that switches config above N requests in flight (`serve.serving.RoutingPolicy`) gets a second engine deployment
(`EngineBackendHigh`) and the ingress routes by its own in-flight count. All deployments roll with
`max_surge_percent=100`: on a new config the new replica starts and gets ready before the old one stops, so a
promotion or a rollback drops no request (at the price of 2x the engine's resources during the swap).

Run it: `python -m serve.production --registered-model specdec-default --tracking-uri sqlite:///runs/default/mlflow.db`
or `serve run serve.production.app:app_builder registered_model=... tracking_uri=...`, or a Serve config file
(infra/serve-production.yaml) for `serve deploy`.

Auth, limits and backpressure (`serve.production.settings`, docs/security.md): both deployments bound Serve's queue
(`max_queued_requests`, 429 + Retry-After). `python -m serve.production` checks the auth rule before starting Ray
(exit 2 with the reason) and its banner reports what the running ingress enforces.
"""

from __future__ import annotations

import time
from typing import Any

from serve.production.engine_app import backpressure, engine_deployment, load_serving_config
from serve.engines.base import ReplicaConfig
from serve.serving import ENGINE_DEPLOYMENTS, HIGH, LOW, SERVING_FILE, ServingConfig
from serve.production.settings import ProductionSettings

CONFIG_FILE = SERVING_FILE
__all__ = ["build_app", "app_builder", "deploy", "resolve_serving", "load_serving_config", "replica_config"]


def resolve_serving(settings: ProductionSettings) -> dict[str, Any]:
    """The config to serve plus where it came from (name, version, alias), for `/v1/config`."""
    uri = settings.source_uri()
    config = load_serving_config(settings.tracking_uri, uri)
    origin: dict[str, Any] = {"source": uri, "registered_model": settings.registered_model, "alias": None,
                              "version": settings.version}
    if uri.startswith("models:/") and not settings.version and settings.registered_model:
        from mlflow.tracking import MlflowClient

        found = MlflowClient(tracking_uri=settings.tracking_uri,
                             registry_uri=settings.tracking_uri).get_model_version_by_alias(
            settings.registered_model, settings.alias)
        origin.update(alias=settings.alias, version=str(found.version))
    return {"origin": origin, "config": config.model_dump(mode="json")}


def replica_config(serving: dict[str, Any], threads: int | None = None, route: str = LOW) -> ReplicaConfig:
    """The replica exactly as the serving config says (tp_size, extra_flags, env_from, start_timeout_s included);
    `threads` overrides only the CPU engine's thread count of this machine. `route` HIGH = the policy's second
    engine (KeyError when the policy has one config)."""
    replica = ServingConfig.model_validate(serving["config"]).replicas()[route]
    return replica.model_copy(update={"threads": threads}) if threads is not None else replica


def build_app(settings: ProductionSettings) -> Any:
    """The Serve application: ingress + one engine deployment per engine of the serving policy (one, or two when
    the policy switches config above a concurrency), all rolling with a 100% surge."""
    from serve.production.ingress import OpenAIIngress

    serving = resolve_serving(settings)
    engines = {route: engine_deployment(settings, replica_config(serving, settings.threads, route),
                                        ENGINE_DEPLOYMENTS[route])
               for route in ServingConfig.model_validate(serving["config"]).replicas()}
    # max_constructor_retry_count=1: a refused start (no keys off-localhost, placeholder keys) fails in seconds
    return OpenAIIngress.options(max_surge_percent=100, max_constructor_retry_count=1,  # type: ignore[attr-defined]
                                 max_ongoing_requests=settings.max_ongoing_requests, **backpressure(settings)
                                 ).bind(engines[LOW], settings.model_dump(mode="json"), serving, engines.get(HIGH))


def app_builder(args: dict[str, str]) -> Any:
    """`serve run serve.production.app:app_builder key=value ...` and Serve config files (`import_path`)."""
    return build_app(ProductionSettings.model_validate(args))


def deploy(settings: ProductionSettings, timeout_s: float = 900.0) -> dict[str, Any]:
    """Deploy or roll the production app to the config `settings` resolve to; returns what it serves.

    A running app is updated in place by Serve: new replicas start before old ones stop (max_surge_percent=100).
    """
    from ray import serve

    app = build_app(settings)
    serve.run_many([serve.RunTarget(app, name=settings.app_name, route_prefix="/")],
                   wait_for_applications_running=False)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications.get(settings.app_name)
        state = str(status.status) if status else "MISSING"
        if state.endswith("RUNNING"):
            return resolve_serving(settings)
        if state.endswith("DEPLOY_FAILED"):
            raise RuntimeError(f"production app failed to deploy: {_reason(status)}")
        time.sleep(0.5)
    raise TimeoutError(f"production app not RUNNING after {timeout_s:.0f} s")


def _reason(status: Any) -> str:
    """The deployments' own messages (a constructor's exception text) before the app's generic one."""
    messages = [f"{name}: {d.message}" for name, d in (getattr(status, "deployments", None) or {}).items()
                if getattr(d, "message", "")]
    return "\n".join(messages) or str(status.message)
