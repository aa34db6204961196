"""The HTTP client a replica uses to talk to its own engine process (127.0.0.1), and what its failures mean.

- An engine that has exited, refuses connections or drops one is `EngineUnavailable` (the ingress answers 503 with
  Retry-After; a stream in flight ends with an error event and `[DONE]`), never a bare transport error.
- A request sent on an idle pooled connection that the engine closes instead of answering is sent again, once.
  That happens when the engine was paused (SIGSTOP, a long GC, a swapped-out host) past its keep-alive timeout: at
  resume it closes the idle connection without reading the request that arrived meanwhile. Only a failure before
  any response byte is retried, so an answer is never duplicated mid-stream.
- Idle connections are dropped by the client after `KEEPALIVE_EXPIRY_S`, before the engine's own keep-alive
  (uvicorn's and SGLang's 5 s) closes them under a request.
No read timeout here: the ingress bounds every request (`request_timeout_s`, `/health`'s own bound) and cancels it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import httpx

from serve.http_errors import EngineUnavailable

__all__ = ["KEEPALIVE_EXPIRY_S", "new_client", "call", "call_stream", "EngineUnavailable"]

KEEPALIVE_EXPIRY_S = 2.0
# Raised by `send` when the peer closed or reset the connection before a response: the idle-connection race.
_RESET = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)

Status = Callable[[], str | None]  # why the engine is not running now (None: it runs)


def new_client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None, connect=10),
                             limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))


async def _send(client: httpx.AsyncClient, request: httpx.Request, down: Status) -> httpx.Response:
    """`client.send(request, stream=True)`, retried once on a reset before the response; EngineUnavailable when
    the engine is not running or cannot be reached."""
    reason = down()
    if reason:
        raise EngineUnavailable(reason)
    for attempt in (1, 2):
        try:
            return await client.send(request, stream=True)
        except _RESET as exc:
            reason = down()
            if attempt == 2 or reason:
                raise EngineUnavailable(reason or f"the engine closed the connection without answering "
                                                  f"({type(exc).__name__})") from None
        except httpx.ConnectError as exc:
            raise EngineUnavailable(down() or f"the engine refuses connections ({type(exc).__name__})") from None
    raise AssertionError("unreachable")  # pragma: no cover


async def call(client: httpx.AsyncClient, down: Status, method: str, path: str, body: bytes = b"",
               headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    """One engine request, whole response: (status, content type, body)."""
    response = await _send(client, client.build_request(method, path, content=body, headers=headers or {}), down)
    try:
        payload = await response.aread()
    except httpx.TransportError as exc:
        raise EngineUnavailable(down() or f"the engine dropped the connection mid-answer ({type(exc).__name__})") \
            from None
    finally:
        await response.aclose()
    return response.status_code, response.headers.get("content-type", ""), payload


async def call_stream(client: httpx.AsyncClient, down: Status, method: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None) -> AsyncIterator[tuple[int, str] | bytes]:
    """Streaming engine request: yields (status, content type) first, then the raw body chunks."""
    response = await _send(client, client.build_request(method, path, content=body, headers=headers or {}), down)
    try:
        yield response.status_code, response.headers.get("content-type", "")
        try:
            async for chunk in response.aiter_raw():
                yield chunk
        except httpx.TransportError as exc:
            raise EngineUnavailable(down() or f"the engine dropped the stream mid-answer ({type(exc).__name__})") \
                from None
    finally:
        await response.aclose()
