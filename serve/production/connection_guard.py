"""Connection limits of Serve's HTTP proxy: a deadline for a request's headers, a cap on the connections one client
address holds, and a cap on all of them below the proxy's open-file limit.

Why: Ray Serve 2.60's proxy runs uvicorn (httptools), which never times out a request whose headers are still
arriving (its keep-alive timeout starts only after a response) and accepts connections until the process runs out
of file descriptors. One client holding ~20,000 sockets that each sent `GET /health HTTP/1.1\\r\\n` and nothing more
exhausted the proxy's open-file limit, and every other client then failed until those sockets closed.

How: `ConnectionGuard` is an ASGI middleware that Serve's proxy gets from Ray's proxy callback
(`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` naming `proxy_middlewares`, with the limits as JSON in
`SPECDEC_CONNECTION_LIMITS`; `python -m serve.production` sets both in its local Ray's environment, see
`proxy_environment`; Ray 2.60 refuses `http_options.middlewares`). Serve builds the middleware chain inside the proxy
process before uvicorn loads its HTTP protocol class, so the constructor swaps uvicorn's `auto` protocol for
`GuardedHttpTools`, a subclass that:
- closes a connection whose request headers are not complete `header_timeout_s` after it opened or after the
  request began (408, then close), so a half-sent header holds its socket for seconds, not forever;
- answers 503 + Retry-After and closes a new connection from an address that already holds
  `max_connections_per_client`, or any new one while the proxy holds `max_connections` (default: the open-file
  limit less a quarter of it, at most 2,048 kept for Ray's own files), so the proxy keeps the descriptors it needs
  to serve everyone else.
The middleware itself passes every request through untouched. The decisions are `refusal` and `default_max_connections`
(pure); the rest is the protocol's bookkeeping. Checked against uvicorn 0.55 (pinned with Ray 2.60).
"""

from __future__ import annotations

import asyncio
import os
import resource
from collections import Counter
from collections.abc import MutableMapping
from typing import Any, ClassVar

from pydantic import Field

from serve.spec import FrozenModel

__all__ = ["ConnectionLimits", "ConnectionGuard", "GuardedHttpTools", "refusal", "default_max_connections",
           "proxy_middlewares", "proxy_environment", "CALLBACK_ENV", "CALLBACK", "LIMITS_ENV"]

CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"  # Ray calls it in each proxy process at its start
CALLBACK = "serve.production.connection_guard:proxy_middlewares"
LIMITS_ENV = "SPECDEC_CONNECTION_LIMITS"

REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nRetry-After: 1\r\nConnection: close\r\n"
           b"Content-Length: %d\r\n\r\n%s")
TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain\r\nConnection: close\r\n"
             b"Content-Length: %d\r\n\r\n%s")


class ConnectionLimits(FrozenModel):
    """What `GuardedHttpTools` enforces (ProductionSettings' header_timeout_s, max_connections_per_client,
    max_connections)."""

    header_timeout_s: float = Field(10.0, gt=0)
    max_connections_per_client: int = Field(1000, ge=1)
    max_connections: int | None = Field(None, ge=1)


def default_max_connections(open_files: int) -> int:
    """Connections the proxy may hold with this open-file limit: all but a quarter of it (at most 2,048), which
    Ray's own sockets and files keep."""
    return max(1, open_files - min(2048, open_files // 4))


def refusal(limits: ConnectionLimits, total: int, from_client: int, cap: int) -> str | None:
    """Why a new connection is refused (the proxy holds `total`, `from_client` of them from its address; `cap` is
    the effective total cap), or None to accept it. Pure."""
    if from_client >= limits.max_connections_per_client:
        return (f"this address already holds {from_client} connections (max_connections_per_client="
                f"{limits.max_connections_per_client}); close idle ones or retry")
    if total >= cap:
        return f"the endpoint holds {total} connections (max_connections={cap}); retry"
    return None


def _reply(template: bytes, text: str) -> bytes:
    body = text.encode() + b"\n"
    return template % (len(body), body)


def _httptools_protocol() -> type[asyncio.Protocol]:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    return HttpToolsProtocol


class GuardedHttpTools(_httptools_protocol()):  # type: ignore[misc]
    """uvicorn's httptools protocol with the limits of `ConnectionLimits` (class state: one proxy per process)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    cap: ClassVar[int] = default_max_connections(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    held: ClassVar[Counter[str]] = Counter()  # open connections per client address
    total: ClassVar[int] = 0

    admitted = False
    deadline: asyncio.TimerHandle | None = None
    peer = ""

    @classmethod
    def configure(cls, limits: ConnectionLimits) -> None:
        cls.limits = limits
        cls.cap = limits.max_connections or default_max_connections(resource.getrlimit(resource.RLIMIT_NOFILE)[0])

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if isinstance(peer, (tuple, list)) and peer else ""
        why = refusal(self.limits, GuardedHttpTools.total, self.held[self.peer], self.cap)
        if why is not None:
            transport.write(_reply(REFUSED, why))
            transport.close()
            return
        self.admitted = True
        self.held[self.peer] += 1
        GuardedHttpTools.total += 1
        super().connection_made(transport)
        self.arm()

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.admitted:
            return
        self.admitted = False
        self.disarm()
        self.held[self.peer] -= 1
        GuardedHttpTools.total -= 1
        if self.held[self.peer] <= 0:
            del self.held[self.peer]
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.arm()  # a request on a kept-alive connection gets the same deadline for its headers

    def on_headers_complete(self) -> None:
        self.disarm()
        super().on_headers_complete()

    def arm(self) -> None:
        self.disarm()
        self.deadline = self.loop.call_later(self.limits.header_timeout_s, self.headers_too_slow)

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def headers_too_slow(self) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.arm()  # a pipelined request began while the previous answer is still being sent: not idle
            return
        self.transport.write(_reply(TIMED_OUT, f"request headers not complete within header_timeout_s="
                                               f"{self.limits.header_timeout_s:g}"))
        self.transport.close()


class ConnectionGuard:
    """ASGI middleware that installs `GuardedHttpTools` as uvicorn's `auto` HTTP protocol in the process that builds
    it (Serve's proxy, before its uvicorn server loads the protocol class); requests pass through untouched."""

    def __init__(self, app: Any, header_timeout_s: float = 10.0, max_connections_per_client: int = 1000,
                 max_connections: int | None = None) -> None:
        import uvicorn.protocols.http.auto as auto

        self.app = app
        GuardedHttpTools.configure(ConnectionLimits(header_timeout_s=header_timeout_s,
                                                    max_connections_per_client=max_connections_per_client,
                                                    max_connections=max_connections))
        auto.AutoHTTPProtocol = GuardedHttpTools

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


def proxy_middlewares() -> list[Any]:
    """Ray's proxy callback (`CALLBACK_ENV`): the guard with the limits of `LIMITS_ENV` (defaults without it)."""
    from starlette.middleware import Middleware

    limits = ConnectionLimits.model_validate_json(os.environ.get(LIMITS_ENV) or "{}")
    return [Middleware(ConnectionGuard, **limits.model_dump())]


def proxy_environment(env: MutableMapping[str, str], limits: ConnectionLimits) -> str | None:
    """Set in `env` (the environment a local Ray starts with) what installs the guard in Serve's proxy. Returns why
    it could not (another proxy callback is configured already, which is kept), or None."""
    if env.get(CALLBACK_ENV, CALLBACK) != CALLBACK:
        return (f"{CALLBACK_ENV} is set to {env[CALLBACK_ENV]!r}: the proxy's connection limits "
                f"({CALLBACK}) are not installed; return its middlewares from your callback too")
    env[CALLBACK_ENV] = CALLBACK
    env[LIMITS_ENV] = limits.model_dump_json()
    return None
