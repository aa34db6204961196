"""OpenAI-compatible ingress of the production endpoint: auth, request limits, metrics, `/v1/config`.

Requests are checked here (API key, body size, JSON, max_tokens) before anything reaches the engine, so a bad
request costs the engine nothing and never disturbs other requests. Everything else is forwarded to the engine
replica through its Serve handle (`EngineBackend.call` / `call_stream`).
"""


import hmac
import json
import os
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from ray import serve

from serve.production import ProductionSettings

app = FastAPI(title="specdec-tuner production endpoint")
FORWARDED_HEADERS = ("content-type", "accept")


class RequestRejected(Exception):
    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    """OpenAI's error shape, so clients raise their usual exception types."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def load_api_keys(settings: ProductionSettings) -> list[str]:
    keys = [k.strip() for k in os.environ.get(settings.api_keys_env, "").split(",") if k.strip()]
    if settings.api_key_file:
        keys += [line.strip() for line in Path(settings.api_key_file).read_text().splitlines() if line.strip()]
    return keys


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("specdec_requests", "requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.latency = Histogram("specdec_request_latency_seconds", "end-to-end latency", ["route"],
                                 registry=self.registry)
        self.tokens = Counter("specdec_completion_tokens", "completion tokens served", registry=self.registry)
        self.accept = Gauge("specdec_engine_accept_length", "engine avg speculative accept length since start",
                            registry=self.registry)


@serve.deployment(max_ongoing_requests=512, ray_actor_options={"num_cpus": 0.1}, graceful_shutdown_timeout_s=120,
                  graceful_shutdown_wait_loop_s=1)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, engine: Any, settings: dict[str, Any], serving: dict[str, Any]) -> None:
        self.engine = engine
        self.settings = ProductionSettings.model_validate(settings)
        self.serving = serving
        self.keys = load_api_keys(self.settings)
        if self.settings.auth_required() and not self.keys:
            raise RuntimeError(f"API keys are required when listening on {self.settings.host}: set "
                               f"{self.settings.api_keys_env}=key1,key2 or --api-key-file, or --no-require-auth")
        self.metrics = _Metrics()

    # --- checks --------------------------------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if not (self.settings.auth_required() or self.keys):
            return
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if not token or not any(hmac.compare_digest(token, key) for key in self.keys):
            raise RequestRejected(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                  "authentication_error")

    async def _body(self, request: Request) -> tuple[bytes, dict[str, Any]]:
        declared = request.headers.get("content-length")
        limit = self.settings.max_request_bytes
        if declared and declared.isdigit() and int(declared) > limit:
            raise RequestRejected(413, f"request body of {declared} bytes exceeds the limit of {limit}",
                                  "invalid_request_error")
        body = await request.body()
        if len(body) > limit:
            raise RequestRejected(413, f"request body of {len(body)} bytes exceeds the limit of {limit}",
                                  "invalid_request_error")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestRejected(400, f"request body is not valid JSON: {exc}", "invalid_request_error") from None
        if not isinstance(data, dict):
            raise RequestRejected(400, "request body must be a JSON object", "invalid_request_error")
        for key in ("max_tokens", "max_completion_tokens"):
            value = data.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise RequestRejected(422, f"{key} must be a positive integer, got {value!r}", "invalid_request_error")
            if isinstance(value, int) and value > self.settings.max_tokens_limit:
                raise RequestRejected(422, f"{key}={value} exceeds this endpoint's limit of "
                                           f"{self.settings.max_tokens_limit}", "invalid_request_error")
        return body, data

    # --- routes --------------------------------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> Response:
        status, _, body = await self.engine.call.remote("GET", "/health")
        return Response(body, status_code=status)

    @app.get("/v1/config")
    async def config(self, request: Request) -> Response:
        return await self._guarded(request, "/v1/config", self._config)

    async def _config(self, request: Request) -> Response:
        config = self.serving["config"]
        return JSONResponse({**self.serving["origin"], "engine": config.get("engine"), "model": config.get("model"),
                             "dtype": config.get("dtype"), "speculative": config["trial"]["spec"],
                             "max_running_requests": config["trial"].get("max_running_requests"),
                             "decision": config.get("decision"), "study": config.get("study")})

    @app.get("/metrics")
    async def prometheus(self, request: Request) -> Response:
        return await self._guarded(request, "/metrics", self._prometheus)

    async def _prometheus(self, request: Request) -> Response:
        status, _, body = await self.engine.call.remote("GET", "/server_info")
        if status == 200:
            states = json.loads(body).get("internal_states") or [{}]
            accept = states[0].get("avg_spec_accept_length")
            if isinstance(accept, (int, float)):
                self.metrics.accept.set(accept)
        return PlainTextResponse(generate_latest(self.metrics.registry).decode(), media_type="text/plain")

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return await self._guarded(request, "/v1/models", self._forward)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._guarded(request, "/v1/completions", self._forward)

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._guarded(request, "/v1/chat/completions", self._forward)

    async def _guarded(self, request: Request, route: str, handler: Any) -> Response:
        started = time.monotonic()
        try:
            self._authorize(request)
            response = await handler(request)
        except RequestRejected as rejected:
            response = error_response(rejected.status, rejected.message, rejected.kind)
        self.metrics.requests.labels(route, str(response.status_code)).inc()
        self.metrics.latency.labels(route).observe(time.monotonic() - started)
        return response

    async def _forward(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET":
            status, ctype, body = await self.engine.call.remote("GET", path)
            return Response(body, status_code=status, media_type=ctype or None)
        body, data = await self._body(request)
        headers = {"content-type": "application/json"}
        if data.get("stream"):
            stream = self.engine.options(stream=True).call_stream.remote("POST", path, body, headers)
            status, ctype = await stream.__anext__()

            async def relay():
                async for chunk in stream:
                    yield chunk

            return StreamingResponse(relay(), status_code=status, media_type=ctype or "text/event-stream")
        status, ctype, payload = await self.engine.call.remote("POST", path, body, headers)
        if status == 200:
            try:
                self.metrics.tokens.inc(json.loads(payload).get("usage", {}).get("completion_tokens", 0))
            except (json.JSONDecodeError, AttributeError):
                pass
        return Response(payload, status_code=status, media_type=ctype or None)
