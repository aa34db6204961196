"""The llama.cpp engine process: a small shim in front of `llama-server` that speaks the tuner's protocol.

`python -m serve.engines.llama_cpp --host H --port P --spec JSON [--dynamic-lookup-cache] -- LLAMA-SERVER-ARGV...`

The shim starts llama-server as its child on a private port (same process group, so the replica's and the watchdog's
`killpg` end both), with llama-server's output in the shim's output (= the engine log), and serves:
- `GET /health`: 200 once llama-server answers its own `/health`, 503 before;
- `GET /server_info`: the spec as requested (llama.cpp has no SGLang ServerArgs; `speculative_algorithm` is our
  algorithm name so the trial's effective-settings diff works), `max_running_requests` = llama-server's slot count
  read back from `/props`, the exact llama-server command line (what to run in production), its build, `/metrics`'s
  draft counters and `internal_states[0].avg_spec_accept_length` since the last flush;
- `POST /flush_cache?timeout=S`: waits up to S for in-flight requests (400 if they remain, as SGLang answers), then
  restarts llama-server: its KV and prompt caches (what `/slots/<id>?action=erase` clears), every drafter's n-gram
  state, its counters and the dynamic lookup-cache file (a fresh one) all start empty;
- `POST /generate`: SGLang's native route, translated to `/completion` by `protocol.py` (streaming included);
- every other route (`/v1/*` OpenAI routes, `/slots`, `/metrics`, `/props`, `/tokenize`) is forwarded as it is.
If llama-server exits on its own, the shim exits with its code, so the replica sees a dead engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serve.engines.child import ChildServer
from serve.engines.llama_cpp import protocol
from serve.engines.shim_routes import Totals, add_forward_route, sse_event
from serve.spec import NoSpec, parse_spec
from serve.sse import SseDecoder

READY_POLL_S = 0.2
STOP_GRACE_S = 10.0


def _say(message: str) -> None:
    print(f"[llama-cpp shim] {message}", file=sys.stderr, flush=True)


class Child(ChildServer):
    """One llama-server run. `start` picks a port and (if asked) a fresh dynamic lookup-cache file."""

    def __init__(self, argv: list[str], dynamic_cache: bool, workdir: Path) -> None:
        super().__init__(argv, name="llama-server", say=_say, ready_poll_s=READY_POLL_S, stop_grace_s=STOP_GRACE_S)
        self.dynamic_cache = dynamic_cache
        self.workdir = workdir

    def run_argv(self) -> list[str]:
        if not self.dynamic_cache:
            return []
        cache = self.workdir / f"lookup-dynamic-{self.starts}.bin"
        # llama-server aborts on a missing cache file ("Couldn't read dynamic lookup cache"); an empty one is an
        # empty cache
        cache.write_bytes(b"")
        return ["--lookup-cache-dynamic", str(cache)]


class Shim:
    """State of the shim: the child, requests in flight, counters since the last flush."""

    def __init__(self, spec: Any, child: Child, ready_timeout_s: float) -> None:
        self.spec = spec
        self.speculative = not isinstance(spec, NoSpec)
        self.child = child
        self.ready_timeout_s = ready_timeout_s
        self.ready = False
        self.restarting = False
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.totals = Totals()
        self.client: httpx.AsyncClient | None = None
        self.props: dict[str, Any] = {}

    async def start_child(self) -> None:
        self.ready = False
        self.child.start()
        await self.child.wait_ready(self.ready_timeout_s)
        if self.client is not None:
            await self.client.aclose()
        self.client = httpx.AsyncClient(base_url=self.child.url, timeout=httpx.Timeout(None, connect=10))
        self.props = (await self.client.get("/props")).json()
        self.totals = Totals()
        self.ready = True

    @contextlib.asynccontextmanager
    async def tracked(self) -> AsyncIterator[None]:
        self.inflight += 1
        self.idle.clear()
        try:
            yield
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()

    async def watch_child(self) -> None:
        """Exit with llama-server's code if it dies on its own (not during a flush's restart)."""
        while True:
            await asyncio.sleep(0.5)
            process = self.child.process
            if not self.restarting and process is not None and process.poll() is not None:
                _say(f"llama-server exited with code {process.returncode}; the shim exits too")
                os._exit(process.returncode or 1)

    async def metrics(self) -> dict[str, float]:
        """llama-server's draft counters from `/metrics` (server-side, since its start = since the last flush)."""
        assert self.client is not None
        out: dict[str, float] = {}
        with contextlib.suppress(httpx.HTTPError, ValueError):
            for line in (await self.client.get("/metrics", timeout=10)).text.splitlines():
                if line.startswith(("llamacpp:spec_decode_", "llamacpp:tokens_predicted_total")):
                    name, _, value = line.partition(" ")
                    out[name] = float(value)
        return out

    async def server_info(self) -> dict[str, Any]:
        slots = self.props.get("total_slots")
        info: dict[str, Any] = {
            "engine": "llama_cpp",
            "speculative_algorithm": None if not self.speculative else self.spec.algorithm,
            "max_running_requests": slots,
            "spec": self.spec.model_dump(mode="json"),
            "llama_server_argv": self.child.argv,
            "llama_server_build": self.props.get("build_info"),
            "model_path": self.props.get("model_path"),
            "n_ctx": (self.props.get("default_generation_settings") or {}).get("n_ctx"),
            "llama_metrics": await self.metrics(),
            "internal_states": [self.totals.internal_state()],
        }
        return info


def build_app(shim: Shim) -> FastAPI:
    app = FastAPI()

    @app.on_event("startup")
    async def _start() -> None:
        async def boot() -> None:
            try:
                await shim.start_child()
            except Exception as exc:  # noqa: BLE001 - any start failure ends the engine with its reason in the log
                _say(f"start failed: {exc}")
                shim.child.stop()
                os._exit(3)
            _say(f"ready: llama-server at {shim.child.url}, slots={shim.props.get('total_slots')}")

        asyncio.get_running_loop().create_task(boot())
        asyncio.get_running_loop().create_task(shim.watch_child())

    @app.on_event("shutdown")
    async def _stop() -> None:
        shim.child.stop()

    @app.get("/health")
    async def health() -> Response:
        if shim.restarting:
            # a flush restarts llama-server on purpose (seconds): the engine is not unhealthy, and a failed Serve
            # health check here would replace the replica mid-trial
            return JSONResponse({"status": "flushing"})
        if not shim.ready or shim.client is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        try:
            answer = await shim.client.get("/health", timeout=10)
        except httpx.HTTPError as exc:
            return JSONResponse({"status": f"llama-server unreachable: {exc}"}, status_code=503)
        return Response(answer.content, status_code=answer.status_code, media_type="application/json")

    @app.get("/server_info")
    async def server_info() -> Response:
        if not shim.ready:
            return JSONResponse({"error": "starting"}, status_code=503)
        return JSONResponse(await shim.server_info())

    @app.post("/flush_cache")
    async def flush_cache(timeout: float = 0.0) -> Response:
        if shim.inflight:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(shim.idle.wait(), timeout=max(timeout, 0.0) or 0.001)
        if shim.inflight:
            return JSONResponse({"error": f"{shim.inflight} request(s) in flight; flush refused (SGLang answers "
                                          "the same; pass ?timeout= to wait for idle)"}, status_code=400)
        shim.restarting = True
        try:
            shim.child.stop()
            await shim.start_child()
        finally:
            shim.restarting = False
        return JSONResponse({"flushed": True, "llama_server_starts": shim.child.starts})

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        try:
            body = await request.json()
            llama_body = protocol.completion_body(body)
        except (ValueError, protocol.BadRequest) as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        if not shim.ready or shim.client is None:
            return JSONResponse({"error": {"message": "engine not ready"}}, status_code=503)
        if llama_body["stream"]:
            return await _stream(shim, llama_body)
        started = time.monotonic()
        async with shim.tracked():
            answer = await shim.client.post("/completion", json=llama_body)
        if answer.status_code != 200:
            return Response(answer.content, status_code=answer.status_code, media_type="application/json")
        final = answer.json()
        meta = protocol.meta_info(final, shim.speculative, time.monotonic() - started)
        shim.totals.add(meta)
        return JSONResponse({"text": final.get("content", ""), "output_ids": final.get("tokens") or [],
                             "meta_info": meta})

    add_forward_route(app, shim)
    return app


async def completion_events(answer: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """llama-server's streamed `/completion` answer, one JSON object per SSE event."""
    decoder = SseDecoder()
    async for chunk in answer.aiter_bytes():
        for event in decoder.feed(chunk):
            yield json.loads(event.data)
    for event in decoder.close():
        yield json.loads(event.data)


async def _stream(shim: Shim, llama_body: dict[str, Any]) -> Response:
    """SGLang-style SSE: cumulative text and output_ids per event, counters on the last, then `[DONE]`."""
    assert shim.client is not None
    started = time.monotonic()
    client = shim.client

    async def events() -> AsyncIterator[bytes]:
        text, ids = "", list[int]()
        async with shim.tracked():
            async with client.stream("POST", "/completion", json=llama_body) as answer:
                if answer.status_code != 200:
                    detail = (await answer.aread()).decode("utf-8", "replace")
                    yield sse_event({"error": {"message": f"llama-server answered {answer.status_code}: {detail[:500]}"}})
                    yield sse_event("[DONE]")
                    return
                async for event in completion_events(answer):
                    if "error" in event:
                        yield sse_event(event)
                        break
                    text += event.get("content") or ""
                    ids += event.get("tokens") or []
                    if event.get("stop"):
                        meta = protocol.meta_info(event, shim.speculative, time.monotonic() - started)
                        shim.totals.add(meta)
                    else:
                        meta = protocol.progress_meta(int(event.get("tokens_evaluated", 0)), len(ids))
                    yield sse_event({"text": text, "output_ids": list(ids), "meta_info": meta})
        yield sse_event("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m serve.engines.llama_cpp [options] -- LLAMA-SERVER-ARGV...", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m serve.engines.llama_cpp", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--spec", default='{"algorithm": "none"}', help="the SpecConfig as JSON (what to report)")
    parser.add_argument("--dynamic-lookup-cache", action="store_true", help="fresh --lookup-cache-dynamic per start")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args(argv[:split])
    server_argv = argv[split + 1:]
    if not server_argv:
        parser.error("give llama-server's argv after --")
    spec = parse_spec(json.loads(args.spec))
    workdir = Path(tempfile.mkdtemp(prefix="specdec-llama-"))
    shim = Shim(spec, Child(server_argv, args.dynamic_lookup_cache, workdir), args.ready_timeout)
    # SIGTERM from the replica/watchdog: uvicorn shuts down, the shutdown hook stops llama-server.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import uvicorn

    uvicorn.run(build_app(shim), host=args.host, port=args.port, log_level="warning")
    return 0
