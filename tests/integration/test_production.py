"""The production endpoint on the CPU engine, through Ray Serve, with the real `openai` client.

Two serving configs are registered in MLflow (SQLite): version 1 = baseline, version 2 = NGRAM. The endpoint serves
alias `production`; promotion and rollback move the alias and roll the app while a client keeps sending requests.
Every error path is exercised here, through Serve (issue #31: the module imported in-process hid a NameError that
Serve's pickling of the ingress caused), with the capture on, so that what it records is checked as served.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from pipeline.loop.client import EndpointClient, EndpointError
from pipeline.records.tracking import Tracker
from pipeline.records.registry import register_config, set_production
from pipeline.study.driver import connect_ray
from serve.canary_contract import CandidateRef, CanaryStart, DriftLine, DriftReport
from serve.capture import CaptureSettings
from serve.engines.base import ReplicaConfig
from serve.live import LiveSummary
from serve.production import ProductionSettings, deploy, load_serving_config
from serve.replica import EngineProcess
from serve.serving import Provenance, ServingConfig
from tests.integration.production_helpers import app_processes, metric, openai_error, raw_post, wait_for

pytestmark = pytest.mark.integration
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


def client(base_url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=120)


def test_openai_routes_match_the_engine_directly(endpoint):
    base_url, _, _ = endpoint
    api = client(base_url)
    assert [m.id for m in api.models.list().data]
    prompt = "def add(a, b):\n    return"
    served = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True) if c.choices)
    messages = [{"role": "user", "content": "Say hello."}]
    chat = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chat_streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True) if c.choices)
    engine = EngineProcess(ReplicaConfig(model=MODEL))
    try:
        engine.wait_ready()
        direct = openai.OpenAI(base_url=f"{engine.url}/v1", api_key="none", max_retries=0)
        expected = direct.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        expected_chat = direct.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    finally:
        engine.stop()
    assert served == streamed == expected.choices[0].text and served
    assert chat.choices[0].message.content == chat_streamed == expected_chat.choices[0].message.content


@pytest.mark.parametrize("headers, body, status", [
    ({}, b'{"model": "m", "prompt": "x", "max_tokens": 4}', 401),
    ({"Authorization": "Bearer wrong"}, b'{"model": "m", "prompt": "x", "max_tokens": 4}', 401),
    ({"Authorization": f"Bearer {KEY}"}, b'{"model": "m", "prompt": ', 400),
    ({"Authorization": f"Bearer {KEY}"}, b'{"model": "m", "prompt": "' + b"x" * 70000 + b'"}', 413),
    ({"Authorization": f"Bearer {KEY}"}, b'{"model": "m", "prompt": "x", "max_tokens": 100000}', 422),
])
def test_bad_requests_are_refused_and_the_endpoint_keeps_serving(endpoint, headers, body, status):
    base_url, _, _ = endpoint
    response = httpx.post(f"{base_url}/v1/completions", content=body,
                          headers={"content-type": "application/json", **headers}, timeout=60)
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"]
    ok = client(base_url).completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert ok.choices[0].text is not None


def _served_version(base_url: str) -> str:
    return httpx.get(f"{base_url}/v1/config", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()["version"]


def _roll_under_load(base_url: str, settings: ProductionSettings) -> tuple[int, int]:
    """Roll the app while a client sends requests back to back; returns (sent, failed)."""
    api = client(base_url)
    done = threading.Event()
    counts = {"sent": 0, "failed": 0}

    def traffic() -> None:
        deadline = time.monotonic() + 600  # bounded even if the roll hangs
        while not done.is_set() and time.monotonic() < deadline:
            counts["sent"] += 1
            try:
                api.completions.create(model=MODEL, prompt="x = 1\ny = 2\n", max_tokens=4, temperature=0)
            except openai.OpenAIError:
                counts["failed"] += 1

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        deploy(settings)
        sent_at_ready = counts["sent"]
        deadline = time.monotonic() + 300  # each request is bounded by the client's 120 s timeout
        while counts["sent"] < sent_at_ready + 3:  # a few requests on the new version too
            assert worker.is_alive(), f"the traffic thread ended before 3 requests on the new version: {counts}"
            assert time.monotonic() < deadline, f"3 requests on the new version not sent within 300 s: {counts}"
            time.sleep(0.1)  # polling a condition under a deadline
    finally:
        done.set()
        worker.join(timeout=180)
    assert not worker.is_alive(), "the traffic thread's last request outlived the client timeout"
    return counts["sent"], counts["failed"]


def test_promotion_and_rollback_drop_no_request(endpoint):
    base_url, settings, tracker = endpoint
    assert _served_version(base_url) == "1"
    set_production(tracker, "specdec-prod", "2")  # promote
    sent, failed = _roll_under_load(base_url, settings)
    assert failed == 0 and sent > 3
    config = httpx.get(f"{base_url}/v1/config", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert config["version"] == "2" and config["replica"]["spec"]["algorithm"] == "ngram"
    # /v1/config is the promoted serving config field for field (plus where it came from)
    promoted = load_serving_config(settings.tracking_uri, "models:/specdec-prod/2")
    assert {k: config[k] for k in ("replica", "provenance")} == promoted.model_dump(mode="json")
    assert promoted == serving(NGRAM, "promote")
    assert config["origin"] == {"source": "models:/specdec-prod@production", "registered_model": "specdec-prod",
                                "alias": "production", "version": "2"}
    set_production(tracker, "specdec-prod", "1")  # roll back
    sent, failed = _roll_under_load(base_url, settings)
    assert failed == 0 and sent > 3
    assert _served_version(base_url) == "1"


def test_metrics_are_exposed(endpoint):
    base_url, _, _ = endpoint
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    assert "specdec_requests_total" in text and "specdec_request_latency_seconds" in text


def _count(base_url: str, route: str, status: int) -> float:
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    needle = f'specdec_requests_total{{route="{route}",status="{status}"}} '
    return sum(float(line[len(needle):]) for line in text.splitlines() if line.startswith(needle))


def _engine_requests(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    prefix = 'specdec_engine_requests{state="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def test_a_dropped_non_streamed_request_stops_decoding_behind_serve(endpoint):
    """Client -> Serve proxy -> ingress -> engine handle -> engine: closing the socket must cancel the generation."""
    import json
    import socket
    from urllib.parse import urlparse

    base_url, _, _ = endpoint
    deadline = time.monotonic() + 120
    while _engine_requests(base_url).get("running", 1) or _engine_requests(base_url).get("waiting", 1):
        assert time.monotonic() < deadline, "engine never idle"
        time.sleep(0.2)  # polling a condition under a deadline
    finished = _engine_requests(base_url)["finished"]
    url = urlparse(base_url)
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 64, "temperature": 0,
                       "ignore_eos": True}).encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                     + b"\r\n\r\n" + body)
        while not _engine_requests(base_url).get("running"):
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.05)
    while _engine_requests(base_url).get("running"):
        assert time.monotonic() < deadline, "the engine kept decoding for a client that left"
        time.sleep(0.2)
    assert _engine_requests(base_url)["finished"] == finished, "the dropped request ran to its end"


def test_a_non_ascii_bearer_is_401_and_counted(endpoint):
    base_url, _, _ = endpoint
    before = _count(base_url, "/v1/completions", 401)
    response = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                          headers={"Authorization": "Bearer clé-ключ".encode("utf-8")}, timeout=60)
    assert response.status_code == 401, response.text
    assert _count(base_url, "/v1/completions", 401) == before + 1


def test_docs_and_openapi_schema_are_off(endpoint):
    base_url, _, _ = endpoint
    for path in ("/docs", "/openapi.json", "/redoc"):
        for headers in ({}, {"Authorization": f"Bearer {KEY}"}):
            assert httpx.get(base_url + path, headers=headers, timeout=30).status_code == 404, path


def test_chat_without_max_tokens_gets_the_endpoint_limit(endpoint):
    base_url, settings, _ = endpoint
    out = client(base_url).chat.completions.create(
        model=MODEL, temperature=0, messages=[{"role": "user", "content": "Count from 1 to 500, one per line."}])
    assert out.usage.completion_tokens <= settings.max_tokens_limit


def test_the_banner_reports_what_the_ingress_enforces(endpoint):
    from ray import serve

    _, settings, _ = endpoint
    summary = serve.get_app_handle(settings.app_name).auth_summary.remote().result(timeout_s=60)
    assert summary.startswith("required (1 key(s) + 1 admin key(s); proxy binds 127.0.0.1")


def _production_cli(tmp_path: Path, args: list[str], keys: str | None) -> subprocess.CompletedProcess:
    config = tmp_path / "serving.json"
    config.write_text("{}")
    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_API_KEYS"}
    if keys is not None:
        env["SPECDEC_API_KEYS"] = keys
    return subprocess.run([sys.executable, "-m", "serve.production", "--config-file", str(config), *args],
                          capture_output=True, text=True, env=env, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])


@pytest.mark.parametrize("keys, needle", [
    (None, "API keys are required when the endpoint binds '0.0.0.0'"),
    ("change-me-1,change-me-2", "placeholder"),  # the keys infra/serve-production.yaml used to ship
    ("k3y-7f9q", "shorter than"),
])
def test_off_localhost_without_usable_keys_fails_fast_with_the_reason(tmp_path, keys, needle):
    proc = _production_cli(tmp_path, ["--host", "0.0.0.0"], keys)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert needle in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    if keys:
        assert keys.split(",")[0] not in proc.stdout  # keys are never echoed


# --- every error path, through Serve (issue #31) -------------------------------------------------------------

_AUTH = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
_CHAT = [{"role": "user", "content": "Hi"}]
_ERROR_CASES = [
    ("/v1/completions", {"content-type": "application/json"}, b'{"prompt": "x", "max_tokens": 2}', 401),
    ("/v1/completions", {"Authorization": "Bearer not-the-key-0123456789"}, b'{"prompt": "x"}', 401),
    ("/v1/models", {}, None, 401), ("/v1/config", {}, None, 401), ("/metrics", {}, None, 401),
    ("/v1/completions", _AUTH, b'{"prompt": ', 400),
    ("/v1/completions", _AUTH, b'["not", "an", "object"]', 400),
    ("/v1/completions", _AUTH, b"[" * 5000 + b"]" * 5000, 400),
    ("/v1/chat/completions", _AUTH, b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    ("/v1/completions", _AUTH, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400),
    ("/v1/completions", _AUTH, b'{"prompt": "x", "max_tokens": 2, "temperature": Infinity}', 400),
    ("/v1/completions", _AUTH, b'{"prompt": "x", "max_tokens": 2, "temperature": 1e400}', 400),
    ("/v1/completions", _AUTH, b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}', 400),
    ("/v1/completions", _AUTH, b'{"prompt": "x", "max_tokens": 2, "top_p": 0}', 400),  # the engine's own check
    ("/v1/completions", _AUTH, b'{"prompt": "' + b"x" * 70000 + b'"}', 413),
    *[("/v1/completions", _AUTH, json.dumps({"prompt": "Hi", "max_tokens": value}).encode(), 422)
      for value in (0, -1, "5", 5.0, 5.5, True, 65)],
    ("/v1/chat/completions", _AUTH, json.dumps({"messages": _CHAT, "max_completion_tokens": 0}).encode(), 422),
    ("/v1/chat/completions", _AUTH, json.dumps({"messages": _CHAT, "max_tokens": "5"}).encode(), 422),
]


def _counts(base_url: str, keys: set[tuple[str, int]]) -> dict[tuple[str, int], float]:
    return {key: metric(base_url, KEY, "specdec_requests_total", route=key[0], status=str(key[1])) for key in keys}


def test_every_error_path_answers_in_openai_shape_and_is_counted(endpoint):
    base_url, _, _ = endpoint
    keys = {(path, status) for path, _, _, status in _ERROR_CASES}
    before = _counts(base_url, keys)
    for path, headers, body, status in _ERROR_CASES:
        if body is None:
            response = httpx.get(base_url + path, headers=headers, timeout=60)
        else:
            response = httpx.post(base_url + path, content=body, headers=headers, timeout=60)
        assert response.status_code == status, (path, body[:80] if body else None, response.text[:300])
        openai_error(response)
    after = _counts(base_url, keys)
    expected = {key: sum(1 for p, _, _, s in _ERROR_CASES if (p, s) == key) for key in keys}
    assert {key: after[key] - before[key] for key in keys} == expected
    ok = client(base_url).completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1  # refused requests never disturbed the engine


def test_a_chunked_upload_past_the_limit_is_refused_before_it_is_read(endpoint):
    base_url, settings, _ = endpoint
    ingress = app_processes(settings.app_name)["ingress"]
    assert len(ingress) == 1, ingress
    before = ingress[0].memory_info().rss
    status = raw_post(base_url, "/v1/completions", {"Authorization": f"Bearer {KEY}",
                                                    "Content-Type": "application/json"},
                      (b"x" * 2**20 for _ in range(300)))  # 300 MiB, no Content-Length
    grown = ingress[0].memory_info().rss - before
    assert status == 413
    # Generous: the replica held the whole body before (+860 MiB for these 300 MiB); now it stops at 64 KiB.
    assert grown < 150 * 2**20, f"the ingress replica grew by {grown / 2**20:.0f} MiB"


def _capture_rows(folder: Path, wanted: int) -> list[dict]:
    import pyarrow.parquet as pq

    deadline = time.monotonic() + 60  # parts are written off the request path
    while True:
        rows = [r for p in sorted(folder.glob("part-*.parquet")) for r in pq.read_table(p).to_pylist()]
        if len(rows) >= wanted or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)  # polling a condition under a deadline


def test_capture_records_what_was_served_in_private_files(endpoint):
    base_url, settings, _ = endpoint
    folder = Path(settings.capture.dir)
    already = len(_capture_rows(folder, 0))
    api = client(base_url)
    plain = api.completions.create(model=MODEL, prompt="Capture me:", temperature=0)  # no max_tokens: 16 served
    api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capture me too."}],
                                max_tokens=3, temperature=0)
    rows = _capture_rows(folder, already + 2)
    mine = {r["prompt"] or r["messages"]: r for r in rows}
    served = mine["Capture me:"]
    assert served["max_new_tokens"] == 16 and served["output"] == plain.choices[0].text
    assert served["id"].startswith("completions:")
    chat = next(r for key, r in mine.items() if "Capture me too." in key)
    assert chat["id"].startswith("chat:") and chat["max_new_tokens"] == 3
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.glob("part-*.parquet")} == {0o600}


def test_chat_without_max_tokens_on_a_long_prompt_says_which_limit_was_applied(endpoint):
    base_url, settings, _ = endpoint
    long_prompt = "a " * 8120  # 8151 tokens with the chat template: 41 left of 8192, fewer than the limit (64)
    response = httpx.post(f"{base_url}/v1/chat/completions", headers=_AUTH, timeout=120,
                          json={"model": MODEL, "messages": [{"role": "user", "content": long_prompt}]})
    assert response.status_code == 400, response.text
    message = openai_error(response)["message"]
    assert f"max_tokens={settings.max_tokens_limit}" in message and "max_tokens_limit" in message, message
    assert "sampling_params" not in message and "<= 41" in message



LIVE = {"version": "1", "arm": "production", "route": "low", "bucket": "1"}  # one request at a time, version 1
_LIVE_SAMPLES = {"tokens": ("specdec_completion_tokens_total", LIVE), "prompt": ("specdec_prompt_tokens_total", LIVE),
                 "e2e": ("specdec_e2e_seconds_sum", LIVE), "ttft": ("specdec_ttft_seconds_count", LIVE),
                 "itl": ("specdec_itl_seconds_count", LIVE), "tput": ("specdec_output_tokens_per_second_count", LIVE),
                 "ok": ("specdec_generation_requests_total", {**LIVE, "status": "200"}),
                 "latency": ("specdec_request_latency_seconds_sum", {"route": "/v1/completions"}),
                 "chat_latency": ("specdec_request_latency_seconds_sum", {"route": "/v1/chat/completions"})}


def _sample(text: str, name: str, labels: dict[str, str]) -> float:
    """One sample of a /metrics text with exactly these labels, in whatever order they are printed (0 if absent)."""
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name or "{" not in head:
            continue
        pairs = dict(p.split("=", 1) for p in head[len(name) + 1:-1].split(","))
        if pairs == {k: f'"{v}"' for k, v in labels.items()}:
            total += float(value)
    return total


def _samples(base_url: str, wanted: dict | None = None) -> dict[str, float]:
    """The samples of `wanted` (default _LIVE_SAMPLES) from one /metrics answer."""
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).text
    return {key: _sample(text, name, labels) for key, (name, labels) in (wanted or _LIVE_SAMPLES).items()}


def test_streamed_answers_are_measured_to_their_done_with_the_engines_usage(endpoint):
    """Streams counted no completion tokens and their latency stopped at the first byte (issue 30)."""
    base_url, _, _ = endpoint
    api = client(base_url)
    before = _samples(base_url)
    plain = list(api.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=8, temperature=0,
                                        stream=True, extra_body={"ignore_eos": True}))
    chat = list(api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to five."}],
                                            max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    after = _samples(base_url)
    delta = {key: after[key] - before[key] for key in after}
    # the client that did not ask for usage gets no usage chunk; the one that asked gets it
    assert all(c.choices and c.usage is None for c in plain)
    assert chat[-1].choices == [] and chat[-1].usage.completion_tokens == 4
    assert delta["tokens"] == 8 + 4 and delta["prompt"] > chat[-1].usage.prompt_tokens
    assert delta["ok"] == delta["ttft"] == delta["tput"] == 2
    texts = sum(1 for c in plain if c.choices[0].text) + sum(1 for c in chat if c.choices and c.choices[0].delta.content)
    assert delta["itl"] == texts - 2  # the gaps after each stream's first text chunk
    # each stream's latency ends once its [DONE] has passed the ingress, not at its first byte
    assert delta["latency"] + delta["chat_latency"] >= delta["e2e"] > 0


def test_the_live_feed_holds_each_answered_request_as_the_loop_reads_it(endpoint):
    base_url, _, _ = endpoint
    loop = EndpointClient(base_url, ADMIN)  # the closed loop's own client: it validates every answer's shape
    after = loop.live(0, limit=10_000).next
    api = client(base_url)
    streamed = list(api.completions.create(model=MODEL, prompt="Count: 4, 5,", max_tokens=8, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}))
    plain = api.completions.create(model=MODEL, prompt="Count: 4, 5,", max_tokens=4, temperature=0)
    feed = loop.live(after)
    assert feed.dropped == 0 and feed.next == feed.records[-1].seq
    first, second = feed.records  # nothing else was answered meanwhile
    assert (first.version, first.arm, first.route, first.api, first.concurrency) == \
        ("1", "production", "low", "/v1/completions", 1)
    assert first.streamed and first.status == 200 and first.completion_tokens == 8 and first.prompt_tokens > 0
    assert len(first.itl_s) == sum(1 for c in streamed if c.choices and c.choices[0].text) - 1
    assert first.ttft_s is not None and first.e2e_s >= first.ttft_s + sum(first.itl_s) - 1e-9
    assert not second.streamed and second.itl_s == () and second.seq == first.seq + 1
    assert (second.completion_tokens, second.prompt_tokens) == (plain.usage.completion_tokens,
                                                                plain.usage.prompt_tokens)
    summary = LiveSummary.model_validate(httpx.get(f"{base_url}/v1/live/summary", headers=_AUTH, timeout=60).json())
    group = next(f for f in summary.figures if (f.version, f.arm, f.route, f.bucket) == ("1", "production", "low", "1"))
    assert group.requests >= 2 and group.tput_tok_s_p50 is not None and group.itl_p50_ms is not None
    bad = httpx.get(f"{base_url}/v1/live", params={"after": "-1"}, headers=_AUTH, timeout=60)
    assert bad.status_code == 400 and "after" in openai_error(bad)["message"]


def _drift(statistic: float, metric_name: str) -> DriftReport:
    line = DriftLine(metric=metric_name, bucket=4, alarm=statistic >= 8.0, statistic=statistic, threshold=8.0,
                     requests=64, live_mean=1.2, reference_mean=2.0, text=f"{metric_name} at 4: CUSUM {statistic}")
    return DriftReport(at_ms=int(time.time() * 1000), reference_version="1", lines=(line,), shift="no shift")


def test_drift_reports_show_on_config_and_metrics_and_take_an_admin_key(endpoint):
    base_url, _, _ = endpoint
    loop = EndpointClient(base_url, ADMIN)
    refused = httpx.post(f"{base_url}/v1/drift", headers=_AUTH, timeout=60, content=_drift(1, "tput").model_dump_json())
    assert refused.status_code == 403 and "admin key" in openai_error(refused)["message"]
    loop.post_drift(_drift(9.5, "accept_length"))
    loop.post_drift(report := _drift(2.5, "tput"))  # the latest replaces the last whole
    assert loop.config()["drift"] == report.model_dump(mode="json")
    shown = _samples(base_url, {"tput": ("specdec_drift_statistic", {"metric": "tput", "bucket": "4"}),
                                "alarm": ("specdec_drift_alarm", {"metric": "tput", "bucket": "4"}),
                                "old": ("specdec_drift_alarm", {"metric": "accept_length", "bucket": "4"})})
    assert shown == {"tput": 2.5, "alarm": 0.0, "old": 0.0}  # the earlier report's alarm line is gone
    bad = httpx.post(f"{base_url}/v1/drift", headers={**_AUTH, "Authorization": f"Bearer {ADMIN}"}, timeout=60,
                     json={"at_ms": 1, "reference_version": "1", "lines": [{"metric": "tput"}]})
    assert bad.status_code == 422 and "lines.0.bucket" in openai_error(bad)["message"]


def test_capture_parts_are_served_to_admin_keys_only_and_by_part_name(endpoint):
    base_url, settings, _ = endpoint
    folder = Path(settings.capture.dir)
    client(base_url).completions.create(model=MODEL, prompt="Ship me:", max_tokens=2, temperature=0)
    _capture_rows(folder, 1)
    for path in ("/v1/capture", "/v1/capture/part-x-1.parquet"):
        assert httpx.get(base_url + path, headers=_AUTH, timeout=60).status_code == 403  # a user key
        assert httpx.get(base_url + path, timeout=60).status_code == 401
    with pytest.raises(EndpointError, match="403"):
        EndpointClient(base_url, KEY).capture_listing()
    loop = EndpointClient(base_url, ADMIN)
    listing = loop.capture_listing()
    on_disk = sorted(p.name for p in folder.glob("part-*.parquet"))
    assert [p.name for p in listing.parts] == on_disk and listing.max_rows == settings.capture.max_rows
    first = listing.parts[0]
    assert loop.capture_part(first.name) == (folder / first.name).read_bytes() and first.bytes > 0
    admin = {"Authorization": f"Bearer {ADMIN}"}
    (folder.parent / "secret.parquet").write_bytes(b"not for you")
    for name, status in (("..%2Fsecret.parquet", (400, 404)), ("part-..-1.parquet", (400,)),
                         (".part-a-1.parquet.1.tmp", (400,)), ("part-nothere-1.parquet", (404,))):
        response = httpx.get(f"{base_url}/v1/capture/{name}", headers=admin, timeout=60)
        assert response.status_code in status and b"not for you" not in response.content, (name, response.text)


def test_a_canary_serves_its_share_on_the_candidates_own_engine_and_stops(endpoint):
    from ray import serve

    base_url, settings, _ = endpoint
    loop = EndpointClient(base_url, ADMIN)
    start = CanaryStart(candidate=CandidateRef(registered_model="specdec-prod", version="2"), share=1.0)
    refused = httpx.post(f"{base_url}/v1/canary/start", headers=_AUTH, content=start.model_dump_json(), timeout=60)
    assert refused.status_code == 403
    assert loop.canary_start(start).state == "starting"
    with pytest.raises(EndpointError, match="409"):
        loop.canary_start(start)
    status = wait_for(lambda: (s := loop.canary()).state != "starting" and s, "the candidate's engine started", 420)
    assert status.state == "running", status.reason
    after = loop.live(0, limit=10_000).next
    api = client(base_url)
    api.completions.create(model=MODEL, prompt="x = 1\ny = 2\n", max_tokens=4, temperature=0)
    record = loop.live(after).records[-1]
    assert (record.arm, record.version, record.status) == ("candidate", "2", 200)  # share 1: every request
    shown = loop.config()
    assert shown["version"] == "1" and shown["canary"]["requests"]["candidate"] == 1
    assert loop.canary_share(0.5).share == 0.5
    assert loop.canary_stop("test over").state == "stopping"
    wait_for(lambda: loop.canary().state == "off", "the canary stopped", 120)
    api.completions.create(model=MODEL, prompt="x = 1\n", max_tokens=2, temperature=0)
    assert loop.live(record.seq).records[-1].arm == "production"
    assert f"{settings.app_name}-canary" not in serve.status().applications
    assert loop.canary().reason == "test over"
