"""Backpressure and the request timeout of the production endpoint, live (issue #15 item 2): Ray Serve, the ingress
and the CPU engine, with limits made small through `ProductionSettings`.

The engine runs with the test fault `hang-after=0`: it accepts every generation request and never answers it (until
the caller goes away), so requests stay in flight for as long as the test holds them, and a full queue is a state,
not a race. No timing is asserted: the httpx/openai timeouts below only bound a test that would otherwise hang.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from pipeline.study.driver import connect_ray
from serve.production.settings import ProductionSettings
from serve.production.app import deploy
from tests.integration.production_endpoint import BASELINE, KEY, MODEL, client, serving

pytestmark = pytest.mark.integration
HANG = ["--test-fault", "hang-after=0"]  # serve/engines/cpu/faults.py
BODY: dict[str, Any] = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8}  # JSON, or the client's kwargs


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    """(base URL, settings) of a production app on a CPU engine that holds every generation request: one request at
    a time in the ingress, one more in Serve's queue, a timeout no test reaches unless it rolls the app."""
    from ray import serve

    tmp = tmp_path_factory.mktemp("prod-limits")
    config = serving(BASELINE, "keep_baseline")
    config = config.model_copy(update={"replica": config.replica.model_copy(update={"extra_flags": HANG})})
    (tmp / "serving.json").write_text(config.model_dump_json())
    (tmp / "keys.txt").write_text(KEY + "\n")
    base_url = connect_ray("production-limits-test")
    settings = ProductionSettings(config_file=str(tmp / "serving.json"), require_auth=True,
                                  api_key_file=str(tmp / "keys.txt"), max_ongoing_requests=1, max_queued_requests=1,
                                  retry_after_s=7, request_timeout_s=3600)
    deploy(settings)
    yield base_url, settings
    serve.delete(settings.app_name)


def test_a_full_queue_is_an_explicit_429_with_retry_after(held):
    base_url, settings = held
    room = settings.max_ongoing_requests + settings.max_queued_requests  # in the ingress + waiting in Serve

    async def one_more_than_room() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=300,
                                     headers={"Authorization": f"Bearer {KEY}"}) as http:
            calls = [asyncio.create_task(http.post("/v1/completions", json=BODY)) for _ in range(room + 1)]
            # None is ever answered by the engine: what comes back is what the endpoint refused.
            done, pending = await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
            for call in pending:  # closing these connections frees the ingress and the engine
                call.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            return [call.result() for call in done]

    answered = asyncio.run(one_more_than_room())
    assert answered, "no request was refused: the extra one hung"
    for response in answered:
        assert response.status_code == 429, (response.status_code, response.text)
        assert response.headers.get("retry-after") == str(settings.retry_after_s), response.headers


def test_a_request_past_the_timeout_gets_504_naming_the_limit(held):
    base_url, settings = held
    deploy(settings.model_copy(update={"request_timeout_s": 2.0}))  # roll: a new ingress and engine, same fault
    api = client(base_url)
    for stream in (False, True):  # held before the first byte: a stream gets the same 504 (no event sent yet)
        with pytest.raises(openai.APIStatusError) as err:
            answer = api.completions.create(**BODY, stream=stream)
            if stream:
                list(answer)
        assert err.value.status_code == 504, err.value
        assert "request_timeout_s=2" in err.value.message and "cancelled" in err.value.message
    # the one ingress slot is free again after a timeout: the endpoint still answers
    models = httpx.get(f"{base_url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert models.status_code == 200, models.text
