"""HTTP server: SGLang 0.5.23's native routes plus the OpenAI ones (`openai_api`). `python -m serve.engines.cpu`.

Native routes: `POST /generate`, `GET /health` (and `/health_generate`), `GET /server_info` (and the deprecated
`/get_server_info`), `GET /get_model_info`, `GET|POST /flush_cache` (400 unless idle, as SGLang).
Errors: a bad request gets HTTP 400 `{"error": {"message": ...}}` naming the field; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from serve.engines.cpu.config import EngineConfig
from serve.engines.cpu.decode import Request
from serve.engines.cpu.engine import Engine
from serve.engines.cpu.params import BadRequest, GenerateBody, parse_model

__all__ = ["create_app", "Snapshot", "stream_request", "read_json", "error_response", "serve", "exit_with_parent"]

log = logging.getLogger("serve.engines.cpu")


@dataclass(frozen=True)
class Snapshot:
    """A request's state after one step, copied on the worker thread."""

    output_ids: list[int]
    finished: bool
    meta_info: dict
    error: str | None = None


async def stream_request(engine: Engine, req: Request) -> AsyncIterator[Snapshot]:
    """Submit `req` and yield a snapshot after each of its steps; cancels it if the consumer goes away."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Snapshot] = asyncio.Queue()
    speculative = engine.speculative
    draft_tokens = engine.config.server_args()["speculative_num_draft_tokens"]

    def sink(r: Request, error: str | None) -> None:
        snap = Snapshot(list(r.output_ids), r.finished or error is not None,
                        r.meta_info(speculative, draft_tokens), error)
        loop.call_soon_threadsafe(queue.put_nowait, snap)

    engine.scheduler.submit(req, sink)
    done = False
    try:
        while not done:
            snap = await queue.get()
            done = snap.finished
            yield snap
    finally:
        if not done:
            engine.scheduler.cancel(req)


async def read_json(http: HttpRequest) -> Any:
    body = await http.body()
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise BadRequest(f"body: not valid JSON ({err})") from None


def error_response(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="specdec CPU engine", docs_url=None, redoc_url=None)

    @app.exception_handler(BadRequest)
    async def _bad_request(_: HttpRequest, err: BadRequest) -> JSONResponse:
        return error_response(str(err))

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> JSONResponse:
        return JSONResponse(engine.server_info())

    @app.get("/get_model_info")
    async def model_info() -> JSONResponse:
        return JSONResponse({"model_path": engine.config.model_path, "tokenizer_path": engine.model_dir,
                             "is_generation": True})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> PlainTextResponse:
        if engine.scheduler.flush():
            return PlainTextResponse("Cache flushed.\n")
        running, waiting = engine.scheduler.load()
        return PlainTextResponse(
            f"Cache not flushed because there are pending requests (running={running}, waiting={waiting}).\n",
            status_code=400)

    @app.post("/generate")
    async def generate(http: HttpRequest):
        body: GenerateBody = parse_model(GenerateBody, await read_json(http))
        if body.return_logprob:
            raise BadRequest("return_logprob: not implemented by the CPU engine; send false")
        factory = engine.factory
        params = body.sampling_params
        req = factory.build(factory.prompt_ids(body.text, body.input_ids), params, body.rid)

        def payload(snap: Snapshot) -> dict:
            text = factory.text_of(snap.output_ids, snap.meta_info["finish_reason"], params, snap.finished)
            return {"text": text, "output_ids": snap.output_ids,
                    "meta_info": snap.meta_info}

        if body.stream:
            async def events() -> AsyncIterator[bytes]:
                async for snap in stream_request(engine, req):
                    if snap.error:
                        yield _sse({"error": {"message": snap.error, "code": 500}})
                        break
                    yield _sse(payload(snap))
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        last = None
        async for snap in stream_request(engine, req):
            last = snap
        if last is None or last.error:
            return error_response(last.error if last else "request produced no output", 500)
        return JSONResponse(payload(last))

    from serve.engines.cpu.openai_api import register_openai_routes

    register_openai_routes(app, engine)
    return app


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def exit_with_parent(poll_s: float = 1.0) -> None:
    """Stop (SIGTERM to ourselves) once the process that started us is gone.

    The replica starts the engine in its own session so teardown can kill its whole group; but when the replica's
    Ray worker is SIGKILLed nothing runs teardown, and the orphaned engine would keep its port, memory and cores.
    Re-parenting (getppid() changes) is the portable sign that the parent died."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        log.warning("parent process %d is gone: shutting down", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


def serve(config: EngineConfig) -> int:
    """Load the engine for a parsed config and serve HTTP until interrupted; 1 if the engine cannot start."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for warning in config.warnings:
        log.warning(warning)
    import uvicorn

    from serve.engines.cpu.engine import EngineError, build_engine
    from serve.engines.cpu.models import ModelFetchError

    started = time.monotonic()
    exit_with_parent()
    try:
        engine = build_engine(config)
    except (EngineError, ModelFetchError, OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    engine.startup_time["total"] = round(time.monotonic() - started, 3)
    log.info("engine ready in %.1f s: %s", engine.startup_time["total"], json.dumps(engine.startup_time))
    if engine.verify_cost:
        log.info("verify cost (N=%s, relative to N=1): %s", engine.verify_cost["sizes"], engine.verify_cost["relative"])
    try:
        uvicorn.run(create_app(engine), host=config.host, port=config.port, log_level=config.log_level,
                    access_log=config.log_level == "debug")
    finally:
        engine.scheduler.stop()
    return 0
