"""OpenAI-compatible ingress of the production endpoint: auth, request limits, metrics, `/v1/config`.

Requests are checked here (API key, body size, JSON, max_tokens) before anything reaches the engine, so a bad
request costs the engine nothing and never disturbs other requests. Everything else is forwarded to the engine
replica through its Serve handle (`EngineBackend.call` / `call_stream`).

Limits: an absent `max_tokens` becomes the endpoint's limit (chat) or min(16, limit) (completions, OpenAI's
default); a full queue (Serve's `max_queued_requests` on either deployment, or the engine's own waiting queue) is
a 429 with `Retry-After`; a request running longer than `request_timeout_s` is cut (504, or an error event on a
stream) and its generation cancelled. Every answer, 401s included, is counted in `/metrics`. Auth follows the
address Serve's proxy really binds (`serve.production_settings`). No `/docs` or `/openapi.json`. API keys, request
bodies and generated text are never logged.

Serving policy (`serve.serving.RoutingPolicy`, shown by `/v1/config`): with two engines, a generation request that
makes more than `switch_above` generation requests in flight at this ingress replica goes to the high-concurrency
engine; the answer's `x-specdec-route` header says which engine served it (`low` / `high`).
"""


import asyncio
import hmac
import json
import time
import weakref
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from ray import serve
from ray.serve.exceptions import BackPressureError

from serve.capture import Capture
from serve.production_settings import ProductionSettings, auth_problem, auth_required, load_api_keys
from serve.serving import HIGH, LOW, RoutingPolicy, ServingConfig

app = FastAPI(title="specdec-tuner production endpoint", docs_url=None, redoc_url=None, openapi_url=None)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
FORWARDED_HEADERS = ("content-type", "accept")


class RequestRejected(Exception):
    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    """OpenAI's error shape, so clients raise their usual exception types."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def serve_bind_host() -> str | None:
    """The address Serve's HTTP proxy binds (from `serve.start` or the config file's `http_options`); None if
    the controller cannot be asked."""
    try:
        from ray.serve.context import _get_global_client

        client = _get_global_client()
        return None if client is None else str(client.http_config.host)
    except Exception:  # noqa: BLE001 - any failure means "unknown", which the caller treats as public
        return None


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
        self.routed = Counter("specdec_routed_requests", "generation requests by serving-policy route", ["route"],
                              registry=self.registry)
        self.in_flight = Gauge("specdec_in_flight_requests", "generation requests in flight at this ingress",
                               registry=self.registry)
        # as the replica that answered reports them (SGLang reports what it has; absent keys stay unset)
        self.engine_requests = Gauge("specdec_engine_requests", "engine requests by state: running, waiting, "
                                     "finished (since start or flush)", ["state"], registry=self.registry)


@serve.deployment(max_ongoing_requests=512, ray_actor_options={"num_cpus": 0.1}, graceful_shutdown_timeout_s=120,
                  graceful_shutdown_wait_loop_s=1)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, engine: Any, settings: dict[str, Any], serving: dict[str, Any],
                 high_engine: Any = None) -> None:
        self.engine = engine
        # The policy decides which engine a generation request goes to (one config: always `engine`).
        self.policy = ServingConfig.model_validate(serving["config"]).policy or RoutingPolicy(
            text="one config at every level (a serving config without a per-level policy)", source="(replica)")
        if (self.policy.high is None) != (high_engine is None):
            raise RuntimeError(f"the serving policy has {'two' if self.policy.high else 'one'} engine(s) but the "
                               f"ingress was given {'two' if high_engine is not None else 'one'}")
        self.engines = {LOW: engine, **({HIGH: high_engine} if high_engine is not None else {})}
        self.in_flight = 0  # generation requests this replica is forwarding now (the router's load signal)
        self.routed = {route: 0 for route in self.engines}
        self.settings = ProductionSettings.model_validate(settings)
        self.serving = serving
        self.keys = [key.encode() for key in load_api_keys(self.settings)]
        # unknown bind address: assume it is public (fail closed)
        self.bind_host = serve_bind_host() or "0.0.0.0"
        problem = auth_problem(self.settings, self.bind_host, [k.decode() for k in self.keys])
        if problem:
            raise RuntimeError(problem)
        self.enforce = bool(self.keys) or auth_required(self.settings, self.bind_host)
        self.metrics = _Metrics()
        self.capture = Capture(self.settings.capture, self.settings.max_tokens_limit)  # off unless configured

    def auth_summary(self) -> str:
        """For the driver's banner: what this replica enforces, from the keys it loaded and the real bind address."""
        if self.enforce:
            return f"required ({len(self.keys)} key(s); proxy binds {self.bind_host})"
        if self.settings.require_auth is False:
            return f"off (--no-require-auth; proxy binds {self.bind_host})"
        return f"off (proxy binds {self.bind_host}, localhost only)"

    # --- checks --------------------------------------------------------------------------------------------------

    def _authorize(self, request: Request) -> None:
        if not self.enforce:
            return
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header.lower().startswith("bearer ") else ""
        # bytes: compare_digest refuses non-ASCII str (a 500 before); headers arrive latin-1 decoded, so latin-1
        # gives back the bytes the client sent
        given = token.encode("latin-1")
        if not token or not any(hmac.compare_digest(given, key) for key in self.keys):
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
        limit = self.settings.max_tokens_limit
        for key in ("max_tokens", "max_completion_tokens"):
            value = data.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise RequestRejected(422, f"{key} must be a positive integer, got {_short(value)}",
                                      "invalid_request_error")
            if isinstance(value, int) and value > limit:
                raise RequestRejected(422, f"{key}={value} exceeds this endpoint's limit of {limit}",
                                      "invalid_request_error")
        if data.get("max_tokens") is None and data.get("max_completion_tokens") is None:
            # absent would mean "up to the context" for chat: the endpoint's limit applies to it too
            chat = request.url.path.endswith("/chat/completions")
            data["max_tokens"] = limit if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, limit)
            body = json.dumps(data).encode()
        return body, data

    # --- routes --------------------------------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> Response:
        # Healthy only when every engine of the policy is: a request may be routed to either.
        for engine in self.engines.values():
            status, _, body = await engine.call.remote("GET", "/health")
            if status != 200:
                break
        return Response(body, status_code=status)

    @app.get("/v1/config")
    async def config(self, request: Request) -> Response:
        return await self._guarded(request, "/v1/config", self._config)

    async def _config(self, request: Request) -> Response:
        # The served ServingConfig field for field (`replica`, `provenance`), plus where it came from (`origin`) and,
        # for clients that read only these, the registry version at the top level.
        # `routing`: what the policy does now (this replica's in-flight count and how many requests each engine got).
        return JSONResponse({**self.serving["config"], "origin": self.serving["origin"],
                             "version": self.serving["origin"].get("version"),
                             "routing": {"switch_above": self.policy.switch_above, "in_flight": self.in_flight,
                                         "routed": dict(self.routed)}})

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
            for state, key in (("running", "num_running_reqs"), ("waiting", "num_waiting_reqs"),
                               ("finished", "num_finished_requests")):
                value = states[0].get(key)
                if isinstance(value, (int, float)):
                    self.metrics.engine_requests.labels(state).set(value)
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
            response = await asyncio.wait_for(handler(request), self.settings.request_timeout_s)
        except RequestRejected as rejected:
            response = error_response(rejected.status, rejected.message, rejected.kind)
        except BackPressureError:
            response = self._busy("the engine's queue is full")
        except asyncio.TimeoutError:
            response = error_response(504, f"the request took longer than request_timeout_s="
                                           f"{self.settings.request_timeout_s:g}; it was cancelled", "timeout_error")
        response = await self.capture.observe(route, request, response)  # opt-in traffic capture (serve.capture)
        self.metrics.requests.labels(route, str(response.status_code)).inc()
        self.metrics.latency.labels(route).observe(time.monotonic() - started)
        return response

    def _busy(self, why: str) -> Response:
        response = error_response(429, f"{why}; retry after {self.settings.retry_after_s} s", "rate_limit_error")
        response.headers["Retry-After"] = str(self.settings.retry_after_s)
        return response

    async def _forward(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET":
            status, ctype, body = await self.engine.call.remote("GET", path)
            return Response(body, status_code=status, media_type=ctype or None)
        body, data = await self._body(request)
        route = self.policy.route(self.in_flight + 1)  # +1: this request counts towards the level it creates
        release = self._enter(route)
        try:
            response = await self._generate(self.engines[route], path, body, bool(data.get("stream")), release)
        except BaseException:
            release()
            raise
        response.headers["x-specdec-route"] = route
        return response

    def _enter(self, route: str) -> Any:
        """Count a generation request in flight; returns its idempotent release (a stream releases when it ends)."""
        self.in_flight += 1
        self.routed[route] += 1
        self.metrics.routed.labels(route).inc()
        self.metrics.in_flight.set(self.in_flight)
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.in_flight -= 1
                self.metrics.in_flight.set(self.in_flight)

        return release

    async def _generate(self, engine: Any, path: str, body: bytes, streaming: bool, release: Any) -> Response:
        """Forward one generation request to `engine`; `release` is called when it is no longer in flight."""
        headers = {"content-type": "application/json"}
        if streaming:
            stream = engine.options(stream=True).call_stream.remote("POST", path, body, headers)
            try:
                status, ctype = await stream.__anext__()
            except asyncio.CancelledError:  # client gone or request_timeout_s before the first byte
                stream.cancel()
                raise
            if status in (429, 503):  # the engine refused before streaming (its waiting queue is full)
                stream.cancel()
                release()
                return self._busy("the engine's queue is full")
            deadline = time.monotonic() + self.settings.request_timeout_s

            async def relay():
                # The deadline covers the whole stream; leaving this generator (client gone, deadline) cancels the
                # handle call, which closes the engine connection, which cancels the generation.
                try:
                    while True:
                        left = deadline - time.monotonic()
                        try:
                            chunk = await asyncio.wait_for(stream.__anext__(), max(left, 0.001))
                        except StopAsyncIteration:
                            return
                        except asyncio.TimeoutError:
                            yield ("data: " + json.dumps({"error": {
                                "message": f"the request took longer than request_timeout_s="
                                           f"{self.settings.request_timeout_s:g}; it was cancelled",
                                "type": "timeout_error", "code": 504}}) + "\n\ndata: [DONE]\n\n").encode()
                            return
                        yield chunk
                finally:
                    stream.cancel()
                    release()

            chunks = relay()
            # A generator never iterated (the client left before the body was sent) runs no `finally`: release the
            # in-flight count when it is collected, or the router would count that request forever.
            weakref.finalize(chunks, release)
            return StreamingResponse(chunks, status_code=status, media_type=ctype or "text/event-stream")
        response = engine.call.remote("POST", path, body, headers)
        try:
            status, ctype, payload = await response
        except asyncio.CancelledError:  # client gone or request_timeout_s: stop the generation too
            response.cancel()
            raise
        finally:
            release()
        if status in (429, 503):
            return self._busy("the engine's queue is full")
        if status == 200:
            try:
                self.metrics.tokens.inc(json.loads(payload).get("usage", {}).get("completion_tokens", 0))
            except (json.JSONDecodeError, AttributeError):
                pass
        return Response(payload, status_code=status, media_type=ctype or None)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
