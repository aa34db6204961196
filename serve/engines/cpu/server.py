"""HTTP server: SGLang 0.5.23's native routes plus the OpenAI ones (`openai_api`). `python -m serve.engines.cpu`.

Native routes, with SGLang 0.5.23's behaviour (read from the wheel: `srt/entrypoints/http_server.py`,
`managers/scheduler_components/flush_wrapper.py`):
- `POST /generate` (plain and SSE).
- `GET /health` (and `/health_generate`): submits a real 1-token generation (`input_ids=[0]`, greedy, not counted in
  the metrics) and answers 200 as soon as *any* step of any request completes after the call started (so a busy
  engine answers at its next step), 503 if none does within `HEALTH_CHECK_TIMEOUT_S` (20 s, SGLang's
  `SGLANG_HEALTH_CHECK_TIMEOUT`). SGLang polls for that once a second; here it is event-driven.
- `GET /server_info` (and the deprecated `/get_server_info`), `GET /get_model_info`.
- `GET|POST /flush_cache?timeout=S`: flushes only when no request is queued or running. `timeout` 0 (default):
  400 "Flush cache failed." at once when busy. `timeout` > 0: waits for idle, then flushes; 400 "Timed out waiting
  for idle state." when the time runs out; while one such flush waits, another gets 400 "Another flush_cache is
  already in progress.". Success: 200 with SGLang's text.
- `POST /add_external_corpus`, `POST /remove_external_corpus`, `GET /list_external_corpora` (loaded corpus ids and
  their token counts, as in SGLang; `/server_info` does not list them): see `corpus_routes`.
Errors: a bad request gets HTTP 400 `{"error": {"message": ...}}` naming the field; a full waiting queue 429 with
`Retry-After` (SGLang: 503 "The request queue is full."). A client that disconnects cancels its request, streamed or
not. No `/docs` or `/openapi.json`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Query, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from serve.engines.cpu.command_line import EngineConfig
from serve.engines.cpu.corpus_routes import register_corpus_routes
from serve.engines.cpu.decode import Request, StopRules
from serve.engines.cpu.engine import LoadedEngine
from serve.engines.cpu.faults import before_start, install as install_faults
from serve.engines.cpu.openai_api import register_openai_routes
from serve.engines.cpu.params import BadRequest, GenerateBody, parse_model
from serve.engines.cpu.scheduler import QueueFull, TooLarge
from serve.engines.cpu.streaming import RETRY_AFTER_S, RequestStream, Snapshot, collect, error_response, read_json, sse
from serve.engines.cpu.verify import Sampling

__all__ = ["create_app", "serve", "HEALTH_CHECK_TIMEOUT_S", "FLUSH_OK", "FLUSH_FAILED",
           "FLUSH_TIMED_OUT", "FLUSH_IN_PROGRESS"]

log = logging.getLogger("serve.engines.cpu")

HEALTH_CHECK_TIMEOUT_S = 20.0
FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n")
FLUSH_FAILED = "Flush cache failed.\n"
FLUSH_TIMED_OUT = "Timed out waiting for idle state."
FLUSH_IN_PROGRESS = "Another flush_cache is already in progress."


async def _until_progress(engine: LoadedEngine, timeout_s: float) -> bool:
    """True once the worker completes a step or a request leaves (after this call), False after `timeout_s`."""
    loop = asyncio.get_running_loop()
    event = asyncio.Event()

    def wake() -> None:
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # loop closed at shutdown
            pass

    unwatch = engine.scheduler.watch(wake)
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
        return True
    except asyncio.TimeoutError:
        return False
    finally:
        unwatch()


def create_app(engine: LoadedEngine) -> FastAPI:
    app = FastAPI(title="specdec CPU engine", docs_url=None, redoc_url=None, openapi_url=None)
    flush_pending = False

    @app.exception_handler(BadRequest)
    async def _bad_request(_: HttpRequest, err: BadRequest) -> JSONResponse:
        return error_response(str(err))

    @app.exception_handler(TooLarge)
    async def _too_large(_: HttpRequest, err: TooLarge) -> JSONResponse:
        return error_response(str(err))

    @app.exception_handler(QueueFull)
    async def _queue_full(_: HttpRequest, err: QueueFull) -> JSONResponse:
        return error_response(str(err), 429, headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> PlainTextResponse:
        # built directly, not by the factory: the factory's request count seeds unseeded requests
        probe = Request(rid="HEALTH_CHECK", prompt_ids=[0], sampling=Sampling(temperature=0.0),
                        rules=StopRules(max_new_tokens=1), seed=0)
        progressed = asyncio.ensure_future(_until_progress(engine, HEALTH_CHECK_TIMEOUT_S))
        await asyncio.sleep(0)  # the watcher is registered before the probe can step
        stream = RequestStream(engine, probe, internal=True)
        try:
            ok = await progressed
        finally:
            stream.close()
        if not ok:
            log.error("health check failed: no step completed in %.0f s", HEALTH_CHECK_TIMEOUT_S)
        return PlainTextResponse("", status_code=200 if ok else 503)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> JSONResponse:
        return JSONResponse(engine.server_info())

    @app.get("/get_model_info")
    async def model_info() -> JSONResponse:
        return JSONResponse({"model_path": engine.config.model_path, "tokenizer_path": engine.model_dir,
                             "is_generation": True})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = Query(0.0, ge=0.0)) -> PlainTextResponse:
        nonlocal flush_pending
        if flush_pending:
            return PlainTextResponse(FLUSH_IN_PROGRESS, status_code=400)
        if engine.scheduler.flush():
            return PlainTextResponse(FLUSH_OK)
        if timeout <= 0:
            return PlainTextResponse(FLUSH_FAILED, status_code=400)
        flush_pending = True
        deadline = time.monotonic() + timeout
        try:
            while True:
                remaining = deadline - time.monotonic()
                waiter = asyncio.ensure_future(_until_progress(engine, max(remaining, 0.0)))
                await asyncio.sleep(0)  # registered before the idle check below, so no step is missed
                if engine.scheduler.flush():
                    waiter.cancel()
                    return PlainTextResponse(FLUSH_OK)
                if remaining <= 0:
                    waiter.cancel()
                    progressed = False
                else:
                    progressed = await waiter
                if not progressed:
                    if engine.scheduler.flush():
                        return PlainTextResponse(FLUSH_OK)
                    return PlainTextResponse(FLUSH_TIMED_OUT, status_code=400)
        finally:
            flush_pending = False

    @app.post("/generate")
    async def generate(http: HttpRequest):
        body: GenerateBody = parse_model(GenerateBody, await read_json(http))
        if body.return_logprob:
            raise BadRequest("return_logprob: not implemented by the CPU engine; send false")
        factory = engine.factory
        params = body.sampling_params
        req = factory.build(await factory.prompt_ids_async(body.text, body.input_ids), params, body.rid)

        def payload(snap: Snapshot) -> dict:
            ids = snap.output_ids
            text = factory.text_of(ids, snap.meta_info["finish_reason"], params, snap.finished)
            return {"text": text, "output_ids": ids, "meta_info": snap.meta_info}

        stream = RequestStream(engine, req)
        if body.stream:
            async def events() -> AsyncIterator[bytes]:
                async for snap in stream:
                    if snap.error:
                        yield sse({"error": {"message": snap.error, "code": 500}})
                        break
                    yield sse(payload(snap))
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        last = await collect(stream, http)
        if last is None:  # the client is gone; nobody reads this
            return error_response("client disconnected", 499)
        if last.error:
            return error_response(last.error, 500)
        return JSONResponse(payload(last))

    register_openai_routes(app, engine)
    register_corpus_routes(app, engine)  # /add_external_corpus, /remove_external_corpus, /list_external_corpora
    install_faults(app, engine)  # test-only --test-fault switches; nothing without the flag
    return app


def serve(config: EngineConfig) -> int:
    """Load the engine for a parsed config and serve HTTP until interrupted; 1 if the engine cannot start."""
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    for warning in config.warnings:
        log.warning(warning)
    import uvicorn

    from serve.engines.cpu.engine import EngineError, build_engine
    from serve.model_store import ModelFetchError

    started = time.monotonic()
    code = before_start(config.test_faults, config.spec.algorithm != "none",  # test-only --test-fault
                        draft_tokens=getattr(config.spec, "num_draft_tokens", None))
    if code is not None:
        return code
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
