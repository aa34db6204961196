"""`GET /v1/config` for a user key (issue 42 item 2): the served config without captured text or server paths. The
whole config served a candidate's shipped corpus (captured prompts and answers, once a candidate that used the
capture as its corpus was promoted) and a `--config-file`'s absolute path to any user key."""

from __future__ import annotations

import asyncio
import json

from starlette.requests import Request

from serve.closed_loop.candidate_arm import CanaryArm
from serve.closed_loop.control_routes import DriftBoard
from serve.engines.base import ReplicaConfig
from serve.production.config_view import user_view
from serve.production.settings import ProductionSettings
from serve.serving import Provenance, RoutingPolicy, ServingConfig
from tests.unit.test_production_ingress import _bare_ingress

SECRET = "my card number is 4111 1111 1111 1111"
CORPUS = {"algorithm": "ngram", "num_draft_tokens": 4, "external_corpus": "capture.jsonl"}


def shown() -> dict:
    replica = ReplicaConfig(model="/srv/models/smollm2-135m", spec=CORPUS, corpus_documents=(SECRET, "Blue."),
                            extra_flags=["--speculative-ngram-corpus-dir=/srv/corpora"])
    config = ServingConfig(replica=replica, provenance=Provenance(
        study="retune", decision="promote", source="final-0", workload="/home/ops/runs/capture/workload.parquet",
        workload_digest="0" * 16), policy=RoutingPolicy(text="two", source="x", high=replica, switch_above=4,
                                                        high_source="final-1"))
    return {**config.model_dump(mode="json"), "version": None,
            "origin": {"source": "/etc/specdec/serving_config.json", "registered_model": None, "alias": None,
                       "version": None}}


def test_a_user_sees_no_captured_text_and_no_server_path():
    original = shown()
    view = user_view(original)
    text = json.dumps(view)
    assert SECRET not in text and "/srv/" not in text and "/etc/specdec" not in text and "/home/ops" not in text
    assert view["replica"]["corpus_documents"] is None and view["policy"]["high"]["corpus_documents"] is None
    assert view["redacted"]["fields"] == ["replica.corpus_documents (2 documents)",
                                          "policy.high.corpus_documents (2 documents)"]
    # what a user may know stays: the model's name, the speculative config, file names
    assert view["replica"]["model"] == "…/smollm2-135m" and view["origin"]["source"] == "…/serving_config.json"
    assert view["replica"]["spec"]["num_draft_tokens"] == 4
    assert view["replica"]["extra_flags"] == ["--speculative-ngram-corpus-dir=…/corpora"]
    assert SECRET in json.dumps(original)  # the admin's answer is not touched


def test_names_that_are_not_paths_stay():
    view = user_view({"origin": {"source": "models:/specdec-default@production"}, "replica": {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "extra_flags": ["--tp=2", "--x", "a/b"]}})
    assert view == {"origin": {"source": "models:/specdec-default@production"}, "replica": {
        "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "extra_flags": ["--tp=2", "--x", "a/b"]}}


def _config_request(key: str | None) -> Request:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return Request({"type": "http", "method": "GET", "path": "/v1/config", "headers": headers, "query_string": b""})


def test_the_ingress_redacts_for_user_keys_and_shows_admins_everything():
    obj = _bare_ingress()
    served = shown()
    obj.serving = {"config": {k: v for k, v in served.items() if k not in ("origin", "version")},
                   "origin": served["origin"]}
    obj.policy = RoutingPolicy(text="one", source="x")
    obj.in_flight, obj.routed = 0, {"low": 0}
    obj.drift = DriftBoard(obj.metrics.registry)
    obj.canary = CanaryArm(ProductionSettings(config_file="unused.json"))
    obj.keys, obj.admin_keys = [b"user-key-0123456789abcdef"], [b"admin-key-0123456789abcdef"]
    obj.bind_host, obj.enforce = "0.0.0.0", True

    def answer(key: str) -> dict:
        response = asyncio.run(obj._guarded(_config_request(key), "/v1/config", obj._config))
        assert response.status_code == 200
        return json.loads(response.body)

    assert SECRET not in json.dumps(user := answer("user-key-0123456789abcdef"))
    assert user["origin"]["source"] == "…/serving_config.json"
    admin = answer("admin-key-0123456789abcdef")
    assert admin["replica"]["corpus_documents"] == [SECRET, "Blue."]
    assert admin["origin"]["source"] == "/etc/specdec/serving_config.json"
