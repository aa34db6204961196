"""The production endpoint's Serve application (stable API): a Ray Serve app serving the promoted config,
OpenAI-compatible.

The config comes from the MLflow registry (`models:/<name>@production` by default; another alias, a version, or a
serving-config file also works). The app is an ingress (`OpenAIIngress`: auth, limits, metrics, `/v1/config`) in
front of `serve/replica/deployment.py::EngineBackend` (the engine owner the trials' replica is built on); a serving policy
that switches config above N requests in flight (`serve.serving.RoutingPolicy`) gets a second engine deployment
(`EngineBackendHigh`) and the ingress routes by its own in-flight count. A roll (`serve.production.roll`) surges
where a second copy of the engines fits (the new replica starts and gets ready before the old one stops, so a
promotion or a rollback drops no request), and stops then starts where it does not, with the gap answered 503 +
Retry-After; the deploy waits as long as the serving config's start timeout allows.

Run it: `python -m serve.production --registered-model specdec-default --tracking-uri sqlite:///runs/default/mlflow.db`
or `serve run serve.production.app:app_builder registered_model=... tracking_uri=...`, or a Serve config file
(infra/serve-production.yaml) for `serve deploy`.

Auth, limits and backpressure (`serve.production.settings`, docs/security.md): both deployments bound Serve's queue
(`max_queued_requests`, 429 + Retry-After). `python -m serve.production` checks the auth rule before starting Ray
(exit 2 with the reason) and its banner reports what the running ingress enforces.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from serve.engines.base import ReplicaConfig
from serve.production.engine_app import backpressure, engine_deployment, load_serving_config
from serve.production.roll import STOP_THEN_START, SURGE, Roll, deploy_timeout_s, free_per_node, plan_roll
from serve.production.settings import ProductionSettings
from serve.replica.status import app_state, wait_for_app
from serve.serving import ENGINE_DEPLOYMENTS, HIGH, LOW, SERVING_FILE, ServingConfig

CONFIG_FILE = SERVING_FILE
__all__ = ["build_app", "app_builder", "deploy", "resolve_serving", "load_serving_config", "replica_config",
           "running_serving"]


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


def build_app(settings: ProductionSettings, serving: dict[str, Any] | None = None, roll: Roll = SURGE,
              gap: bool = False) -> Any:
    """The Serve application: ingress + one engine deployment per engine of the serving policy (one, or two when
    the policy switches config above a concurrency), rolling as `roll` says (`serve.production.roll`). `gap`: no
    engine that could answer runs now, so the new ingress answers 503 + Retry-After until its engines are up."""
    from serve.production.ingress import OpenAIIngress

    serving = serving if serving is not None else resolve_serving(settings)
    engines = {route: engine_deployment(settings, replica_config(serving, settings.threads, route),
                                        ENGINE_DEPLOYMENTS[route], surge=roll == SURGE)
               for route in ServingConfig.model_validate(serving["config"]).replicas()}
    # max_constructor_retry_count=1: a refused start (no keys off-localhost, placeholder keys) fails in seconds.
    # The ingress itself always surges (a tenth of a CPU): the new one is up before the old one stops.
    return OpenAIIngress.options(max_surge_percent=100, max_constructor_retry_count=1,  # type: ignore[attr-defined]
                                 max_ongoing_requests=settings.max_ongoing_requests, **backpressure(settings)
                                 ).bind(engines[LOW], settings.model_dump(mode="json"), serving, engines.get(HIGH),
                                        gap)


def app_builder(args: dict[str, str]) -> Any:
    """`serve run serve.production.app:app_builder key=value ...` and Serve config files (`import_path`)."""
    return build_app(ProductionSettings.model_validate(args))


def running_serving(app_name: str) -> dict[str, Any] | None:
    """What the running app's ingress serves (`resolve_serving`'s dict), None when the app is not running."""
    from ray import serve

    if app_state(app_name).status != "RUNNING":
        return None
    try:
        return dict(serve.get_app_handle(app_name).serving_now.remote().result(timeout_s=60))
    except Exception:  # noqa: BLE001 - an ingress that cannot say: treated as nothing known, a surge roll
        return None


def deploy(settings: ProductionSettings, timeout_s: float | None = None,
           say: Callable[[str], None] = lambda text: print(text, flush=True)) -> dict[str, Any]:
    """Deploy or roll the production app to the config `settings` resolve to; returns what it serves.

    Waits at most `timeout_s` (default: `serve.production.roll.deploy_timeout_s` of the new config) for the app to
    run: RuntimeError when it failed to deploy, TimeoutError when it is not running in time (the caller decides
    what then: `python -m serve.production` rolls back). A running app is rolled as `plan_roll` decides; a
    stop-then-start roll tells the running ingress first, which answers 503 + Retry-After from then on.
    """
    from ray import serve

    serving = resolve_serving(settings)
    config = ServingConfig.model_validate(serving["config"])
    wait_s = timeout_s if timeout_s is not None else deploy_timeout_s(config)
    now = running_serving(settings.app_name)
    running = ServingConfig.model_validate(now["config"]) if now is not None else None
    roll = plan_roll(config, running, settings.num_replicas, free_per_node() if running is not None else [],
                     settings.threads)
    if roll == STOP_THEN_START:
        why = (f"the endpoint is switching to version {serving['origin'].get('version') or 'new'}: the old engine "
               "stops before the new one starts (two copies do not fit the cluster)")
        say(f"roll: two copies of the engine do not fit the cluster's free resources; stopping the old engine "
            f"before the new one starts, answering 503 + Retry-After meanwhile (up to {wait_s:.0f} s)")
        serve.get_app_handle(settings.app_name).announce_gap.remote(why).result(timeout_s=60)
    # No engine answers until the new ones run: a stop-then-start roll, or an app that exists but does not run (a
    # rollback after a failed roll). A first deploy keeps Serve's own behaviour: requests wait for the engine.
    gap = roll == STOP_THEN_START or (now is None and app_state(settings.app_name).exists)
    try:
        serve.run_many([serve.RunTarget(build_app(settings, serving, roll, gap), name=settings.app_name,
                                        route_prefix="/")], wait_for_applications_running=False)
    except BaseException:
        if roll == STOP_THEN_START:  # nothing was rolled: the running ingress serves again
            serve.get_app_handle(settings.app_name).announce_gap.remote(None).result(timeout_s=60)
        raise
    state = wait_for_app(settings.app_name, wait_s, lambda s: s.status in ("RUNNING", "DEPLOY_FAILED"))
    if state is not None and state.status == "RUNNING":
        if gap:  # every engine runs now: the ingress answers at once, not at its own next look
            serve.get_app_handle(settings.app_name).announce_gap.remote(None).result(timeout_s=60)
        return serving
    if state is not None:  # the deployments' own messages (a constructor's exception text) first
        raise RuntimeError(f"production app failed to deploy: {state.failure()}")
    raise TimeoutError(f"production app not RUNNING after {wait_s:.0f} s (the serving config's start_timeout_s "
                       "plus the old engines' drain and Serve's margin)")
