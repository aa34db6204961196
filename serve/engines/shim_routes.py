"""What the shims in front of another server (`llama_cpp/server.py`, `vllm/server.py`) share: every route they do
not translate is handed to the server behind them as it came, streamed or whole, and counted as in flight so that a
flush waits for it; and SGLang's SSE framing of the events they do translate."""

from __future__ import annotations

import json
from contextlib import AbstractAsyncContextManager
from typing import Any, AsyncIterator, Protocol

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

__all__ = ["HOP_HEADERS", "ForwardingShim", "Totals", "add_forward_route", "sse_event"]

# per-connection headers: the shim's own connection sets them, passing them on would describe the wrong one
HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "host", "keep-alive"}


class ForwardingShim(Protocol):
    ready: bool
    client: httpx.AsyncClient | None

    def tracked(self) -> AbstractAsyncContextManager[None]: ...


class Totals:
    """Counters since the last flush, for `/server_info`'s `avg_spec_accept_length` (SGLang reports one too)."""

    def __init__(self) -> None:
        self.completion_tokens = 0
        self.verify_steps = 0
        self.requests = 0

    def add(self, meta: dict[str, Any]) -> None:
        self.requests += 1
        if "spec_verify_ct" in meta:
            self.completion_tokens += int(meta["completion_tokens"])
            self.verify_steps += int(meta["spec_verify_ct"])

    def internal_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"requests_since_flush": self.requests}
        if self.verify_steps:
            state["avg_spec_accept_length"] = self.completion_tokens / self.verify_steps
        return state


def sse_event(data: Any) -> bytes:
    """One SSE event: a string as it is (`[DONE]`), anything else as JSON."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


def add_forward_route(app: FastAPI, shim: ForwardingShim) -> None:
    """Route every path not routed before this call to the server behind `shim` (register it last)."""

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        if not shim.ready or shim.client is None:
            return JSONResponse({"error": {"message": "engine not ready"}}, status_code=503)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        upstream = shim.client.build_request(request.method, f"/{path}", params=request.query_params,
                                             content=await request.body(), headers=headers)
        async with shim.tracked():
            response = await shim.client.send(upstream, stream=True)
            out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}
            if "text/event-stream" not in response.headers.get("content-type", ""):
                content = await response.aread()
                await response.aclose()
                return Response(content, status_code=response.status_code, headers=out_headers)

        async def relay() -> AsyncIterator[bytes]:
            async with shim.tracked():
                try:
                    async for chunk in response.aiter_raw():
                        yield chunk
                finally:
                    await response.aclose()

        return StreamingResponse(relay(), status_code=response.status_code, headers=out_headers)
