"""Parts of the production ingress (`serve/production/ingress.py`) that need no replica state: its metrics, the bind address
Serve's proxy uses, bounded handle calls, an engine's error answer in OpenAI's shape, and a streamed body's timing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from serve.http_errors import error_response

__all__ = ["MAX_ERROR_BODY_BYTES", "serve_bind_host", "IngressMetrics", "timed", "bounded", "engine_message",
           "engine_error", "explain_filled"]

MAX_ERROR_BODY_BYTES = 64_000  # an engine's error answer relayed whole; a bigger one is cut


def serve_bind_host() -> str | None:
    """The address Serve's HTTP proxy binds (from `serve.start` or the config file's `http_options`); None if
    the controller cannot be asked."""
    try:
        from ray.serve.context import _get_global_client

        client = _get_global_client()
        return None if client is None else str(client.http_config.host)
    except Exception:  # noqa: BLE001 - any failure means "unknown", which the caller treats as public
        return None


class IngressMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("specdec_requests", "requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.latency = Histogram("specdec_request_latency_seconds", "end-to-end latency", ["route"],
                                 registry=self.registry)
        self.accept = Gauge("specdec_engine_accept_length", "engine avg speculative accept length since start",
                            registry=self.registry)
        self.routed = Counter("specdec_routed_requests", "generation requests by serving-policy route", ["route"],
                              registry=self.registry)
        self.in_flight = Gauge("specdec_in_flight_requests", "generation requests in flight at this ingress",
                               registry=self.registry)
        # as the replica that answered reports them (SGLang reports what it has; absent keys stay unset)
        self.engine_requests = Gauge("specdec_engine_requests", "engine requests by state: running, waiting, "
                                     "finished (since start or flush)", ["state"], registry=self.registry)
        # a stream already answered 200 and then ended by an error event (timeout 504, engine gone 503)
        self.stream_errors = Counter("specdec_stream_errors", "streams ended by an error event, by route and "
                                     "status", ["route", "status"], registry=self.registry)

    def engine_state(self, server_info: bytes) -> None:
        """The gauges of an engine's `/server_info` (keys it does not report stay as they were)."""
        states = json.loads(server_info).get("internal_states") or [{}]
        accept = states[0].get("avg_spec_accept_length")
        if isinstance(accept, (int, float)):
            self.accept.set(accept)
        for state, key in (("running", "num_running_reqs"), ("waiting", "num_waiting_reqs"),
                           ("finished", "num_finished_requests")):
            value = states[0].get(key)
            if isinstance(value, (int, float)):
                self.engine_requests.labels(state).set(value)


async def timed(chunks: AsyncIterator[Any], done: Callable[[], None]) -> AsyncIterator[Any]:
    """Pass a streamed body through; `done()` when it ends however it ends (a stream's latency ends at its last
    byte, not at its first)."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        done()


async def bounded(call: Any, timeout_s: float) -> Any:
    """Await a Serve handle call for at most `timeout_s`; on timeout (or cancellation) the call is cancelled too.
    Awaited in this task (`asyncio.timeout`), not in a task of its own: `asyncio.wait_for` leaves the exception of
    the inner task it cancels unretrieved (Serve's cancelled handle call raises RequestCancelledError), and asyncio
    then logs "Task exception was never retrieved"."""
    try:
        async with asyncio.timeout(timeout_s):
            return await call
    except (asyncio.TimeoutError, asyncio.CancelledError):
        call.cancel()
        raise


def engine_message(payload: bytes) -> str | None:
    """The message of an engine's error body (OpenAI's, SGLang's or the CPU engine's shape), None if unreadable."""
    try:
        data = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    message = error.get("message") if isinstance(error, dict) else data.get("message")
    return message if isinstance(message, str) else None


def engine_error(status: int, payload: bytes) -> Response:
    """An engine's error answer in OpenAI's shape (the CPU engine's, SGLang's and llama-server's differ)."""
    message = engine_message(payload) or f"the engine answered {status}"
    return error_response(status, message, "invalid_request_error" if status < 500 else "server_error")


def explain_filled(response: Response, filled: int) -> Response:
    """The engine refused a request whose max_tokens the endpoint filled in (a long chat prompt leaves less
    room than the endpoint's limit): say so, since the client never sent the field the engine names."""
    message = engine_message(bytes(response.body)) or "the engine refused the request"
    return error_response(400, f"{message} (the request had no max_tokens, so this endpoint applied "
                               f"max_tokens={filled}, its max_tokens_limit; send a max_tokens that fits)",
                          "invalid_request_error")
