"""The production endpoint (stable API): a Ray Serve app serving the promoted config, OpenAI-compatible.

The config comes from the MLflow registry (`models:/<name>@production` by default; another alias, a version, or a
serving-config file also works). The app is an ingress (`OpenAIIngress`: auth, limits, metrics, `/v1/config`) in
front of `serve/replica.py::EngineBackend` (the engine owner the trials' replica is built on); a serving policy
that switches config above N requests in flight (`serve.serving.RoutingPolicy`) gets a second engine deployment
(`EngineBackendHigh`) and the ingress routes by its own in-flight count. All deployments roll with
`max_surge_percent=100`: on a new config the new replica starts and gets ready before the old one stops, so a
promotion or a rollback drops no request (at the price of 2x the engine's resources during the swap).

Run it: `python -m serve.production --registered-model specdec-default --tracking-uri sqlite:///runs/default/mlflow.db`
or `serve run serve.production:app_builder registered_model=... tracking_uri=...`, or a Serve config file
(infra/serve-production.yaml) for `serve deploy`.

Auth, limits and backpressure (`serve.production_settings`, docs/security.md): both deployments bound Serve's queue
(`max_queued_requests`, 429 + Retry-After). `python -m serve.production` checks the auth rule before starting Ray
(exit 2 with the reason) and its banner reports what the running ingress enforces.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import MutableMapping
from typing import Any

from serve.engine_app import backpressure, engine_deployment, load_serving_config
from serve.engines.base import ENDPOINT_MALLOC_MARKER, ReplicaConfig
from serve.serving import ENGINE_DEPLOYMENTS, HIGH, LOW, SERVING_FILE, ServingConfig
from serve.production_settings import (LOCAL_HOSTS, PRODUCTION, ProductionSettings, auth_problem,
                                       load_admin_keys, load_api_keys)

CONFIG_FILE = SERVING_FILE
# The settings and their auth rules live in serve.production_settings (shared with serve.ingress without a circle);
# re-exported here because this is the production endpoint's public module.
__all__ = ["ProductionSettings", "PRODUCTION", "LOCAL_HOSTS", "build_app", "app_builder", "deploy", "main",
           "resolve_serving", "load_serving_config", "replica_config"]


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
    from serve.ingress import OpenAIIngress

    serving = resolve_serving(settings)
    engines = {route: engine_deployment(settings, replica_config(serving, settings.threads, route),
                                        ENGINE_DEPLOYMENTS[route])
               for route in ServingConfig.model_validate(serving["config"]).replicas()}
    # max_constructor_retry_count=1: a refused start (no keys off-localhost, placeholder keys) fails in seconds
    return OpenAIIngress.options(max_surge_percent=100, max_constructor_retry_count=1,  # type: ignore[attr-defined]
                                 max_ongoing_requests=settings.max_ongoing_requests, **backpressure(settings)
                                 ).bind(engines[LOW], settings.model_dump(mode="json"), serving, engines.get(HIGH))


def app_builder(args: dict[str, str]) -> Any:
    """`serve run serve.production:app_builder key=value ...` and Serve config files (`import_path`)."""
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


def _parser() -> Any:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m serve.production",
                                     description="Serve the promoted config behind an OpenAI-compatible endpoint.")
    for name, field in ProductionSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation in (bool, bool | None):
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None,
                                help=field.description)
        else:
            parser.add_argument(flag, dest=name, default=None, help=f"{field.description or name} "
                                f"(default: {field.default})")
    parser.add_argument("--ray-address", default=None, help="join a Ray cluster instead of starting a local one")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = vars(_parser().parse_args(argv))
    address = args.pop("ray_address")
    try:
        settings = ProductionSettings.model_validate({k: v for k, v in args.items() if v is not None})
        settings.source_uri()
    except ValueError as exc:
        print(f"error: {exc}")
        return 2
    # The same rule the ingress enforces, checked here first: a refused start says why in this terminal, at once,
    # instead of after Serve's retries with the reason only in Ray's logs.
    problem: str | None
    try:
        keys, admin_keys = load_api_keys(settings), load_admin_keys(settings)
    except OSError as exc:
        which = "--admin-key-file" if exc.filename == settings.admin_key_file else "--api-key-file"
        problem = f"{which}: cannot read {exc.filename!r}: {exc.strerror}"
    else:
        problem = auth_problem(settings, settings.host, keys, admin_keys)
    if problem:
        print(f"error: {problem}", flush=True)
        return 2
    if not address:
        local_ray_environment(os.environ)
    import ray
    from ray import serve

    # SIGTERM (a service manager, `kill`) stops the endpoint as Ctrl-C does: Serve shuts its replicas down, which
    # stop their engines. A SIGKILL runs nothing here: the engine watchdog's owner link stops the engine then.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        ray.init(address=address or "local", include_dashboard=False)  # help: "instead of starting a local one"
        serve.start(http_options={"host": settings.host, "port": settings.port})
        try:
            served = deploy(settings)
        except (RuntimeError, TimeoutError) as exc:
            print(f"error: {exc}", flush=True)
            serve.shutdown()
            return 1
        origin = served["origin"]
        # Ask the running ingress, not the settings: it knows the bind address and the keys it actually loaded.
        auth = serve.get_app_handle(settings.app_name).auth_summary.remote().result(timeout_s=60)
        print(f"serving {origin['source']} (version {origin['version']}) at http://{settings.host}:{settings.port}"
              f"/v1 -- auth {auth}; Ctrl-C stops", flush=True)
        follow(settings, origin.get("version"))
    except KeyboardInterrupt:
        print("stopping: shutting the endpoint and its engines down", flush=True)
        serve.shutdown()
        ray.shutdown()
    return 0


def local_ray_environment(env: MutableMapping[str, str]) -> None:
    """The environment of a local Ray that serves this machine only (set in `env` unless it is set already; Ray's
    processes read it when they start, this one when it imports Ray):
    - Ray's single-machine mode binds every Ray listener, its metrics exporter (which answers without auth) included,
      to 127.0.0.1 (Ray 2.60 turns an explicit 127.0.0.1 node address into the machine's routable one). Serve's HTTP
      proxy binds --host regardless.
    - a fixed glibc mmap threshold (128 KiB): request bodies pass through Serve's proxy and the ingress replica in
      buffers of up to megabytes, and with glibc's default (a threshold that rises to the largest buffer freed) the
      freed ones stay in the heap among live allocations. Under streaming traffic, refused 64 MiB uploads grew the
      proxy's and the ingress's private memory by ~60 MiB each (benchmarks/soak.py); fixed, by none. Engines get
      glibc's default back (`serve.engines.base.child_env`)."""
    env.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    if "MALLOC_MMAP_THRESHOLD_" not in env:
        env["MALLOC_MMAP_THRESHOLD_"] = env[ENDPOINT_MALLOC_MARKER] = str(128 * 1024)


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def current_version(settings: ProductionSettings) -> str | None:
    """The version the alias points at now (None when serving a pinned version or a file)."""
    if settings.config_file or settings.version or not settings.registered_model:
        return None
    from mlflow.tracking import MlflowClient

    return str(MlflowClient(tracking_uri=settings.tracking_uri, registry_uri=settings.tracking_uri).get_model_version_by_alias(
        settings.registered_model, settings.alias).version)


def follow(settings: ProductionSettings, serving_version: str | None) -> None:
    """Promotion and rollback move a registry alias; this loop rolls the app to wherever the alias points."""
    while True:
        time.sleep(settings.follow_alias_s or 3600)
        if not settings.follow_alias_s:
            continue
        try:
            wanted = current_version(settings)
        except Exception as exc:  # noqa: BLE001 - a registry hiccup must not take the endpoint down
            print(f"registry check failed, still serving version {serving_version}: {exc}", flush=True)
            continue
        if wanted is not None and wanted != serving_version:
            print(f"alias {settings.alias} moved to version {wanted}: rolling (new replica first)", flush=True)
            deploy(settings)
            serving_version = wanted
            print(f"now serving version {wanted}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("RAY_SERVE_LOG_TO_STDERR", "0")
    raise SystemExit(main())
