"""The CPU engine under hostile or heavy use, on a real server (SmolLM2-135M, NGRAM): bounded queue (429 +
Retry-After), token budget, cancel on disconnect, bounded stop strings, SGLang's /health, /flush_cache?timeout= and
avg_spec_accept_length semantics. One server, one request running at a time, a waiting queue of one."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from serve.engines.cpu.server import FLUSH_FAILED, FLUSH_IN_PROGRESS, FLUSH_OK, FLUSH_TIMED_OUT

pytestmark = pytest.mark.integration

ARGS = ["--model-path", "smollm2-135m", "--threads", "1", "--context-length", "256", "--verify-probe-seconds", "0",
        "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4",
        "--speculative-ngram-max-bfs-breadth", "2",
        "--max-running-requests", "1", "--max-queued-requests", "1", "--max-total-tokens", "200"]
PROMPT = "Count: one, two, three, four, five, six,"


@pytest.fixture(scope="module")
def server(smol_dir, cpu_server, tmp_path_factory):
    with cpu_server(ARGS, tmp_path_factory.mktemp("limits-server")) as srv:
        yield srv


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        _wait_idle(c)
        assert c.post("/flush_cache").status_code == 200
        yield c


def _wait_idle(c: httpx.Client, deadline_s: float = 120) -> dict:
    deadline = time.monotonic() + deadline_s
    while True:
        state = c.get("/server_info").json()["internal_states"][0]
        if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0:
            return state
        assert time.monotonic() < deadline, f"engine still busy after {deadline_s} s: {state}"
        time.sleep(0.2)  # polling a condition under a deadline


class _Stream:
    """A streamed /generate held open: enter returns once its first event arrived (the request runs or waits)."""

    def __init__(self, url: str, new: int, wait_first: bool = True) -> None:
        self._cm = httpx.stream("POST", url + "/generate", timeout=300, json={
            "text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": new, "temperature": 0}})
        self.wait_first = wait_first

    def __enter__(self):
        self.response = self._cm.__enter__()
        self.lines = self.response.iter_lines()
        if self.wait_first:
            next(line for line in self.lines if line.startswith("data:"))
        return self

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)


def test_a_full_queue_answers_429_with_retry_after_and_health_still_answers(client, server):
    with _Stream(server.url, 150):  # running
        waiting = httpx.stream("POST", server.url + "/generate", timeout=300, json={
            "text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        with waiting as second:
            assert second.status_code == 200  # queued behind the first
            third = client.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}})
            assert third.status_code == 429, third.text
            assert int(third.headers["retry-after"]) >= 1 and "queue is full" in third.json()["error"]["message"]
            assert client.get("/health", timeout=30).status_code == 200  # the probe is never refused
    _wait_idle(client)


def test_the_token_budget_refuses_what_can_never_fit(client):
    resp = client.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 195}})
    assert resp.status_code == 400 and "--max-total-tokens=200" in resp.json()["error"]["message"]


def test_a_dropped_non_streamed_request_stops_decoding(client, server):
    before = client.get("/server_info").json()["internal_states"][0]["num_finished_requests"]
    url = urlparse(server.url)
    body = json.dumps({"text": PROMPT, "sampling_params": {"max_new_tokens": 150, "temperature": 0,
                                                           "ignore_eos": True}}).encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 60
        while client.get("/server_info").json()["internal_states"][0]["num_running_reqs"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    # the socket is closed: the engine must cancel instead of decoding 150 tokens for nobody
    state = _wait_idle(client)
    assert state["num_finished_requests"] == before, "the dropped request ran to its end"


def test_a_huge_stop_string_is_refused_at_once_and_health_stays_fast(client):
    resp = client.post("/generate", json={"text": "hi", "stream": True, "sampling_params": {
        "max_new_tokens": 4, "stop": "x" * 400_000}})
    assert resp.status_code == 400 and "at most" in resp.json()["error"]["message"]
    assert len(resp.text) < 2000  # the message does not echo the 400 KB
    resp = client.post("/generate", json={"text": "hi", "sampling_params": {"stop": ["a", "b", "c", "d", "e"]}})
    assert resp.status_code == 400 and "at most 4 stop strings" in resp.text


@pytest.mark.parametrize("body, field", [
    ({"text": "\ud800"}, "text"),
    ({"text": "hi", "sampling_params": {"seed": 2**64}}, "seed"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": "2"}}, "max_new_tokens"),
    ({"input_ids": [1, True]}, "input_ids"),
])
def test_hostile_values_are_400_not_500(client, body, field):
    raw = json.dumps(body)  # json.dumps writes a lone surrogate as the escape \ud800, as a hostile client would
    resp = client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 400 and field in resp.json()["error"]["message"]


def test_health_runs_a_generation_and_answers_while_busy(client, server):
    with _Stream(server.url, 100):
        assert client.get("/health", timeout=30).status_code == 200  # at the running request's next step
    _wait_idle(client)
    assert client.get("/health", timeout=30).status_code == 200  # idle: its own 1-token generation
    state = client.get("/server_info").json()["internal_states"][0]
    assert state["num_finished_requests"] == 0 and state["prompt_tokens"] == 0  # probes are not counted


def test_flush_with_timeout_waits_for_idle_like_sglang(client, server):
    with _Stream(server.url, 100) as stream:
        refused = client.post("/flush_cache")
        assert (refused.status_code, refused.text) == (400, FLUSH_FAILED)
        short = client.post("/flush_cache", params={"timeout": 0.2})
        assert (short.status_code, short.text) == (400, FLUSH_TIMED_OUT)
        results: dict[str, httpx.Response] = {}
        waiter = threading.Thread(target=lambda: results.update(
            waited=httpx.post(server.url + "/flush_cache", params={"timeout": 120}, timeout=300)))
        waiter.start()
        deadline = time.monotonic() + 30
        while True:  # until the waiting flush is registered: a second one is refused meanwhile
            other = client.post("/flush_cache")  # timeout 0: never holds the pending slot itself
            if other.text == FLUSH_IN_PROGRESS:
                break
            assert time.monotonic() < deadline, other.text
        rest = [line for line in stream.lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]"
    waiter.join(timeout=300)
    assert (results["waited"].status_code, results["waited"].text) == (200, FLUSH_OK)


def test_avg_spec_accept_length_appears_only_after_40_decode_batches(client):
    state = client.get("/server_info").json()["internal_states"][0]
    assert "avg_spec_accept_length" not in state  # just flushed
    for _ in range(40):  # one request at a time: a decode batch is one verify step, at least one a request
        if state["spec_verify_ct"] >= 40:
            break
        client.post("/generate", json={"text": PROMPT, "sampling_params": {
            "max_new_tokens": 30, "temperature": 0}}).raise_for_status()
        state = client.get("/server_info").json()["internal_states"][0]
        if state["spec_verify_ct"] < 40:
            assert "avg_spec_accept_length" not in state, state
    assert state["spec_verify_ct"] >= 40, f"40 requests of 30 tokens counted fewer than 40 verify steps: {state}"
    assert 1.0 <= state["avg_spec_accept_length"] <= 4.0
    assert client.post("/flush_cache").status_code == 200
    assert "avg_spec_accept_length" not in client.get("/server_info").json()["internal_states"][0]


def test_no_docs_or_openapi_schema(client):
    assert client.get("/docs").status_code == 404 and client.get("/openapi.json").status_code == 404
