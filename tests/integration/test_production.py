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
from openai.types.chat import ChatCompletionMessageParam

from pipeline.records.registry import set_production
from serve.engines.base import ReplicaConfig
from serve.production.settings import ProductionSettings
from serve.production.app import deploy, load_serving_config
from serve.replica.deployment import EngineProcess
from tests.integration.production_helpers import app_processes, metric, openai_error, raw_post

from tests.integration.production_endpoint import AUTH, KEY, MODEL, NGRAM, capture_rows, client, endpoint, serving  # noqa: F401 (endpoint: a fixture)

pytestmark = pytest.mark.integration
def test_openai_routes_match_the_engine_directly(endpoint):
    base_url, _, _ = endpoint
    api = client(base_url)
    assert [m.id for m in api.models.list().data]
    prompt = "def add(a, b):\n    return"
    served = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    streamed = "".join(c.choices[0].text for c in api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True) if c.choices)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]
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
                          headers={b"Authorization": "Bearer clé-ключ".encode("utf-8")}, timeout=60)
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
    assert out.usage is not None
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

_CHAT = [{"role": "user", "content": "Hi"}]
_ERROR_CASES = [
    ("/v1/completions", {"content-type": "application/json"}, b'{"prompt": "x", "max_tokens": 2}', 401),
    ("/v1/completions", {"Authorization": "Bearer not-the-key-0123456789"}, b'{"prompt": "x"}', 401),
    ("/v1/models", {}, None, 401), ("/v1/config", {}, None, 401), ("/metrics", {}, None, 401),
    ("/v1/completions", AUTH, b'{"prompt": ', 400),
    ("/v1/completions", AUTH, b'["not", "an", "object"]', 400),
    ("/v1/completions", AUTH, b"[" * 5000 + b"]" * 5000, 400),
    ("/v1/chat/completions", AUTH, b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
    ("/v1/completions", AUTH, b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400),
    ("/v1/completions", AUTH, b'{"prompt": "x", "max_tokens": 2, "temperature": Infinity}', 400),
    ("/v1/completions", AUTH, b'{"prompt": "x", "max_tokens": 2, "temperature": 1e400}', 400),
    ("/v1/completions", AUTH, b'{"prompt": "x", "max_tokens": 2, "temperature": NaN}', 400),
    ("/v1/completions", AUTH, b'{"prompt": "x", "max_tokens": 2, "top_p": 0}', 400),  # the engine's own check
    ("/v1/completions", AUTH, b'{"prompt": "' + b"x" * 70000 + b'"}', 413),
    *[("/v1/completions", AUTH, json.dumps({"prompt": "Hi", "max_tokens": value}).encode(), 422)
      for value in (0, -1, "5", 5.0, 5.5, True, 65)],
    ("/v1/chat/completions", AUTH, json.dumps({"messages": _CHAT, "max_completion_tokens": 0}).encode(), 422),
    ("/v1/chat/completions", AUTH, json.dumps({"messages": _CHAT, "max_tokens": "5"}).encode(), 422),
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
    assert ok.usage is not None
    assert ok.usage.completion_tokens >= 1  # refused requests never disturbed the engine


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/completions", {"model": MODEL, "max_tokens": 2, "stream": True}, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "stream": True, "messages": [{"content": "Hi"}]},
     "messages.0.role"),
])
def test_a_400_names_only_fields_the_client_sent(endpoint, path, body, field):
    """The ingress adds `return_spec_tokens_details` (and a stream's `stream_options`) to what the engine gets; a
    "field required" answer echoed them with the whole body (issue #63 item 9)."""
    base_url, _, _ = endpoint
    response = httpx.post(base_url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    message = openai_error(response)["message"]
    assert response.status_code == 400 and message == f"{field}: field required", message
    assert "return_spec_tokens_details" not in message and "include_usage" not in message, message


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


def test_capture_records_what_was_served_in_private_files(endpoint):
    base_url, settings, _ = endpoint
    folder = Path(settings.capture.dir)
    already = len(capture_rows(folder, 0))
    api = client(base_url)
    plain = api.completions.create(model=MODEL, prompt="Capture me:", temperature=0)  # no max_tokens: 16 served
    api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Capture me too."}],
                                max_tokens=3, temperature=0)
    rows = capture_rows(folder, already + 2)
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
    response = httpx.post(f"{base_url}/v1/chat/completions", headers=AUTH, timeout=120,
                          json={"model": MODEL, "messages": [{"role": "user", "content": long_prompt}]})
    assert response.status_code == 400, response.text
    message = openai_error(response)["message"]
    assert f"max_tokens={settings.max_tokens_limit}" in message and "max_tokens_limit" in message, message
    assert "sampling_params" not in message and "<= 41" in message
