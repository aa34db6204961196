"""A several-level study's vLLM deploy files without vLLM: the per-level decision read off the served policy
(`dynamic.level_table`), and the deploy folder `serve.serving.deploy_files` writes for it: each engine's bare command
exactly as measured, the K per level, and vLLM's per-batch-size table with the one-server command that carries it.
vLLM's own config classes read that command back in tests/engines/test_vllm_engine.py."""

import json
import shlex

import pytest

from serve.engines.base import ReplicaConfig
from serve.engines.vllm import deploy, flags, install
from serve.engines.vllm.dynamic import level_table
from serve.serving import HIGH, Provenance, RoutingPolicy, ServingConfig, deploy_files, served_at_levels
from serve.spec import NoSpec, VllmNgramSpec, VllmSuffixSpec


def replica(spec, **more) -> ReplicaConfig:
    return ReplicaConfig(engine="vllm", model="smollm2-135m", spec=spec, max_running_requests=8, cpus=(0, 1), **more)


LOW = replica(VllmNgramSpec(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3))


def test_k_per_level_becomes_the_table_where_the_configs_differ_in_k_only():
    found = level_table({1: LOW, 4: replica(NoSpec())})
    assert found.ks == {1: 4, 4: 0} and found.table == [[1, 3, 4], [4, 8, 0]] and found.replica == LOW
    other_k = replica(VllmNgramSpec(num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=3))
    assert level_table({1: LOW, 2: other_k, 8: replica(NoSpec())}).table == [[1, 1, 4], [2, 7, 2], [8, 8, 0]]


@pytest.mark.parametrize("served, why", [
    ({1: LOW, 4: LOW}, "K 4 at every level"),
    ({1: replica(NoSpec()), 4: replica(NoSpec())}, "baseline is served at every level"),
    ({1: LOW, 4: replica(VllmNgramSpec(num_speculative_tokens=2))}, "differ in more than K"),
    ({1: LOW, 4: replica(NoSpec(), dtype="bfloat16")}, "differ in more than the spec"),
    ({1: replica(VllmSuffixSpec(num_speculative_tokens=8)), 4: replica(NoSpec())}, "suffix proposer asserts"),
])
def test_no_table_where_one_server_cannot_say_what_was_measured(served, why):
    found = level_table(served)
    assert found.table is None and why in found.reason


def two_level(low: ReplicaConfig, high: ReplicaConfig) -> ServingConfig:
    policy = RoutingPolicy(text="serve 'ngram' up to concurrency 1; speculation off above 1", levels=[1, 4],
                           winners={"1": "ngram", "4": "baseline"}, source="ngram", switch_above=1, high=high,
                           high_source="baseline")
    provenance = Provenance(study="s", decision="promote", source="ngram", workload="templated", workload_digest="0")
    return ServingConfig(replica=low, provenance=provenance, policy=policy)


@pytest.fixture
def files(monkeypatch):
    monkeypatch.setattr("serve.engines.vllm.adapter.model_folder", lambda model: f"/models/{model}")
    monkeypatch.setattr(install, "venv_python", lambda: None)
    monkeypatch.setenv(install.VENV_ENV, "/venv")
    return deploy_files(two_level(LOW, replica(NoSpec())), {"config_file": "/x.json"}, "promote")


def exec_argv(script: str) -> list[str]:
    (line,) = [line for line in script.splitlines() if line.startswith("exec ")]
    return shlex.split(line)[1:]


def measured_argv(config: ReplicaConfig, port: int) -> list[str]:
    return [*flags.server_argv("/venv/bin/python", "/models/smollm2-135m", "smollm2-135m", "float32", config.spec, 8,
                               []), "--host", "127.0.0.1", "--port", str(port)]


def test_each_engines_command_is_exactly_what_its_trial_ran(files):
    assert exec_argv(files[deploy.VLLM_COMMAND_FILE]) == measured_argv(LOW, 30000)
    assert exec_argv(files[deploy.HIGH_COMMAND_FILE]) == measured_argv(replica(NoSpec()), 30001)
    assert "more than 1 requests in flight" in files[deploy.HIGH_COMMAND_FILE]


def test_the_table_travels_in_the_deploy_folder_with_its_one_server_command(files):
    table = json.loads(files[deploy.TABLE_FILE])
    assert table["k_per_level"] == {"1": 4, "4": 0}
    assert table["num_speculative_tokens_per_batch_size"] == [[1, 3, 4], [4, 8, 0]]
    argv = exec_argv(files[deploy.TABLE_COMMAND_FILE])
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3,
                      "num_speculative_tokens_per_batch_size": [[1, 3, 4], [4, 8, 0]]}
    # every other flag is the measured low engine's
    assert [a for a in argv if a != argv[argv.index("--speculative-config") + 1]] == [
        a for a in measured_argv(LOW, 30000) if not a.startswith("{")]
    assert "NOT measured as one server" in files[deploy.TABLE_COMMAND_FILE]


def test_the_policy_routes_each_level_to_its_engine():
    serving = two_level(LOW, replica(NoSpec()))
    assert serving.policy is not None and serving.policy.route(4) == HIGH
    assert served_at_levels(serving) == {1: LOW, 4: replica(NoSpec())}


def test_a_single_level_study_gets_no_table(monkeypatch):
    monkeypatch.setattr("serve.engines.vllm.adapter.model_folder", lambda model: f"/models/{model}")
    monkeypatch.setenv(install.VENV_ENV, "/venv")
    provenance = Provenance(study="s", decision="promote", source="ngram", workload="templated", workload_digest="0")
    one = ServingConfig(replica=LOW, provenance=provenance, policy=RoutingPolicy(text="t", levels=[1], source="ngram"))
    files = deploy_files(one, {"config_file": "/x.json"}, "promote")
    assert deploy.VLLM_COMMAND_FILE in files and deploy.TABLE_FILE not in files and deploy.HIGH_COMMAND_FILE not in files
