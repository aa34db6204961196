"""The vLLM engine process: a small shim in front of vLLM's OpenAI server that speaks the tuner's protocol.

`python -m serve.engines.vllm --host H --port P --spec JSON --model-name NAME -- VLLM-ARGV...`

The shim starts vLLM's server as its child on a private port (same process group, so the replica's and the
watchdog's `killpg` end it and vLLM's engine-core process), with vLLM's output in the shim's output (= the engine
log), and serves:
- `GET /health`: 200 once vLLM answers its own `/health`, 503 before;
- `GET /server_info`: the spec as requested (`speculative_algorithm` is our algorithm name, so the trial's
  effective-settings diff works), the exact vLLM command line (what to run in production), vLLM's version, its
  speculation counters from `/metrics` since the last flush and `internal_states[0].avg_spec_accept_length`;
- `POST /flush_cache?timeout=S`: waits up to S for in-flight requests (400 if they remain, as SGLang answers), then
  empties vLLM's prefix cache (`/reset_prefix_cache`, served in its dev mode) and starts the counters afresh. vLLM's
  n-gram drafter keeps nothing between requests, so that is all it holds. Suffix decoding keeps earlier requests'
  outputs in its global tree and vLLM 0.32.0 has no route that empties it (`protocol.flush_action`), so a suffix
  server that generated anything since its start is restarted instead (1-4 min on 2 cores; `/health` answers 200
  "flushing" meanwhile, as llama.cpp's shim does, so Serve does not replace the replica). That answer is an event
  stream (`_restart_events`): a comment every few seconds while vLLM starts, then the result;
- `POST /generate`: SGLang's native route, translated to `/v1/completions` by `protocol.py` (streaming included);
- every other route (`/v1/*` OpenAI routes, `/metrics`, `/tokenize`, `/version`) is forwarded as it is.
If vLLM exits on its own, the shim exits with its code, so the replica sees a dead engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from typing import Any, AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from serve.engines.child import ChildServer
from serve.engines.vllm import protocol
from serve.engines.shim_routes import Totals, add_forward_route, sse_event
from serve.spec import NoSpec, parse_spec
from serve.sse import SseDecoder

READY_POLL_S = 0.5
STOP_GRACE_S = 15.0
HEARTBEAT_S = 5.0  # between the comments of a flush's restart stream (the trial's flush waits 35 s for a byte)


def _say(message: str) -> None:
    print(f"[vllm shim] {message}", file=sys.stderr, flush=True)


def child_environment() -> dict[str, str]:
    """vLLM's environment: the shim's, without the project root on PYTHONPATH (vLLM runs from its own venv and must
    not import the project's packages by name)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


class Child(ChildServer):
    """The vLLM server process, on a private port."""

    def __init__(self, argv: list[str]) -> None:
        super().__init__(argv, name="vLLM", say=_say, ready_poll_s=READY_POLL_S, stop_grace_s=STOP_GRACE_S)

    def environment(self) -> dict[str, str]:
        return child_environment()


class Shim:
    """State of the shim: the child, requests in flight, counters since the last flush."""

    def __init__(self, spec: Any, child: Child, model_name: str, ready_timeout_s: float) -> None:
        self.spec = spec
        self.speculative = not isinstance(spec, NoSpec)
        self.child = child
        self.model_name = model_name
        self.ready_timeout_s = ready_timeout_s
        self.ready = False
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.totals = Totals()
        self.metrics_base: dict[str, float] = {}
        self.version: str | None = None
        self.client: httpx.AsyncClient | None = None
        self.restarting = False
        self.starts = 0

    async def start_child(self) -> None:
        self.ready = False
        self.child.start()
        await self.child.wait_ready(self.ready_timeout_s)
        if self.client is not None:
            await self.client.aclose()
        self.client = httpx.AsyncClient(base_url=self.child.url, timeout=httpx.Timeout(None, connect=10))
        self.starts += 1
        self.totals = Totals()
        with contextlib.suppress(httpx.HTTPError, ValueError):
            self.version = (await self.client.get("/version", timeout=10)).json().get("version")
        self.metrics_base = await self.metrics()
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
        """Exit with vLLM's code if it dies on its own (not during a flush's restart)."""
        while True:
            await asyncio.sleep(0.5)
            process = self.child.process
            if not self.restarting and process is not None and process.poll() is not None:
                _say(f"vLLM exited with code {process.returncode}; the shim exits too")
                os._exit(process.returncode or 1)

    async def metrics(self) -> dict[str, float]:
        """vLLM's cumulative speculation counters (since its start)."""
        assert self.client is not None
        with contextlib.suppress(httpx.HTTPError):
            return protocol.spec_metrics((await self.client.get("/metrics", timeout=10)).text)
        return {}

    async def flush_action(self) -> str:
        """`reset` or `restart` (protocol.flush_action), from vLLM's output tokens since its start."""
        assert self.client is not None
        page = (await self.client.get("/metrics", timeout=10)).text
        return protocol.flush_action(self.spec, protocol.generated_tokens(page))

    async def restart(self) -> dict[str, Any]:
        """A new vLLM process: its suffix cache, KV cache and counters all start empty."""
        self.restarting = True
        try:
            self.child.stop()
            await self.start_child()
        finally:
            self.restarting = False
        return {"flushed": True, "restarted": True, "vllm_starts": self.starts}

    async def reset(self) -> dict[str, Any]:
        assert self.client is not None
        answer = await self.client.post("/reset_prefix_cache", timeout=60)
        if answer.status_code != 200:
            raise RuntimeError(f"vLLM's /reset_prefix_cache answered {answer.status_code}: {answer.text[:300]} "
                               "(it is served only with VLLM_SERVER_DEV_MODE=1, which the adapter sets)")
        self.totals = Totals()
        self.metrics_base = await self.metrics()
        return {"flushed": True, "restarted": False, "vllm_starts": self.starts}

    async def server_info(self) -> dict[str, Any]:
        argv = self.child.argv
        seqs = argv[argv.index("--max-num-seqs") + 1] if "--max-num-seqs" in argv else None
        return {
            "engine": "vllm", "version": self.version,
            "speculative_algorithm": self.spec.algorithm if self.speculative else None,
            # what the command line fixed (None: vLLM's own default, which it does not report)
            "max_running_requests": int(seqs) if seqs is not None else None,
            "dtype": argv[argv.index("--dtype") + 1] if "--dtype" in argv else None,
            "spec": self.spec.model_dump(mode="json"), "vllm_argv": argv, "model_name": self.model_name,
            "vllm_starts": self.starts,
            "vllm_metrics": protocol.metrics_since(await self.metrics(), self.metrics_base),
            "internal_states": [self.totals.internal_state()],
        }


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
            _say(f"ready: vLLM {shim.version} at {shim.child.url}")

        asyncio.get_running_loop().create_task(boot())
        asyncio.get_running_loop().create_task(shim.watch_child())

    @app.on_event("shutdown")
    async def _stop() -> None:
        shim.child.stop()

    @app.get("/health")
    async def health() -> Response:
        if shim.restarting:
            # a suffix server's flush restarts vLLM on purpose: the engine is not unhealthy, and a failed Serve health
            # check here would replace the replica mid-trial
            return JSONResponse({"status": "flushing"})
        if not shim.ready or shim.client is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        try:
            answer = await shim.client.get("/health", timeout=10)
        except httpx.HTTPError as exc:
            return JSONResponse({"status": f"vLLM unreachable: {exc}"}, status_code=503)
        return Response(answer.content, status_code=answer.status_code)

    @app.get("/server_info")
    async def server_info() -> Response:
        if not shim.ready:
            return JSONResponse({"error": "starting"}, status_code=503)
        return JSONResponse(await shim.server_info())

    @app.post("/flush_cache")
    async def flush_cache(timeout: float = 0.0) -> Response:
        if not shim.ready or shim.restarting:
            return JSONResponse({"error": "starting"}, status_code=503)
        if shim.inflight:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(shim.idle.wait(), timeout=max(timeout, 0.0) or 0.001)
        if shim.inflight:
            return JSONResponse({"error": f"{shim.inflight} request(s) in flight; flush refused (SGLang answers "
                                          "the same; pass ?timeout= to wait for idle)"}, status_code=400)
        try:
            if await shim.flush_action() == "restart":
                return StreamingResponse(_restart_events(shim), media_type="text/event-stream")
            return JSONResponse(await shim.reset())
        except (RuntimeError, httpx.HTTPError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=500)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        try:
            body = protocol.completion_body(await request.json(), shim.model_name)
        except (ValueError, protocol.BadRequest) as exc:
            return JSONResponse({"error": {"message": str(exc)}}, status_code=400)
        if not shim.ready or shim.client is None:
            return JSONResponse({"error": {"message": "engine not ready"}}, status_code=503)
        if body["stream"]:
            return _stream(shim, body)
        started = time.monotonic()
        async with shim.tracked():
            answer = await shim.client.post("/v1/completions", json=body)
        if answer.status_code != 200:
            return Response(answer.content, status_code=answer.status_code, media_type="application/json")
        final = answer.json()
        choice = (final.get("choices") or [{}])[0]
        meta = protocol.meta_info(choice, final.get("usage") or {}, final.get("metrics"), shim.speculative,
                                  time.monotonic() - started)
        shim.totals.add(meta)
        return JSONResponse({"text": choice.get("text", ""), "output_ids": choice.get("token_ids") or [],
                             "meta_info": meta})

    add_forward_route(app, shim)
    return app


def _restart_events(shim: Shim) -> AsyncIterator[bytes]:
    """A flush's restart as an event stream: a comment every HEARTBEAT_S while vLLM starts again (a minute or more on
    a CPU), then the result. The trial's flush waits 35 s for a byte (pipeline/trial/engine_pass.py) and the replica
    relays only event streams as they come, so a silent minute would read as a dead engine. A restart that fails
    ends the shim, as a failed first start does: the replica then sees a dead engine."""

    async def events() -> AsyncIterator[bytes]:
        task = asyncio.ensure_future(shim.restart())
        while not task.done():
            yield b": restarting vLLM to empty its suffix cache\n\n"
            await asyncio.wait({task}, timeout=HEARTBEAT_S)
        try:
            result = task.result()
        except Exception as exc:  # noqa: BLE001 - any restart failure ends the engine with its reason in the log
            _say(f"restart failed: {exc}")
            shim.child.stop()
            os._exit(3)
        _say(f"flushed: vLLM restarted at {shim.child.url} (start {shim.starts})")
        yield sse_event(result)

    return events()


def _stream(shim: Shim, body: dict[str, Any]) -> Response:
    """SGLang-style SSE: cumulative text and output_ids per event, counters on the last, then `[DONE]`. vLLM sends
    the usage (and the per-request metrics) in a chunk of its own after the one that finished the choice: that
    finishing chunk is held back and sent once with the counters, so the stream has no empty event at its end (the
    load generator times every event)."""
    assert shim.client is not None
    started = time.monotonic()
    client = shim.client

    async def events() -> AsyncIterator[bytes]:
        text, ids = "", list[int]()
        finished: dict[str, Any] | None = None
        usage: dict[str, Any] = {}
        metrics: dict[str, Any] | None = None
        async with shim.tracked():
            async with client.stream("POST", "/v1/completions", json=body) as answer:
                if answer.status_code != 200:
                    detail = (await answer.aread()).decode("utf-8", "replace")
                    yield sse_event({"error": {"message": f"vLLM answered {answer.status_code}: {detail[:500]}"}})
                    yield sse_event("[DONE]")
                    return
                decoder = SseDecoder()
                async for raw in answer.aiter_bytes():
                    for event in decoder.feed(raw):
                        if event.done:
                            continue
                        chunk = json.loads(event.data)
                        if "error" in chunk:
                            yield sse_event(chunk)
                            yield sse_event("[DONE]")
                            return
                        usage = chunk.get("usage") or usage
                        metrics = chunk.get("metrics") or metrics
                        for choice in chunk.get("choices") or []:
                            text += choice.get("text") or ""
                            ids += choice.get("token_ids") or []
                            if choice.get("finish_reason") is not None:
                                finished = choice
                            else:
                                yield sse_event({"text": text, "output_ids": list(ids),
                                            "meta_info": protocol.progress_meta(len(ids))})
        if finished is not None:
            usage = usage or {"completion_tokens": len(ids)}
            meta = protocol.meta_info(finished, usage, metrics, shim.speculative, time.monotonic() - started)
            shim.totals.add(meta)
            yield sse_event({"text": text, "output_ids": list(ids), "meta_info": meta})
        yield sse_event("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m serve.engines.vllm [options] -- VLLM-ARGV...", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m serve.engines.vllm", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--spec", default='{"algorithm": "none"}', help="the SpecConfig as JSON (what to report)")
    parser.add_argument("--model-name", required=True, help="vLLM's --served-model-name (the OpenAI model id)")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    args = parser.parse_args(argv[:split])
    server_argv = argv[split + 1:]
    if not server_argv:
        parser.error("give vLLM's argv after --")
    shim = Shim(parse_spec(json.loads(args.spec)), Child(server_argv), args.model_name, args.ready_timeout)
    # SIGTERM from the replica/watchdog: uvicorn shuts down, the shutdown hook stops vLLM.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import uvicorn

    uvicorn.run(build_app(shim), host=args.host, port=args.port, log_level="warning")
    return 0
