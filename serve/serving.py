"""The serving config: exactly the replica a winning trial measured, plus where it came from.

One typed object (`ServingConfig`) travels from the end of a study (pipeline/study/finalize.py) through the registry
(pipeline/records/registry.py) to the production endpoint (serve/production.py) and its `/v1/config` (serve/production/ingress.py). Its
`replica` is the `ReplicaConfig` the trial's replica ran, built by the same function (`pipeline.trial.lifecycle.replica_config`),
so tp_size, extra_flags, start_timeout_s and the engine environment reach production unchanged. What differs:
`log_dir` (a trial folder) is dropped, and secrets travel as references: every `env` name moves to `env_from`, and
the engine reads its value from the production replica's own environment (`Engine.start_env`). An NGRAM external
corpus travels as its documents (`ReplicaConfig.corpus_documents`), with `spec.external_corpus` reduced to the file
name the production replica writes them to on its own node; the deploy files add that file beside the engine command.

The deployable forms of a serving config (engine command line, Serve config file, KubeRay patch) are rendered here too,
so the files a user deploys and the config production loads cannot disagree.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, SerializerFunctionWrapHandler, model_serializer, model_validator

from serve.engines.base import ReplicaConfig, corpus_file_name, corpus_jsonl
from serve.spec import FrozenModel

COMMAND_FILE = "engine_command.sh"
SERVE_CONFIG_FILE = "serve_config.yaml"
RAYSERVICE_PATCH_FILE = "rayservice_patch.yaml"
SERVING_FILE = "serving_config.json"
HIGH_COMMAND_FILE = "engine_command_high.sh"
# The engine has no auth (neither ours nor SGLang without --api-key): the exported command binds this machine only.
# docs/security.md says how to put it behind the production endpoint or an authenticating proxy.
ENGINE_HOST, ENGINE_PORT = "127.0.0.1", 30000
BIND_NOTE = ("# Binds 127.0.0.1: the engine has no auth. Serve it to others through the production endpoint\n"
             "# (python -m serve.production, which runs this engine itself) or an authenticating reverse proxy\n"
             "# (docs/security.md); do not change --host to 0.0.0.0.\n")


class Provenance(FrozenModel):
    """Where a serving config comes from: the study, the decision, the measured run, the workload it was measured on."""

    study: str
    decision: str = Field(description="promote | keep_baseline | ...")
    source: str = Field(description="'baseline' or the finalist id that won")
    trial_run_id: str | None = Field(None, description="MLflow run id of the trial that measured this config")
    workload: str = Field(description="workload source (bundled name or file)")
    workload_digest: str = Field(description="sha256 prefix of the prompts + temperature (pipeline.study.resume)")
    medians: dict[str, float] = Field(default_factory=dict, description="re-measured medians, e.g. tput_tok_s")
    engine: str | None = Field(None, description="the engine kind and version it was tuned on, e.g. 'sglang 0.5.2'")
    hardware: str | None = Field(None, description="the node it was measured on: GPUs (count x name), CPU model "
                                                   "and count")
    measurement: str | None = Field(None, description="clean | partly-disturbed | disturbed: whether other work "
                                                      "disturbed the re-runs it was decided on (disturbed: every "
                                                      "one, a provisional decision)")


LOW, HIGH = "low", "high"  # the two engines of a two-config policy, as the ingress names its routes
ENGINE_DEPLOYMENTS = {LOW: "EngineBackend", HIGH: "EngineBackendHigh"}  # Serve deployment names per route


class RoutingPolicy(FrozenModel):
    """The per-concurrency answer in the form production serves (`pipeline.decide.levels.ServingPolicy` resolved to
    engines): the ServingConfig's `replica` while at most `switch_above` requests are in flight at the ingress,
    `high` (the baseline when the policy says "speculation off above N", else the second config) above that.
    `switch_above` None = one config at every level (a single-level study, or one config that wins everywhere)."""

    text: str = Field(description="the decided policy in words")
    levels: list[int] = Field(default_factory=list, description="concurrency levels the decision measured")
    winners: dict[str, str] = Field(default_factory=dict, description="winner per level ('baseline' or a finalist)")
    source: str = Field(description="'baseline' or the finalist id `replica` is")
    switch_above: int | None = Field(None, ge=1, description="more requests in flight than this go to `high`")
    high: ReplicaConfig | None = Field(None, description="the engine served above `switch_above`")
    high_source: str | None = Field(None, description="'baseline' or the finalist id `high` is")

    @model_validator(mode="after")
    def _both_or_neither(self) -> RoutingPolicy:
        if (self.switch_above is None) != (self.high is None) or (self.high is None) != (self.high_source is None):
            raise ValueError(f"policy: switch_above={self.switch_above}, high {'set' if self.high else 'unset'}, "
                             f"high_source={self.high_source!r}: give all three (two configs) or none (one config)")
        return self

    def route(self, in_flight: int) -> str:
        """LOW or HIGH for a request that makes `in_flight` requests in flight (itself included). Pure."""
        return HIGH if self.switch_above is not None and in_flight > self.switch_above else LOW


class ServingConfig(FrozenModel):
    """What production serves. Validated whenever it is loaded: a config with secret values or a trial folder in it
    is refused with the field named. `policy` None (a config registered before per-level decisions) serves
    `replica` at every level, as a one-config policy does."""

    replica: ReplicaConfig
    provenance: Provenance
    policy: RoutingPolicy | None = None

    @model_validator(mode="after")
    def _no_values(self) -> ServingConfig:
        replicas = [("replica", self.replica)]
        if self.policy is not None and self.policy.high is not None:
            replicas.append(("policy.high", self.policy.high))
        for where, replica in replicas:
            if replica.env:
                raise ValueError(f"{where}.env: holds values for {sorted(replica.env)}; a serving config carries "
                                 f"secrets by reference only. Fix: move the names to {where}.env_from and set the "
                                 "variables in the production replica's environment")
            if replica.log_dir is not None:
                raise ValueError(f"{where}.log_dir: {replica.log_dir!r} is a trial's folder. Fix: leave it null")
        return self

    @model_serializer(mode="wrap")
    def _omit_no_policy(self, handler: SerializerFunctionWrapHandler) -> Any:
        # A config without a policy dumps as it did before policies existed: registered versions, deploy files and
        # `/v1/config` of such a config stay byte-for-byte what they were.
        data = handler(self)
        if self.policy is None and isinstance(data, dict):
            data.pop("policy", None)
        return data

    def replicas(self) -> dict[str, ReplicaConfig]:
        """The engines production runs, by route: LOW always, HIGH for a two-config policy."""
        high = self.policy.high if self.policy is not None else None
        return {LOW: self.replica, **({HIGH: high} if high is not None else {})}


def serving_replica(replica: ReplicaConfig) -> ReplicaConfig:
    """The serving form of the replica a trial ran: env values replaced by their names, log_dir dropped, a shipped
    corpus's path (in the trial's folder) reduced to its file name (each replica writes the documents on its node)."""
    names = sorted(set(replica.env_from) | set(replica.env))
    update: dict[str, Any] = {"env": {}, "env_from": names, "log_dir": None}
    corpus = getattr(replica.spec, "external_corpus", None)
    if replica.corpus_documents is not None and corpus is not None:
        update["spec"] = replica.spec.model_copy(update={"external_corpus": corpus_file_name(corpus)})
    return replica.model_copy(update=update)


def serving_config(replica: ReplicaConfig, provenance: Provenance,
                   policy: RoutingPolicy | None = None) -> ServingConfig:
    """The serving form of the replica a trial ran (`serving_replica`), with the policy's second engine likewise."""
    if policy is not None and policy.high is not None:
        policy = policy.model_copy(update={"high": serving_replica(policy.high)})
    return ServingConfig(replica=serving_replica(replica), provenance=provenance, policy=policy)


def engine_argv(serving: ServingConfig, host: str = ENGINE_HOST, port: int = ENGINE_PORT) -> list[str]:
    """The engine's full command line as a user runs it: this interpreter becomes `python`, a console script beside
    it (SGLang's `sglang`) its bare name, since the user's environment has its own paths."""
    from serve.engines import engine_for

    argv = engine_for(serving.replica.engine).command_argv(serving.replica, host, port)
    if argv and argv[0] == sys.executable:
        argv = ["python", *argv[1:]]
    elif argv and Path(argv[0]).parent == Path(sys.executable).parent:
        argv = [Path(argv[0]).name, *argv[1:]]
    return argv


SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def shell_name(name: str) -> str:
    """`name` if a shell can set and expand it; a ValueError otherwise. A serving config may come from anywhere
    (a registry, a file), so the writer refuses what the study's own validation would have refused at load: a name
    is the one part of `NAME="$NAME"` that cannot be quoted."""
    if not SHELL_NAME.fullmatch(name):
        raise ValueError(f"env_from: {name!r} is not a shell variable name ([A-Za-z_][A-Za-z0-9_]*); the deploy "
                         "script cannot reference it. Fix: rename the variable in the study's engine.env")
    return name


def comment(text: str) -> str:
    """`text` as the rest of one comment line: a newline in it would end the comment and start a command."""
    return " ".join(str(text).splitlines())


def env_refs(serving: ServingConfig) -> str:
    """The env_from names as `NAME="$NAME" ` references (values never), each name checked by `shell_name`."""
    return "".join(f'{shell_name(name)}="${name}" ' for name in serving.replica.env_from)


def engine_command(serving: ServingConfig, host: str = ENGINE_HOST, port: int = ENGINE_PORT) -> str:
    """`engine_argv` ready to paste into a shell; env_from names as `NAME="$NAME"` references, never values."""
    return env_refs(serving) + shlex.join(engine_argv(serving, host, port))


def exec_line(serving: ServingConfig, port: int = ENGINE_PORT) -> str:
    """`engine_command` as a script's last line. The references go before `exec`: after it, the shell takes the
    first one for the program's name ("exec: NAME=...: not found")."""
    return env_refs(serving) + "exec " + shlex.join(engine_argv(serving, ENGINE_HOST, port)) + "\n"


def serve_app(serving: ServingConfig, source_args: dict[str, str]) -> dict[str, Any]:
    """One Serve application of the production endpoint; `source_args` say where it loads the config
    (`registered_model` + `version` + `tracking_uri`, or `config_file`)."""
    # Serve refuses overrides for a deployment the app lacks: the second engine is listed only when there is one.
    engines = {ENGINE_DEPLOYMENTS[route]: replica for route, replica in serving.replicas().items()}
    return {"name": "production", "route_prefix": "/", "import_path": "serve.production.app:app_builder",
            "args": dict(source_args),
            "deployments": [*({"name": name, "max_surge_percent": export_surge_percent(replica)}
                              for name, replica in engines.items()),
                            {"name": "OpenAIIngress", "max_surge_percent": 100}]}


def export_surge_percent(replica: ReplicaConfig) -> int:
    """How a deploy file's engine deployment rolls: beside the old copy (100) for an engine without GPUs, stop then
    start (0) for one that holds GPUs. `python -m serve.production` surges only where a second copy fits the nodes'
    free resources now (`serve.production.roll.plan_roll`); a file cannot see them, and a second copy of a whole-node
    engine (tp 8 on an 8-GPU node) would never be placed, so the roll would never end."""
    from serve.replica.placement import actor_options

    return 0 if float(actor_options(replica).get("num_gpus") or 0) > 0 else 100


def serve_deploy_config(serving: ServingConfig, source_args: dict[str, str], host: str = "127.0.0.1",
                        port: int = 8000) -> dict[str, Any]:
    """A Serve config file for `serve deploy` (needs a cluster started with `ray start --head`)."""
    return {"proxy_location": "HeadOnly", "http_options": {"host": host, "port": port},
            "applications": [serve_app(serving, source_args)]}


# The RayService of infra/kuberay/rayservice.yaml mounts this secret's `api-keys` on every Ray pod at this file.
API_KEY_SECRET, API_KEY_FILE = "specdec-api-keys", "/etc/specdec/api-keys"


def rayservice_patch(serving: ServingConfig, source_args: dict[str, str], version_label: str) -> dict[str, Any]:
    """A KubeRay RayService patch (`kubectl patch rayservice specdec-production --type merge --patch-file ...`):
    the Serve config of this winner (binding 0.0.0.0, so the ingress requires the API keys of the secret
    `API_KEY_SECRET`, mounted at `API_KEY_FILE`), the provenance as annotations, and a bumped annotation so the
    operator redeploys."""
    config = serve_deploy_config(serving, {**source_args, "api_key_file": API_KEY_FILE}, host="0.0.0.0")
    return {"metadata": {"annotations": {"specdec.io/promotion": version_label, **provenance_annotations(serving)}},
            "spec": {"serveConfigV2": yaml.safe_dump(config, sort_keys=False)}}


def provenance_annotations(serving: ServingConfig) -> dict[str, str]:
    """What the config was tuned on, as Kubernetes annotations (`specdec.io/engine`, `.../hardware`,
    `.../measurement`); only those known."""
    prov = serving.provenance
    found = {"engine": prov.engine, "hardware": prov.hardware, "measurement": prov.measurement}
    return {f"specdec.io/{key}": comment(value) for key, value in found.items() if value}


def provenance_note(serving: ServingConfig) -> str:
    """`# Tuned on: sglang 0.5.2; 1 x NVIDIA H100 80GB HBM3, ...` (and the measurement when it was disturbed), as
    comment lines; "" when nothing is known."""
    prov = serving.provenance
    known = [value for value in (prov.engine, prov.hardware) if value]
    note = f"# Tuned on: {comment('; '.join(known))}\n" if known else ""
    if prov.measurement and prov.measurement != "clean":
        note += (f"# Measurement: {prov.measurement} (other work held the CPU during the deciding re-runs"
                 + ("; a provisional decision" if prov.measurement == "disturbed" else "") + ")\n")
    return note


class BlockDumper(yaml.SafeDumper):
    """YAML with multi-line strings as literal blocks (`|`): the RayService's embedded Serve config stays readable
    YAML instead of one escaped line."""


def _block(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


BlockDumper.add_representer(str, _block)


def file_mode(name: str) -> int:
    """A deploy file's mode: a script runs as written (0755), the rest stays private to the owner (0600)."""
    return 0o755 if name.endswith(".sh") else 0o600


def write_deploy_folder(folder: Path, files: dict[str, str]) -> list[Path]:
    """Write `deploy_files` into `folder`, each whole or not at all (beside it, then renamed) and with its
    `file_mode`; returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, text in files.items():
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            os.chmod(tmp, file_mode(name))
            os.replace(tmp, folder / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        out.append(folder / name)
    return out


def corpus_files(serving: ServingConfig) -> dict[str, str]:
    """The shipped corpora of the served engines as deploy files (name -> JSONL): the engine command names them by
    file name, so they lie beside it."""
    return {corpus_file_name(str(getattr(r.spec, "external_corpus", ""))): corpus_jsonl(r.corpus_documents).decode()
            for r in serving.replicas().values() if r.corpus_documents is not None}


def _corpus_cd(replica: ReplicaConfig) -> str:
    # The command names a shipped corpus (and a tuned adaptive config) by its bare file name: run it from the folder
    # that holds the file.
    named = [what for what, there in (("corpus file", replica.corpus_documents is not None),
                                      ("adaptive config", bool(getattr(replica.spec, "adaptive_steps", None))))
             if there]
    verb = "lies" if len(named) == 1 else "lie"
    return f'cd "$(dirname "$0")"  # the {" and the ".join(named)} the command names {verb} beside this script\n' \
        if named else ""


def deploy_files(serving: ServingConfig, source_args: dict[str, str], version_label: str,
                 cluster_args: dict[str, str] | None = None) -> dict[str, str]:
    """Every deployable form, by file name (the contents hold no secret value: `serving` cannot carry one), plus the
    shipped corpus file(s) the engine commands name. `source_args`: where `serve_config.yaml`'s endpoint loads the
    config (this machine's view); `cluster_args`: where the RayService's does (a tracking URI its pods reach), None
    when the study knows none: the patch then says what to set."""
    env_note = "".join(f"#   {shell_name(name)} must be set in the engine's environment\n"
                       for name in serving.replica.env_from)
    policy = serving.policy
    policy_note = f"# Serving policy: {comment(policy.text)}\n" if policy is not None else ""
    tuned = provenance_note(serving)
    files = {
        SERVING_FILE: serving.model_dump_json(indent=2),
        COMMAND_FILE: ("#!/bin/sh\n# The engine exactly as the winning trial ran it "
                       f"(study {comment(serving.provenance.study)}, {comment(serving.provenance.source)}).\n"
                       + tuned + policy_note + env_note
                       + BIND_NOTE + _corpus_cd(serving.replica) + exec_line(serving)),
        SERVE_CONFIG_FILE: ("# serve deploy " + SERVE_CONFIG_FILE + "   (on a cluster started with `ray start --head`)\n"
                            + tuned + yaml.safe_dump(serve_deploy_config(serving, source_args), sort_keys=False)),
        RAYSERVICE_PATCH_FILE: rayservice_file(serving, source_args, cluster_args, version_label, tuned),
    }
    if policy is not None and policy.high is not None:
        # The high-concurrency engine of a two-config policy: run both and send a request to this one when more
        # than `switch_above` are in flight (what the production endpoint's ingress does).
        high = serving.model_copy(update={"replica": policy.high})
        files[HIGH_COMMAND_FILE] = (f"#!/bin/sh\n# The engine above {policy.switch_above} requests in flight "
                                    f"({comment(policy.high_source or '')}). {policy_note[2:]}" + BIND_NOTE
                                    + _corpus_cd(policy.high)
                                    + exec_line(high, port=ENGINE_PORT + 1))
    from serve.engines import engine_for

    # An engine that runs without our wrapper adds its bare command too (llama.cpp: llama_server_command.sh).
    engine = engine_for(serving.replica.engine)
    files.update(engine.native_deploy_files(serving.replica, ENGINE_HOST, ENGINE_PORT))
    if policy is not None and len(policy.levels) > 1:  # and, for several levels, its form of the per-level policy
        files.update(engine.level_deploy_files(served_at_levels(serving), ENGINE_HOST, ENGINE_PORT))
    files.update(corpus_files(serving))
    return files


def served_at_levels(serving: ServingConfig) -> dict[int, ReplicaConfig]:
    """The replica the policy serves at each measured level (its route for that many requests in flight). Pure."""
    replicas = serving.replicas()
    policy = serving.policy
    return {level: replicas[policy.route(level)] for level in policy.levels} if policy is not None else {}


def rayservice_file(serving: ServingConfig, source_args: dict[str, str], cluster_args: dict[str, str] | None,
                    version_label: str, tuned: str) -> str:
    """`RAYSERVICE_PATCH_FILE`'s text: how to apply it, what it was tuned on, the API-key secret it needs, and the
    image to run (the RayService's own: a merge patch would replace its containers list whole)."""
    args = dict(cluster_args if cluster_args is not None else source_args)
    head = (f"# kubectl -n specdec patch rayservice specdec-production --type merge --patch-file "
            f"{RAYSERVICE_PATCH_FILE}\n" + tuned
            + f"# API keys: the Kubernetes secret {API_KEY_SECRET} (key api-keys), mounted at {API_KEY_FILE} on every "
              "Ray pod by infra/kuberay/rayservice.yaml:\n"
              f"#   kubectl -n specdec create secret generic {API_KEY_SECRET} --from-file=api-keys=./api-keys.txt\n"
            + "# Image: the RayService's own (this patch leaves its pods as they are); it must hold specdec-tuner"
            + (f" and {comment(serving.provenance.engine)}" if serving.provenance.engine else "") + ".\n")
    if cluster_args is None:
        head += ("# tracking_uri below is this study's own store, which no pod reaches (a file on the machine that "
                 "ran it): set it to the MLflow server your cluster reaches, or run the study with "
                 "tracking.deploy_uri set.\n")
    return head + yaml.dump(rayservice_patch(serving, args, version_label), Dumper=BlockDumper, sort_keys=False)


def spec_params(serving: ServingConfig) -> dict[str, str]:
    """Flat params for the registry's Models page: the replica's fields, spec.* expanded, env values absent."""
    data = serving.replica.model_dump(mode="json", exclude={"log_dir", "env", "corpus_documents"})
    spec = data.pop("spec", {}) or {}
    params = {f"spec.{k}": v for k, v in spec.items()}
    params.update({k: v for k, v in data.items()})
    if serving.replica.corpus_documents is not None:  # the documents are in the registered config; a param is short
        params["corpus_documents"] = len(serving.replica.corpus_documents)
    return {k: (str(v) if not isinstance(v, (list, dict)) else yaml.safe_dump(v, default_flow_style=True).strip())
            for k, v in params.items() if v is not None and v != [] and v != {}}
