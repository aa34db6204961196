"""Issue #20: production serves exactly the replica a trial measured (tp_size, extra_flags, env, start_timeout_s),
secrets travel as variable names, and the deployable forms of the winner hold no secret value."""

from __future__ import annotations

import json
import shlex

import pytest
import yaml
from pydantic import ValidationError

from pipeline.config import TrialConfig, load_study
from pipeline.trial.replica_config import replica_config
from serve.engines.base import ReplicaConfig
from serve.production.app import replica_config as production_replica
from serve.serving import (COMMAND_FILE, RAYSERVICE_PATCH_FILE, SERVE_CONFIG_FILE, SERVING_FILE, Provenance,
                           ServingConfig, deploy_files, engine_argv, engine_command, serving_config, spec_params)
from serve.spec import NgramSpec

SECRET = "hf_s3cret_value_0123456789"


def provenance() -> Provenance:
    return Provenance(study="big", decision="promote", source="final-0-trial-3", trial_run_id="abc",
                      workload="templated", workload_digest="0123456789abcdef", medians={"tput_tok_s": 99.0})


@pytest.fixture()
def winner(tmp_path) -> tuple[ServingConfig, ReplicaConfig]:
    study = load_study(None, {"engine.kind": "sglang", "engine.device": "cuda", "model.target": str(tmp_path),
                              "engine.tp_size": 4,
                              "engine.extra_flags": ["--mem-fraction-static", "0.85"],
                              "engine.env": {"HF_TOKEN": SECRET}, "engine.start_timeout_s": 1200})
    trial = TrialConfig(spec=NgramSpec(num_draft_tokens=8), max_running_requests=16)
    measured = replica_config(study, trial, tmp_path / "trials" / "3")
    return serving_config(measured, provenance()), measured


def test_the_served_replica_is_the_measured_one_with_secrets_as_references(winner):
    serving, measured = winner
    assert serving.replica.model_dump(exclude={"env", "env_from", "log_dir"}) == \
        measured.model_dump(exclude={"env", "env_from", "log_dir"})
    assert (serving.replica.tp_size, serving.replica.start_timeout_s) == (4, 1200)
    assert serving.replica.env == {} and serving.replica.env_from == ["HF_TOKEN"] and serving.replica.log_dir is None
    # Production rebuilds the same replica from the logged form (nothing dropped on the way).
    served = production_replica({"config": json.loads(serving.model_dump_json())})
    assert served == serving.replica


def test_the_engine_command_line_carries_tp_and_the_extra_flags(winner):
    serving, _ = winner
    argv = engine_argv(serving)
    assert argv[argv.index("--tp-size") + 1] == "4"
    assert argv[argv.index("--mem-fraction-static") + 1] == "0.85"
    assert "--speculative-algorithm" in argv
    command = engine_command(serving)
    assert command.startswith('HF_TOKEN="$HF_TOKEN" ') and shlex.split(command)[1:] == argv


def test_no_logged_or_written_form_holds_the_secret(winner):
    serving, measured = winner
    assert measured.to_replica()["env"] == {"HF_TOKEN": SECRET}  # the trial's own replica still had it
    files = deploy_files(serving, {"registered_model": "specdec-big", "version": "3",
                                   "tracking_uri": "http://mlflow:5000"}, "3")
    forms = [serving.model_dump_json(),
             json.dumps(serving.replica.to_replica()), json.dumps(spec_params(serving)), *files.values()]
    assert all(SECRET not in text for text in forms)
    assert set(files) == {SERVING_FILE, COMMAND_FILE, SERVE_CONFIG_FILE, RAYSERVICE_PATCH_FILE}
    assert ServingConfig.model_validate_json(files[SERVING_FILE]) == serving
    serve_config = yaml.safe_load(files[SERVE_CONFIG_FILE])
    assert serve_config["applications"][0]["args"] == {"registered_model": "specdec-big", "version": "3",
                                                        "tracking_uri": "http://mlflow:5000"}
    patch = yaml.safe_load(files[RAYSERVICE_PATCH_FILE])
    # the same app, binding 0.0.0.0 in the cluster: it requires the API keys the secret mounts
    (embedded,) = yaml.safe_load(patch["spec"]["serveConfigV2"])["applications"]
    assert embedded == {**serve_config["applications"][0], "args": {**serve_config["applications"][0]["args"],
                                                                     "api_key_file": "/etc/specdec/api-keys"}}


def test_a_serving_config_with_a_secret_value_is_refused_naming_the_field(winner):
    _, measured = winner
    with pytest.raises(ValidationError, match="replica.env: holds values for \\['HF_TOKEN'\\].*env_from"):
        ServingConfig(replica=measured.model_copy(update={"log_dir": None}), provenance=provenance())


def test_the_engine_reads_referenced_secrets_from_its_own_environment(winner, monkeypatch):
    from serve.engines import engine_for

    serving, _ = winner
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(RuntimeError, match=r"env_from: variable\(s\) \['HF_TOKEN'\] are not set"):
        engine_for("cpu").start_env(serving.replica)
    monkeypatch.setenv("HF_TOKEN", SECRET)
    assert engine_for("cpu").start_env(serving.replica)["HF_TOKEN"] == SECRET
