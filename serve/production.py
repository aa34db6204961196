"""The production endpoint (stable API): a Ray Serve app serving the promoted config, OpenAI-compatible.

The config comes from the MLflow registry (`models:/<name>@production` by default; another alias, a version, or a
serving-config file also works). The app is an ingress (`OpenAIIngress`: auth, limits, metrics, `/v1/config`) in
front of `serve/replica.py::EngineBackend` (the engine owner the trials' replica is built on). Both deployments roll with
`max_surge_percent=100`: on a new config the new replica starts and gets ready before the old one stops, so a
promotion or a rollback drops no request (at the price of 2x the engine's resources during the swap).

Run it: `python -m serve.production --registered-model specdec-default --tracking-uri sqlite:///runs/default/mlflow.db`
or `serve run serve.production:app_builder registered_model=... tracking_uri=...`, or a Serve config file
(infra/serve-production.yaml) for `serve deploy`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from pydantic import Field

from serve.engines.base import ReplicaConfig
from serve.spec import FrozenModel

PRODUCTION, CONFIG_FILE = "production", "serving_config.json"
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


class ProductionSettings(FrozenModel):
    """Where the config comes from and how the endpoint behaves. Every field can be given on the command line."""

    registered_model: str | None = Field(None, description="registry name, e.g. specdec-default")
    alias: str = Field(PRODUCTION, description="registry alias to serve (ignored when version is set)")
    version: str | None = Field(None, description="a registered version number instead of an alias")
    config_file: str | None = Field(None, description="a serving-config JSON/YAML file instead of the registry")
    tracking_uri: str | None = Field(None, description="MLflow tracking URI of the registry")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    app_name: str = PRODUCTION
    num_replicas: int = Field(1, ge=1)
    require_auth: bool | None = Field(None, description="None: required when host is not a localhost address")
    api_keys_env: str = Field("SPECDEC_API_KEYS", description="env var with comma-separated API keys")
    api_key_file: str | None = Field(None, description="file with one API key per line")
    max_request_bytes: int = Field(1_000_000, ge=1024, description="bigger bodies get 413")
    max_tokens_limit: int = Field(2048, ge=1, description="max_tokens above this gets 422")
    threads: int | None = Field(None, ge=1, description="cpu engine torch threads")
    follow_alias_s: float = Field(10.0, ge=0, description="python -m serve.production: poll the registry alias this "
                                                          "often and roll to a new version (0 = off)")

    def auth_required(self) -> bool:
        return self.require_auth if self.require_auth is not None else self.host not in LOCAL_HOSTS

    def source_uri(self) -> str:
        if self.config_file:
            return str(Path(self.config_file).resolve())
        if not self.registered_model:
            raise ValueError("give registered_model (e.g. specdec-default) or config_file")
        if self.version:
            return f"models:/{self.registered_model}/{self.version}"
        return f"models:/{self.registered_model}@{self.alias}"


def load_serving_config(tracking_uri: str | None, uri: str) -> dict[str, Any]:
    """A serving config from `models:/<name>@<alias>`, `models:/<name>/<version>` or a JSON/YAML file."""
    if not uri.startswith("models:/"):
        import yaml

        return dict(yaml.safe_load(Path(uri).read_text()))
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
    target = folder / CONFIG_FILE if folder.is_dir() else folder
    return json.loads(target.read_text())


def resolve_serving(settings: ProductionSettings) -> dict[str, Any]:
    """The config to serve plus where it came from (name, version, alias), for `/v1/config`."""
    uri = settings.source_uri()
    config = load_serving_config(settings.tracking_uri, uri)
    origin: dict[str, Any] = {"source": uri, "registered_model": settings.registered_model, "alias": None,
                              "version": settings.version}
    if uri.startswith("models:/") and not settings.version:
        from mlflow.tracking import MlflowClient

        found = MlflowClient(tracking_uri=settings.tracking_uri,
                             registry_uri=settings.tracking_uri).get_model_version_by_alias(
            settings.registered_model, settings.alias)
        origin.update(alias=settings.alias, version=str(found.version))
    return {"origin": origin, "config": config}


def replica_config(serving: dict[str, Any], threads: int | None = None) -> ReplicaConfig:
    config = serving["config"]
    trial = config["trial"]
    return ReplicaConfig(engine=config.get("engine", "cpu"), model=config["model"],
                         dtype=config.get("dtype", "float32"), spec=trial["spec"],
                         max_running_requests=trial.get("max_running_requests"), threads=threads)


def build_app(settings: ProductionSettings) -> Any:
    """The Serve application: ingress + one engine deployment, both rolling with a 100% surge."""
    from serve.ingress import OpenAIIngress
    from serve.replica import EngineBackend

    serving = resolve_serving(settings)
    engine_cfg = replica_config(serving, settings.threads)
    num_gpus = engine_cfg.tp_size if engine_cfg.engine == "sglang" else 0
    engine = EngineBackend.options(
        num_replicas=settings.num_replicas, max_surge_percent=100, max_constructor_retry_count=3,
        ray_actor_options={"num_cpus": 0.1, "num_gpus": num_gpus}).bind(engine_cfg.model_dump(mode="json"))
    return OpenAIIngress.options(max_surge_percent=100).bind(engine, settings.model_dump(mode="json"), serving)


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
            raise RuntimeError(f"production app failed to deploy: {status.message}")
        time.sleep(0.5)
    raise TimeoutError(f"production app not RUNNING after {timeout_s:.0f} s")


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
    import ray
    from ray import serve

    ray.init(address=address, include_dashboard=False)
    serve.start(http_options={"host": settings.host, "port": settings.port})
    served = deploy(settings)
    origin = served["origin"]
    print(f"serving {origin['source']} (version {origin['version']}) at http://{settings.host}:{settings.port}/v1 "
          f"-- auth {'required' if settings.auth_required() else 'off (localhost)'}; Ctrl-C stops", flush=True)
    try:
        follow(settings, origin.get("version"))
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


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
