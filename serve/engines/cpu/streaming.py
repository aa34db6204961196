"""What the native and the OpenAI routes share: a submitted request seen from the event loop (`RequestStream`),
cancelling it when the client goes away, JSON bodies, error bodies and SSE framing.

A stream keeps only the newest state of its request (a one-slot mailbox), so a slow reader costs no memory and the
worker never copies `output_ids`: a `Snapshot` holds the request and how many tokens were out at that step, and
slices them only when a route reads them.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse

from serve.engines.cpu.decode import Request
from serve.engines.cpu.params import BadRequest
from serve.http_limits import BadJson, parse_json

__all__ = ["Snapshot", "RequestStream", "collect", "read_json", "error_response", "sse", "RETRY_AFTER_S"]

RETRY_AFTER_S = 2  # what a refused client is told to wait (429 Retry-After)


@dataclass(frozen=True)
class Snapshot:
    """A request's state after one of its steps."""

    req: Request
    count: int  # len(output_ids) at that step
    finished: bool
    meta_info: dict
    error: str | None = None

    @property
    def output_ids(self) -> list[int]:
        # the worker only appends, so the first `count` ids are what they were at that step
        return self.req.output_ids[: self.count]


class RequestStream:
    """Submits `req` at once (so QueueFull/TooLarge surface before any response starts), then yields the newest
    snapshot each time the reader asks, until the request finishes or fails. `close()` cancels it if unfinished."""

    def __init__(self, engine: Any, req: Request, internal: bool = False) -> None:
        loop = asyncio.get_running_loop()
        speculative = engine.speculative
        draft_tokens = engine.config.server_args()["speculative_num_draft_tokens"]
        self._engine = engine
        self._event = asyncio.Event()
        self._lock = threading.Lock()
        self._latest: Snapshot | None = None
        self._wake_pending = False
        self._done = False

        def sink(r: Request, error: str | None) -> None:  # worker thread
            snap = Snapshot(r, len(r.output_ids), r.finished or error is not None,
                            r.meta_info(speculative, draft_tokens), error)
            with self._lock:
                self._latest = snap
                if self._wake_pending:
                    return
                self._wake_pending = True
            try:
                loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

        self.ticket = engine.scheduler.submit(req, sink, internal=internal)

    async def __aiter__(self) -> AsyncIterator[Snapshot]:
        try:
            while not self._done:
                await self._event.wait()
                self._event.clear()
                with self._lock:
                    snap, self._latest, self._wake_pending = self._latest, None, False
                if snap is None:
                    continue
                self._done = snap.finished
                yield snap
        finally:
            self.close()

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._engine.scheduler.cancel(self.ticket)


async def _wait_disconnect(http: HttpRequest) -> None:
    # The body is read already: the next ASGI message is the disconnect (or the end of the exchange).
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def collect(stream: RequestStream, http: HttpRequest) -> Snapshot | None:
    """The final snapshot of a non-streamed request; None if the client disconnected first (the request is then
    cancelled: a dropped client must not keep the engine decoding for nobody)."""

    async def last() -> Snapshot | None:
        final = None
        async for snap in stream:
            final = snap
        return final

    work = asyncio.ensure_future(last())
    gone = asyncio.ensure_future(_wait_disconnect(http))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        work.cancel()
        stream.close()
        return None
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            stream.close()


async def read_json(http: HttpRequest) -> Any:
    """The body as strict JSON (`serve.http_limits.parse_json`: no NaN/Infinity, no overflow to infinity, bounded
    nesting and integer size): anything else is a 400, never a RecursionError or ValueError 500."""
    body = await http.body()
    try:
        return parse_json(body)
    except BadJson as err:
        raise BadRequest(f"body: {err}") from None


def error_response(message: str, status: int = 400, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status, headers=headers)


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
