"""The production endpoint when its engine dies or stops answering, for real (issue #31 items 3, 4): the CPU engine
process behind Ray Serve is SIGKILLed under load, or SIGSTOPped past its keep-alive timeout.

Expected: every answer is a 200 or a 503 with `Retry-After` in OpenAI's error shape (never a bare 500, never a cut
connection), a stream in flight ends with an error event and `[DONE]`, `/health` says 503 (engine gone) or 504
(engine not answering within `health_timeout_s`) and the endpoint serves again once Serve has replaced the replica;
requests sent to a paused engine are answered when it resumes. Loops are bounded by deadlines; the only fixed wait is
the length of the pause itself (the fault), which must outlast the engine's 5 s keep-alive.

Placed by cost in the end-to-end tier (a real engine killed and replaced by Serve, another paused: 30-50 s); the
default run keeps the cheap checks of the same answers: tests/unit/test_production_ingress.py (a dead engine's 503 with
`Retry-After`, `/health` 503 and its bounded 504, a stream's error event and `[DONE]`) and
tests/unit/test_production_engine_client.py (an engine that never answers, or leaves a stream mid-answer)."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from pipeline.study.driver import connect_ray
from serve.engines.base import ReplicaConfig
from serve.production.settings import ProductionSettings
from serve.production.app import deploy
from serve.serving import Provenance, ServingConfig
from tests.integration.production_helpers import alive, app_processes, metric, openai_error, stream_outcome, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
KEY = "faults-key-0123456789abcdef"
MODEL = "smollm2-135m"
APP = "faults"
PAUSE_S = 7.0  # past uvicorn's 5 s keep-alive: the engine closes idle connections first when it resumes


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    from ray import serve

    tmp = tmp_path_factory.mktemp("prod-faults")
    config = ServingConfig(replica=ReplicaConfig(model=MODEL, max_running_requests=4, threads=1),
                           provenance=Provenance(study="faults", decision="keep_baseline", source="baseline",
                                                 workload="w", workload_digest="0123456789abcdef"))
    (tmp / "serving.json").write_text(config.model_dump_json())
    (tmp / "keys.txt").write_text(KEY + "\n")
    base_url = connect_ray("production-faults-test")
    settings = ProductionSettings(config_file=str(tmp / "serving.json"), app_name=APP,
                                  api_key_file=str(tmp / "keys.txt"), health_timeout_s=2.0, retry_after_s=3,
                                  request_timeout_s=120)
    deploy(settings)
    yield base_url, settings
    serve.delete(APP)


def _engine() -> "object":
    engines = alive(app_processes(APP)["engine"])
    return engines[0] if len(engines) == 1 else None


class _Load:
    """Clients sending requests back to back (half streamed chat, half plain completions) and recording outcomes."""

    def __init__(self, base_url: str, clients: int = 4) -> None:
        self.base_url, self.stop = base_url, threading.Event()
        self.outcomes: list[tuple[str, int, dict]] = []  # (kind, status, details)
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def __enter__(self) -> "_Load":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=180)
        assert not any(t.is_alive() for t in self.threads), "a client outlived its 120 s timeout"

    def ok_count(self) -> int:
        return sum(1 for _, status, d in self.outcomes if status == 200 and not d.get("error"))

    def _run(self, index: int) -> None:
        headers = {"Authorization": f"Bearer {KEY}"}
        deadline = time.monotonic() + 600
        with httpx.Client(base_url=self.base_url, headers=headers, timeout=120) as http:
            while not self.stop.is_set() and time.monotonic() < deadline:
                try:
                    if index % 2:
                        self.outcomes.append(self._stream(http))
                    else:
                        answer = http.post("/v1/completions", json={"prompt": "Count: one, two,", "max_tokens": 24,
                                                                    "temperature": 0})
                        self.outcomes.append(("plain", answer.status_code, _details(answer)))
                except httpx.HTTPError as exc:  # a cut connection: what must not happen
                    self.outcomes.append(("plain" if index % 2 == 0 else "stream", -1, {"exc": repr(exc)}))

    @staticmethod
    def _stream(http: httpx.Client) -> tuple[str, int, dict]:
        body = {"messages": [{"role": "user", "content": "Count from one to twenty."}], "max_tokens": 24,
                "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                return "stream", response.status_code, _details(response)
            done, error = stream_outcome(list(response.iter_lines()))
            return "stream", 200, {"done": done, "error": error}


def _details(response: httpx.Response) -> dict:
    if response.status_code == 200:
        return {}
    return {"error": openai_error(response), "retry_after": response.headers.get("retry-after")}


def test_a_killed_engine_is_503_with_retry_after_until_serve_replaces_it(endpoint):
    base_url, settings = endpoint
    before_503 = metric(base_url, KEY, "specdec_requests_total", route="/v1/completions", status="503")
    health: list[int] = []

    def health_is(status: int) -> bool:
        health.append(httpx.get(f"{base_url}/health", timeout=30).status_code)
        return health[-1] == status

    with _Load(base_url) as load:
        wait_for(lambda: load.ok_count() >= 4, "4 answers before the fault", 300)
        engine = wait_for(_engine, "the engine process found", 60)
        engine.kill()  # SIGKILL, as an OOM kill or a crash would
        wait_for(lambda: health_is(503), "/health answering 503", 60)
        wait_for(lambda: health_is(200), "/health healthy again (Serve replaced the replica)", 300)
        served_before = load.ok_count()
        wait_for(lambda: load.ok_count() >= served_before + 4, "4 answers after the recovery", 300)
    # 503 while the dead engine's replica is still there; 504 (no answer within health_timeout_s) while Serve has no
    # replica yet to ask; never a 500
    assert 503 in health and set(health) <= {200, 503, 504}, health
    statuses = {status for _, status, _ in load.outcomes}
    assert statuses <= {200, 503}, [o for o in load.outcomes if o[1] not in (200, 503)][:5]
    refused = [d for _, status, d in load.outcomes if status == 503]
    assert all(d["retry_after"] == str(settings.retry_after_s) for d in refused), refused[:3]
    streams = [d for kind, status, d in load.outcomes if kind == "stream" and status == 200]
    assert all(d["done"] for d in streams), "a stream ended without [DONE]"
    cut = [d["error"] for d in streams if d["error"]]
    assert all(e["code"] == 503 for e in cut), cut  # a stream the dying engine left: an error event, then [DONE]
    assert refused or cut, "the kill was never seen by a client"
    plain_503 = sum(1 for kind, status, _ in load.outcomes if kind == "plain" and status == 503)
    after_503 = metric(base_url, KEY, "specdec_requests_total", route="/v1/completions", status="503")
    assert after_503 - before_503 == plain_503  # every 503 is counted


def test_a_paused_engine_answers_its_waiting_requests_and_health_is_bounded(endpoint):
    base_url, settings = endpoint
    engine = wait_for(_engine, "the engine process found", 120)
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "Say hi.", "max_tokens": 4, "temperature": 0}
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as http:
        assert http.post("/v1/completions", json=body).status_code == 200  # connections to the engine are pooled
    answers: list[int] = []

    def one() -> None:
        with httpx.Client(base_url=base_url, headers=headers, timeout=120) as http:
            answers.append(http.post("/v1/completions", json=body).status_code)

    os.kill(engine.pid, signal.SIGSTOP)
    try:
        waiting = [threading.Thread(target=one) for _ in range(4)]
        for thread in waiting:
            thread.start()
        health = httpx.get(f"{base_url}/health", timeout=60)  # the engine cannot answer: bounded by health_timeout_s
        time.sleep(PAUSE_S)  # the fault: the engine stays stopped past its keep-alive
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    for thread in waiting:
        thread.join(timeout=180)
    assert health.status_code == 504 and "health_timeout_s=2" in openai_error(health)["message"]
    assert answers == [200] * 4, answers
    assert httpx.get(f"{base_url}/health", timeout=60).status_code == 200
