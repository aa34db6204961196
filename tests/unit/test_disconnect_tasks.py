"""A client that leaves mid-answer leaves no "Task exception was never retrieved" in the ingress log (issue #63 item
9). Serve cancels a request's handle calls when its client leaves, and an awaited call that was cancelled raises
`RequestCancelledError` rather than `CancelledError`; `asyncio.wait_for` ran the call in a task of its own and, once
cancelled, never read that task's exception, which asyncio logs with a traceback when the task is collected.

`ServeCall` stands in for Serve's handle call only in what matters here, which is Ray 2.60's own code
(ray/serve/handle.py: `DeploymentResponse.__await__`, `DeploymentResponseGenerator.__anext__`): waiting, and
turning a cancellation into `RequestCancelledError` once `cancel()` was called on it. The relay and the bounded call are
the ingress's own; the log is asyncio's exception handler, collected with `gc.collect()`.
"""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from ray.serve.exceptions import RequestCancelledError

from serve.production.ingress_support import bounded
from serve.production.stream_relay import relay


class ServeCall:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True

    async def wait(self) -> Any:
        try:
            await asyncio.get_running_loop().create_future()  # the engine's answer, which never comes
        except asyncio.CancelledError:
            if self.cancelled:  # as Ray's handle does
                raise RequestCancelledError("req") from None
            raise

    def __await__(self):
        return self.wait().__await__()

    async def __anext__(self) -> bytes:
        return await self.wait()


def unretrieved(consume) -> list[str]:
    """Run `consume(call)` in a task, cancel it as a leaving client does, collect; what asyncio logged."""
    logged: list[str] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, context: logged.append(context["message"]))
        call = ServeCall()
        task = asyncio.ensure_future(consume(call))
        for _ in range(5):
            await asyncio.sleep(0)  # the consumer is waiting on the call now
        call.cancel()  # Serve cancels a request's handle calls with the request
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        del task
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(scenario())
    return logged


async def read_stream(call: ServeCall) -> None:
    async for _ in relay(call, 60.0, lambda: None, lambda status: None):
        pass


async def await_bounded(call: ServeCall) -> None:
    await bounded(call, 60.0)


def test_a_client_leaving_a_stream_leaves_no_unretrieved_task():
    assert unretrieved(read_stream) == []


def test_a_client_leaving_a_bounded_call_leaves_no_unretrieved_task():
    assert unretrieved(await_bounded) == []


def test_a_relay_that_runs_past_its_deadline_still_ends_with_a_504_event():
    async def scenario() -> list[bytes]:
        return [chunk async for chunk in relay(ServeCall(), 0.05, lambda: None, lambda status: None)]

    events = asyncio.run(scenario())
    assert len(events) == 1 and b'"code": 504' in events[0] and events[0].endswith(b"data: [DONE]\n\n")
