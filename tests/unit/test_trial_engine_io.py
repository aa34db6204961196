"""What a trial does around the engine that SGLang makes tricky: a refused `/flush_cache` (SGLang answers 400 while
any request runs, and Serve's health check runs one), per-study app names on a shared cluster, and secrets in
`engine.env`. The flush is tested against a real local HTTP server that refuses as SGLang does."""

import json
from typing import Any

import httpx
import pytest

from pipeline.config import load_study, study_to_yaml
from pipeline.trial.replicas import app_name, study_apps
from pipeline.trial.engine_pass import flush
from pipeline.trial.replica_config import replica_config
from pipeline.config import TrialConfig
from tests.local_http import local_server

SGLANG_REFUSAL = "Cache not flushed because there are pending requests. #queue-req: 0, #running-req: 1"


@pytest.fixture
def refusing_server():
    """A server whose /flush_cache refuses `refusals[0]` times (400, SGLang's text), then succeeds."""
    state: dict[str, Any] = {"refusals": 0, "calls": []}

    def answer(method: str, path: str) -> tuple[int, bytes]:
        state["calls"].append(path)
        refused = state["refusals"] > 0
        state["refusals"] -= 1
        return (400, SGLANG_REFUSAL.encode()) if refused else (200, b"Cache flushed.")

    with local_server(answer) as url:
        yield url, state


def test_a_refused_flush_is_retried_with_a_wait_for_idle(refusing_server):
    url, state = refusing_server
    state["refusals"] = 2
    with httpx.Client(base_url=url) as client:
        assert flush(client, deadline_s=60) is None
    assert len(state["calls"]) == 3 and all("timeout=" in c for c in state["calls"])


def test_a_flush_that_never_succeeds_is_reported_with_the_engines_answer(refusing_server):
    url, state = refusing_server
    state["refusals"] = 10**6
    with httpx.Client(base_url=url) as client:
        refused = flush(client, deadline_s=0)
    assert refused is not None and "refused" in refused and "400" in refused and "pending requests" in refused


def test_app_names_are_per_study_and_cleanup_touches_only_its_own():
    assert app_name("a", "x1") == "a~trial-x1"
    names = ["a~trial-x1", "a-b~trial-x2", "other~trial-x3", "production", "trial-legacy"]
    assert study_apps("a", names) == ["a~trial-x1"]
    assert study_apps("a-b", names) == ["a-b~trial-x2"]


def test_the_next_trial_restarts_in_the_live_replica_only_when_the_actor_would_be_the_same():
    from pipeline.trial.replicas import LiveApp, can_reuse

    options = {"num_cpus": 0.1, "num_gpus": 0, "resources": {}}
    live = LiveApp("a~trial-x1", "http://127.0.0.1:8000", options)
    assert can_reuse(live, "http://127.0.0.1:8000", dict(options))
    assert not can_reuse(None, "http://127.0.0.1:8000", options)  # nothing deployed yet in this process
    assert not can_reuse(live, "http://127.0.0.1:8001", options)  # another Serve (a new local Ray)
    assert not can_reuse(live, "http://127.0.0.1:8000", {**options, "num_cpus": 0.2})  # resources are the actor's
    assert not can_reuse(live, "http://127.0.0.1:8000", {**options, "resources": {"engine_node": 1}})  # placement


def test_engine_env_values_never_leave_in_logged_or_written_forms(tmp_path):
    study = load_study(None, {"engine.env": {"HF_TOKEN": "hf_s3cret_value"}})
    assert "hf_s3cret_value" not in study_to_yaml(study)
    assert "hf_s3cret_value" not in json.dumps(study.model_dump(mode="json"))
    replica = replica_config(study, TrialConfig(), tmp_path)
    assert "hf_s3cret_value" not in replica.model_dump_json()
    assert replica.env == {"HF_TOKEN": "hf_s3cret_value"}  # the process still gets it
    assert replica.to_replica()["env"] == {"HF_TOKEN": "hf_s3cret_value"}  # handed to the replica only
    assert "HF_TOKEN" in study_to_yaml(study)  # the name is recorded


def test_a_replica_no_node_can_host_fails_fast_with_what_is_missing():
    from serve.replica.placement import unplaceable

    cpu_only = [{"CPU": 2.0, "memory": 1e9}]
    problem = unplaceable({"num_cpus": 2.0, "num_gpus": 1, "resources": {}}, cpu_only)
    assert problem is not None and "GPU=1" in problem and "CPU=2" in problem and "engine.kind: cpu" in problem
    assert unplaceable({"num_cpus": 0.1, "num_gpus": 0, "resources": {}}, cpu_only) is None
    # All requirements on ONE node: a GPU on one node and the custom resource on another is not enough.
    split = [{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "specdec_engine": 1.0}]
    assert unplaceable({"num_cpus": 1, "num_gpus": 1, "resources": {"specdec_engine": 1}}, split)
    assert unplaceable({"num_cpus": 1, "num_gpus": 1, "resources": {"specdec_engine": 1}},
                       split + [{"CPU": 4.0, "GPU": 2.0, "specdec_engine": 1.0}]) is None
