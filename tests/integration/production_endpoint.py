"""The production endpoint the endpoint tests share: two registered serving configs (version 1 = baseline, version 2
= NGRAM) in MLflow on SQLite, alias `production` on version 1, served with auth, admin keys and the capture on; one
endpoint per test module that asks for the `endpoint` fixture."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from pipeline.records.tracking import Tracker
from pipeline.records.registry import register_config, set_production
from pipeline.study.driver import connect_ray
from serve.closed_loop.capture import CaptureSettings
from serve.engines.base import ReplicaConfig
from serve.production.settings import ProductionSettings
from serve.production.app import deploy
from serve.serving import Provenance, ServingConfig

KEY = "test-key-0123456789abcdef"  # >= MIN_KEY_CHARS: short keys are refused at start
ADMIN = "admin-key-0123456789abcdef"
MODEL = "smollm2-135m"
BASELINE = {"algorithm": "none"}
NGRAM = {"algorithm": "ngram", "num_draft_tokens": 4, "max_bfs_breadth": 2, "min_bfs_breadth": 1, "match_type": "BFS",
         "max_trie_depth": 8, "capacity": 100000}


def serving(spec: dict, decision: str) -> ServingConfig:
    """What finalize registers: the replica a trial ran (start_timeout_s and max_running_requests not the defaults,
    so a production that rebuilt the replica by hand would show) plus provenance."""
    replica = ReplicaConfig(model=MODEL, spec=spec, max_running_requests=4, start_timeout_s=420.0)
    return ServingConfig(replica=replica, provenance=Provenance(
        study="prod", decision=decision, source="baseline" if decision == "keep_baseline" else "final-0",
        workload="templated", workload_digest="0123456789abcdef", medians={"tput_tok_s": 1.0}))


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prod")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    tracker = Tracker(uri, "prod-test", artifact_dir=tmp / "artifacts")
    run = tracker.client().create_run(tracker.experiment_id(), run_name="study-prod")
    for trial, decision in ((BASELINE, "keep_baseline"), (NGRAM, "promote")):
        register_config(tracker, run.info.run_id, "specdec-prod", serving(trial, decision), move_production=True)
    set_production(tracker, "specdec-prod", "1")
    keys = tmp / "keys.txt"
    keys.write_text(KEY + "\n")
    (tmp / "admin.txt").write_text(ADMIN + "\n")
    base_url = connect_ray("production-test")
    settings = ProductionSettings(registered_model="specdec-prod", tracking_uri=uri, require_auth=True,
                                  api_key_file=str(keys), admin_key_file=str(tmp / "admin.txt"),
                                  max_request_bytes=65536, max_tokens_limit=64,
                                  capture=CaptureSettings(dir=str(tmp / "capture"), sample_rate=1, flush_rows=1))
    deploy(settings)
    yield base_url, settings, tracker
    from ray import serve

    serve.delete(settings.app_name)


AUTH = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}


def client(base_url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=120)


def capture_rows(folder: Path, wanted: int) -> list[dict]:
    import pyarrow.parquet as pq

    deadline = time.monotonic() + 60  # parts are written off the request path
    while True:
        rows = [r for p in sorted(folder.glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
        if len(rows) >= wanted or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)  # polling a condition under a deadline
