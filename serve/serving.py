"""The serving config: exactly the replica a winning trial measured, plus where it came from.

One typed object (`ServingConfig`) travels from the end of a study (pipeline/finalize.py) through the registry
(pipeline/registry.py) to the production endpoint (serve/production.py) and its `/v1/config` (serve/ingress.py). Its
`replica` is the `ReplicaConfig` the trial's replica ran, built by the same function (`pipeline.trial.replica_config`),
so tp_size, extra_flags, start_timeout_s and the engine environment reach production unchanged. Two things differ:
`log_dir` (a trial folder) is dropped, and secrets travel as references: every `env` name moves to `env_from`, and
the engine reads its value from the production replica's own environment (`Engine.start_env`).

The deployable forms of a serving config (engine command line, Serve config file, KubeRay patch) are rendered here too,
so the files a user deploys and the config production loads cannot disagree.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, model_validator

from serve.engines.base import ReplicaConfig
from serve.spec import FrozenModel

COMMAND_FILE = "engine_command.sh"
SERVE_CONFIG_FILE = "serve_config.yaml"
RAYSERVICE_PATCH_FILE = "rayservice_patch.yaml"
SERVING_FILE = "serving_config.json"
ENGINE_HOST, ENGINE_PORT = "0.0.0.0", 30000


class Provenance(FrozenModel):
    """Where a serving config comes from: the study, the decision, the measured run, the workload it was measured on."""

    study: str
    decision: str = Field(description="promote | keep_baseline | ...")
    source: str = Field(description="'baseline' or the finalist id that won")
    trial_run_id: str | None = Field(None, description="MLflow run id of the trial that measured this config")
    workload: str = Field(description="workload source (bundled name or file)")
    workload_digest: str = Field(description="sha256 prefix of the prompts + temperature (pipeline.resume)")
    medians: dict[str, float] = Field(default_factory=dict, description="re-measured medians, e.g. tput_tok_s")


class ServingConfig(FrozenModel):
    """What production serves. Validated whenever it is loaded: a config with secret values or a trial folder in it
    is refused with the field named."""

    replica: ReplicaConfig
    provenance: Provenance

    @model_validator(mode="after")
    def _no_values(self) -> ServingConfig:
        if self.replica.env:
            raise ValueError(f"replica.env: holds values for {sorted(self.replica.env)}; a serving config carries "
                             "secrets by reference only. Fix: move the names to replica.env_from and set the "
                             "variables in the production replica's environment")
        if self.replica.log_dir is not None:
            raise ValueError(f"replica.log_dir: {self.replica.log_dir!r} is a trial's folder. Fix: leave it null")
        return self


def serving_config(replica: ReplicaConfig, provenance: Provenance) -> ServingConfig:
    """The serving form of the replica a trial ran: env values replaced by their names, log_dir dropped."""
    names = sorted(set(replica.env_from) | set(replica.env))
    return ServingConfig(replica=replica.model_copy(update={"env": {}, "env_from": names, "log_dir": None}),
                         provenance=provenance)


def engine_argv(serving: ServingConfig, host: str = ENGINE_HOST, port: int = ENGINE_PORT) -> list[str]:
    """The engine's full command line as a user runs it: this interpreter becomes `python`, a console script beside
    it (SGLang's `sglang`) its bare name, since the user's environment has its own paths."""
    from serve.engines import engine_for

    argv = engine_for(serving.replica.engine).argv(serving.replica, host, port)
    if argv and argv[0] == sys.executable:
        argv = ["python", *argv[1:]]
    elif argv and Path(argv[0]).parent == Path(sys.executable).parent:
        argv = [Path(argv[0]).name, *argv[1:]]
    return argv


def engine_command(serving: ServingConfig, host: str = ENGINE_HOST, port: int = ENGINE_PORT) -> str:
    """`engine_argv` ready to paste into a shell; env_from names as `NAME="$NAME"` references, never values."""
    refs = " ".join(f'{name}="${name}"' for name in serving.replica.env_from)
    return (f"{refs} " if refs else "") + shlex.join(engine_argv(serving, host, port))


def serve_app(serving: ServingConfig, source_args: dict[str, str]) -> dict[str, Any]:
    """One Serve application of the production endpoint; `source_args` say where it loads the config
    (`registered_model` + `version` + `tracking_uri`, or `config_file`)."""
    return {"name": "production", "route_prefix": "/", "import_path": "serve.production:app_builder",
            "args": dict(source_args),
            "deployments": [{"name": "EngineBackend", "max_surge_percent": 100},
                            {"name": "OpenAIIngress", "max_surge_percent": 100}]}


def serve_deploy_config(serving: ServingConfig, source_args: dict[str, str], host: str = "127.0.0.1",
                        port: int = 8000) -> dict[str, Any]:
    """A Serve config file for `serve deploy` (needs a cluster started with `ray start --head`)."""
    return {"proxy_location": "HeadOnly", "http_options": {"host": host, "port": port},
            "applications": [serve_app(serving, source_args)]}


def rayservice_patch(serving: ServingConfig, source_args: dict[str, str], version_label: str) -> dict[str, Any]:
    """A KubeRay RayService patch (`kubectl patch rayservice specdec-production --type merge --patch-file ...`):
    the Serve config of this winner, and a bumped annotation so the operator redeploys."""
    config = serve_deploy_config(serving, source_args, host="0.0.0.0")
    return {"metadata": {"annotations": {"specdec.io/promotion": version_label}},
            "spec": {"serveConfigV2": yaml.safe_dump(config, sort_keys=False)}}


def deploy_files(serving: ServingConfig, source_args: dict[str, str], version_label: str) -> dict[str, str]:
    """Every deployable form, by file name (the contents hold no secret value: `serving` cannot carry one)."""
    env_note = "".join(f"#   {name} must be set in the engine's environment\n" for name in serving.replica.env_from)
    return {
        SERVING_FILE: serving.model_dump_json(indent=2),
        COMMAND_FILE: ("#!/bin/sh\n# The engine exactly as the winning trial ran it "
                       f"(study {serving.provenance.study}, {serving.provenance.source}).\n" + env_note
                       + "exec " + engine_command(serving) + "\n"),
        SERVE_CONFIG_FILE: ("# serve deploy " + SERVE_CONFIG_FILE + "   (on a cluster started with `ray start --head`)\n"
                            + yaml.safe_dump(serve_deploy_config(serving, source_args), sort_keys=False)),
        RAYSERVICE_PATCH_FILE: ("# kubectl -n specdec patch rayservice specdec-production --type merge "
                                f"--patch-file {RAYSERVICE_PATCH_FILE}\n"
                                + yaml.safe_dump(rayservice_patch(serving, source_args, version_label),
                                                 sort_keys=False)),
    }


def spec_params(serving: ServingConfig) -> dict[str, str]:
    """Flat params for the registry's Models page: the replica's fields, spec.* expanded, env values absent."""
    data = serving.replica.model_dump(mode="json", exclude={"log_dir", "env"})
    spec = data.pop("spec", {}) or {}
    params = {f"spec.{k}": v for k, v in spec.items()}
    params.update({k: v for k, v in data.items()})
    return {k: (str(v) if not isinstance(v, (list, dict)) else yaml.safe_dump(v, default_flow_style=True).strip())
            for k, v in params.items() if v is not None and v != [] and v != {}}
