"""Forwarding one generation request to an engine deployment and turning its answer into the client's, streamed or
not (`serve/production/ingress.py` decides which engine and counts the request; this module is the call itself).

A production engine's busy answer (its queue full) is a 429 with Retry-After, an error answer is relayed in OpenAI's
shape, a stream goes through `serve.production.stream_relay.relay` (deadline, clean end) and
`serve.closed_loop.live_stream.metered` (the live record). A candidate's engine (`candidate`) that answers anything
but a whole answer before its first byte raises instead (`CandidateUnfit`, or the handle's own error), so that the
ingress can give the request to production; its stream is wrapped in `serve.closed_loop.failover.Takeover`.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import Response, StreamingResponse

from serve.closed_loop.failover import CandidateUnfit, Takeover
from serve.closed_loop.live_book import LiveBook
from serve.closed_loop.live_stream import Added, Measure, metered
from serve.http_errors import busy_response
from serve.production.ingress_support import MAX_ERROR_BODY_BYTES, IngressMetrics, engine_error
from serve.production.settings import ProductionSettings
from serve.production.stream_relay import relay

__all__ = ["generate", "Takeover"]

HEADERS = {"content-type": "application/json"}


async def generate(engine: Any, path: str, body: bytes, streaming: bool, release: Callable[[], None],
                   measure: Measure, added: Added, settings: ProductionSettings, metrics: IngressMetrics,
                   live: LiveBook, takeover: Callable[[Any], Takeover] | None = None) -> Response:
    """Forward one generation request to `engine`; `release` is called when it is no longer in flight; the answer
    is measured into `measure` (a 200 stream records its live record itself when it ends). `takeover` given: the
    engine is a canary's candidate (module docstring)."""
    candidate = takeover is not None
    if streaming:
        stream = engine.options(stream=True).call_stream.remote("POST", path, body, HEADERS)
        try:
            status, ctype = await stream.__anext__()
        except BaseException:  # client gone, request_timeout_s, or the engine is down before the first byte
            stream.cancel()
            raise
        if candidate and (status in (429, 503) or status >= 500):
            stream.cancel()
            raise CandidateUnfit(status)
        if status in (429, 503):  # the engine refused before streaming (its waiting queue is full)
            stream.cancel()
            release()
            return busy_response("the engine's queue is full", settings.retry_after_s)
        if status != 200:  # an error answer (400 ...): relayed whole, as a plain response
            payload = b""
            try:
                async for chunk in stream:
                    payload += chunk
                    if len(payload) > MAX_ERROR_BODY_BYTES:
                        break
            finally:
                stream.cancel()
                release()
            return engine_error(status, payload[:MAX_ERROR_BODY_BYTES])

        def failed(code: int) -> None:
            metrics.stream_errors.labels(path, str(code)).inc()

        source = takeover(stream) if takeover is not None else stream
        chunks = relay(source, settings.request_timeout_s, release, failed)
        # A generator never iterated (the client left before the body was sent) runs no `finally`: release the
        # in-flight count when it is collected, or the router would count that request forever.
        weakref.finalize(chunks, release)
        measure.metered = True
        body_out = metered(chunks, measure, added, lambda m, at: live.record(m, 200, at))
        return StreamingResponse(body_out, status_code=status, media_type=ctype or "text/event-stream")
    response = engine.call.remote("POST", path, body, HEADERS)
    try:
        status, ctype, payload = await response
    except asyncio.CancelledError:  # client gone or request_timeout_s: stop the generation too
        response.cancel()
        raise
    finally:
        release()
    if candidate and (status in (429, 503) or status >= 500):
        raise CandidateUnfit(status)
    if status in (429, 503):
        return busy_response("the engine's queue is full", settings.retry_after_s)
    if status != 200:
        return engine_error(status, payload)
    payload = measure.answer(payload, time.monotonic(), added)
    return Response(payload, status_code=status, media_type=ctype or None)


async def production_stream(engine: Any, path: str, body: bytes) -> Any:
    """`engine`'s stream for a request production takes over, past its status item (EngineUnavailable unless 200)."""
    from serve.http_errors import EngineUnavailable

    stream = engine.options(stream=True).call_stream.remote("POST", path, body, HEADERS)
    try:
        status, _ = await stream.__anext__()
    except BaseException:
        stream.cancel()
        raise
    if status != 200:
        stream.cancel()
        raise EngineUnavailable(f"production answered {status} when it took over from the failed candidate")
    return stream


def takeover_for(restart: Callable[[], Awaitable[Any]], may_resume: bool,
                 failed: Callable[[str], None]) -> Callable[[Any], Takeover]:
    """The `takeover` argument of `generate` for a candidate's request."""
    return lambda stream: Takeover(stream, restart, may_resume, failed)
