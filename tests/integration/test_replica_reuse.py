"""A trial process keeps its Serve app: the next trial restarts only the engine inside the same replica actor
(pipeline/trial/replicas.py). The study's first trial takes the standby replica the driver deployed, and only one claimant
gets it. A failed start leaves its log readable, and the next trial then gets a fresh app; a trial that needs other
actor options gets a fresh app too. A start reports its phases; a config whose engine settings equal the running
engine's shares its launch (the corpus swapped over SGLang's runtime routes), unless a fresh launch is asked for.
An unset thread count gives the engine every core, not the replica actor's one.
Real local Ray and Serve, the real CPU engine (smallest model)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pipeline.trial.replicas import (
    app_name, claim_standby, delete_study_apps, launch_fresh, live_app, release, standby_name, start_engine,
    start_standby,
)
from pipeline.study.driver import connect_ray
from serve.engines import engine_for
from serve.engines.base import ReplicaConfig
from serve.replica.placement import actor_options
from tests.integration.conftest import SMOL, TEST_THREADS

pytestmark = pytest.mark.integration
STUDY = "it-reuse"
TIMEOUT_S = 360.0
ENGINE = engine_for("cpu")  # the engine of `config`'s replicas


@pytest.fixture(scope="module")
def serve_url():
    url = connect_ray(STUDY)
    yield url
    delete_study_apps(STUDY)


def config(tmp: Path, label: str, spec: dict | None = None, extra: tuple[str, ...] = (),
           replica_cpus: float | None = None, threads: int | None = TEST_THREADS) -> ReplicaConfig:
    return ReplicaConfig(model=SMOL, spec=spec or {"algorithm": "none"}, threads=threads,
                         replica_cpus=replica_cpus, start_timeout_s=300,
                         extra_flags=["--verify-probe-seconds", "0", *extra], log_dir=str(tmp / label))


def replica_of(url: str) -> dict:
    return httpx.get(f"{url}/replica/argv", timeout=30).json()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def generate(url: str) -> str:
    body = {"text": "def add(a, b):", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["text"]


def torch_default_threads() -> int:
    """torch's thread count in a process started without `OMP_NUM_THREADS` (every core)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    return int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], env=env,
                              capture_output=True, text=True, check=True, timeout=120).stdout)


def test_engine_restarts_in_the_live_replica_and_any_failure_falls_back_to_a_fresh_app(serve_url, tmp_path):
    from ray import serve

    # The driver's standby (no engine): the first trial process claims it and starts its engine there; nobody else
    # gets it.
    assert start_standby(STUDY, config(tmp_path, "standby"))
    first, how = start_engine(STUDY, "a", serve_url, config(tmp_path, "a"), TIMEOUT_S, ENGINE)
    assert how == "standby" and first.name == standby_name(STUDY)
    assert claim_standby(STUDY, serve_url, actor_options(config(tmp_path, "x")), TIMEOUT_S) is None
    before = replica_of(first.url)
    assert before["argv"] and list((tmp_path / "a").glob("engine-*.log"))  # the trial's engine, its own log
    generate(first.url)

    ngram = {"algorithm": "ngram", "num_draft_tokens": 3, "max_bfs_breadth": 1}
    second, how = start_engine(STUDY, "b", serve_url, config(tmp_path, "b", ngram), TIMEOUT_S, ENGINE)
    after = replica_of(second.url)
    assert how == "reused" and second == first  # same app, same route
    assert after["replica_pid"] == before["replica_pid"]  # the same actor: no new Ray worker
    assert after["pid"] != before["pid"] and not group_alive(before["pid"])  # old engine group gone first
    assert "NGRAM" in after["argv"] and list((tmp_path / "b").glob("engine-*.log"))  # the new config, its own log
    assert generate(second.url)

    # A start that fails: the trial gets the engine's reason, and the failed engine's own log stays readable.
    with pytest.raises(RuntimeError, match="exited with code 3"):
        start_engine(STUDY, "c", serve_url, config(tmp_path, "c", extra=("--test-fault", "exit-at-start")),
                     TIMEOUT_S, ENGINE)
    failed = live_app(STUDY)
    assert failed is not None and failed.name == first.name
    log = httpx.get(f"{failed.url}/replica/log", timeout=30)
    assert log.status_code == 200 and "TEST FAULT exit-at-start" in log.text
    release(STUDY)  # what a trial does after any failure

    # The fresh app's engine with `threads: None` gets torch's own default (every core), not the `OMP_NUM_THREADS=1`
    # Ray sets in the replica actor (0.1 CPU) that starts it: checked on this launch, not on one more of its own.
    third, how = start_engine(STUDY, "d", serve_url, config(tmp_path, "d", threads=None), TIMEOUT_S, ENGINE)
    assert how == "new" and third.name == app_name(STUDY, "d")
    assert replica_of(third.url)["replica_pid"] != before["replica_pid"]
    assert httpx.get(f"{third.url}/server_info", timeout=30).json()["torch_threads"] == torch_default_threads()
    generate(third.url)

    # Other ray_actor_options (resources, placement are the actor's): a fresh app, the old one deleted.
    fourth, how = start_engine(STUDY, "e", serve_url, config(tmp_path, "e", replica_cpus=0.2), TIMEOUT_S, ENGINE)
    assert how == "new" and fourth.name == app_name(STUDY, "e")
    generate(fourth.url)
    deadline = time.monotonic() + 120  # the delete did not wait (no GPU): the controller finishes it
    while third.name in serve.status().applications and time.monotonic() < deadline:
        time.sleep(0.5)
    assert third.name not in serve.status().applications
    assert set(a for a in serve.status().applications if a.startswith(f"{STUDY}~")) == {fourth.name}

    # A standby with other actor options than the claimant needs is of no use to anyone: deleted.
    assert start_standby(STUDY, config(tmp_path, "standby", replica_cpus=0.3))
    assert claim_standby(STUDY, serve_url, actor_options(config(tmp_path, "f")), TIMEOUT_S) is None
    deadline = time.monotonic() + 120
    while standby_name(STUDY) in serve.status().applications and time.monotonic() < deadline:
        time.sleep(0.5)
    assert standby_name(STUDY) not in serve.status().applications


def test_phases_are_reported_and_equal_engine_settings_share_one_launch(serve_url, tmp_path):
    """Defects 2.4 and section 3 of the GPU review: the start's phases come back with their seconds (and go in the
    engine log); the next config with the same engine settings runs on the same engine process, its corpus swapped
    at runtime; `launch_fresh` (a finalist's next run) starts a new one anyway."""
    release(STUDY)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('"def add(a, b):\\n    return a + b"\n')
    ngram = {"algorithm": "ngram", "num_draft_tokens": 4, "max_bfs_breadth": 1, "external_sam_budget": 2}
    first_app, _ = start_engine(STUDY, "p", serve_url, config(tmp_path, "p", {**ngram, "external_corpus": str(corpus)}),
                                TIMEOUT_S, ENGINE)
    first = replica_of(first_app.url)
    assert first["launch"]["shared"] is False and first["startup_s"] > 0
    assert {"stopping", "preflight", "loading", "corpus"} <= set(first["phases"])
    assert all(seconds >= 0 for seconds in first["phases"].values())
    assert "--speculative-ngram-external-corpus-path" not in first["argv"]  # loaded at runtime, timed
    assert first["corpus"]["id"] == str(corpus) and first["corpus"]["load_s"] >= 0
    listed = httpx.get(f"{first_app.url}/list_external_corpora", timeout=30).json()["corpus_token_counts"]
    assert listed == {str(corpus): first["corpus"]["loaded_token_count"]} and listed[str(corpus)] > 0
    log = httpx.get(f"{first_app.url}/replica/log", timeout=30).text
    assert "[replica] start done: stopping" in log and "loading" in log

    second_app, _ = start_engine(STUDY, "q", serve_url, config(tmp_path, "q", ngram), TIMEOUT_S, ENGINE)
    second = replica_of(second_app.url)
    assert second["launch"]["shared"] is True and second["pid"] == first["pid"] and second["startup_s"] is None
    assert httpx.get(f"{second_app.url}/list_external_corpora", timeout=30).json()["corpus_token_counts"] == {}
    assert generate(second_app.url)
    assert "launch shared" in httpx.get(f"{second_app.url}/replica/log", timeout=30).text

    launch_fresh(STUDY)
    third_app, _ = start_engine(STUDY, "r", serve_url, config(tmp_path, "r", ngram), TIMEOUT_S, ENGINE)
    third = replica_of(third_app.url)
    assert third["launch"]["shared"] is False and third["pid"] != first["pid"] and not group_alive(first["pid"])
    assert generate(third_app.url)
