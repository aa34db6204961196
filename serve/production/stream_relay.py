"""Relaying an engine's SSE stream to the client of the production endpoint, to the end or to a clean error.

A stream always ends in a way an OpenAI client understands: the engine's own `[DONE]`, or, when the deadline
(`request_timeout_s`) passes or the engine goes away mid-answer, one error event in OpenAI's error shape followed by
`data: [DONE]`. Leaving the relay (client gone, deadline, engine failure) cancels the Serve handle call, which closes
the engine connection, which cancels the generation.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from serve.http_errors import error_body, failure_answer

__all__ = ["error_event", "relay", "leaving"]

_KINDS = {503: "service_unavailable", 504: "timeout_error"}


def leaving() -> bool:
    """Whether this task is being cancelled (its client left), whatever the awaited call turned that into."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def error_event(status: int, message: str, after_partial: bool = False) -> bytes:
    """An SSE error event then `[DONE]`; `after_partial`: the last chunk sent ended mid-event, so it is closed
    first (a client would otherwise glue the error to a cut line)."""
    kind = _KINDS.get(status, "server_error")
    return (("\n\n" if after_partial else "") + "data: " + json.dumps(error_body(status, message, kind))
            + "\n\ndata: [DONE]\n\n").encode()


async def relay(stream: Any, timeout_s: float, release: Callable[[], None],
                failed: Callable[[int], None]) -> AsyncIterator[bytes]:
    """Yield the chunks of `stream` (a Serve streaming handle call past its first item) within `timeout_s`;
    `failed(status)` is called when the relay ends the stream with an error event (for the metrics), `release`
    when the request is no longer in flight."""
    deadline = time.monotonic() + timeout_s
    tail = b"\n\n"
    try:
        while True:
            left = deadline - time.monotonic()
            try:
                # In this task, not one of its own (`asyncio.wait_for`), whose exception would go unretrieved when
                # the client leaves and Serve cancels the handle call ("Task exception was never retrieved")
                async with asyncio.timeout(max(left, 0.001)):
                    chunk = await stream.__anext__()
            except StopAsyncIteration:
                return
            except asyncio.TimeoutError:
                failed(504)
                yield error_event(504, f"the request took longer than request_timeout_s={timeout_s:g}; it was "
                                       "cancelled", not tail.endswith(b"\n\n"))
                return
            except Exception as exc:  # noqa: BLE001 - any failure of the engine side ends the stream cleanly
                if leaving():  # the client left: Serve cancelled the call (RequestCancelledError), nobody reads on
                    raise asyncio.CancelledError from None
                status, message = failure_answer(exc)
                failed(status)
                yield error_event(status, f"{message}; the answer is incomplete, retry the request",
                                  not tail.endswith(b"\n\n"))
                return
            if chunk:
                tail = (tail + chunk)[-2:]
            yield chunk
    finally:
        stream.cancel()
        release()
