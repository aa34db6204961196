"""OpenAI-compatible ingress of the production endpoint: auth, request limits, metrics, `/v1/config`.

Requests are checked here (API key, body size, JSON, max_tokens) before anything reaches the engine, so a bad
request costs the engine nothing and never disturbs other requests. Everything else is forwarded to the engine
replica through its Serve handle (`EngineBackend.call` / `call_stream`).

Limits (`serve.http_limits`): the body is read until it passes `max_request_bytes` and no further (413); JSON is
strict (no NaN/Infinity, nothing nested deeper than 64 levels: 400); an absent `max_tokens` becomes the endpoint's
limit (chat) or min(16, limit) (completions, OpenAI's default), and an engine that refuses the filled-in value is
told about in the error. A full queue (Serve's `max_queued_requests` on either deployment, or the engine's own
waiting queue) is a 429 with `Retry-After`; a request running longer than `request_timeout_s` is cut (504, or an
error event on a stream) and its generation cancelled. An engine that is gone or restarting is a 503 with
`Retry-After` (`serve.http_errors.failure_answer`), a stream it leaves ends with an error event and `[DONE]`
(`serve.stream_relay`); `/health` asks every engine within `health_timeout_s` (503 when one is gone, 504 when one
does not answer). Every answer, 401s and 500s included, is counted in `/metrics`. Auth follows the address Serve's
proxy really binds (`serve.production_settings`). No `/docs` or `/openapi.json`. API keys, request bodies and
generated text are never logged.

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
from serve.http_errors import (RequestRejected, busy_response, error_response, failure_answer, log_failure,
                               unavailable_response)
from serve.http_limits import BadJson, check_max_tokens, fill_max_tokens, parse_json, read_body
from serve.production_settings import ProductionSettings, auth_problem, auth_required, load_api_keys
from serve.serving import HIGH, LOW, RoutingPolicy, ServingConfig
from serve.stream_relay import relay

app = FastAPI(title="specdec-tuner production endpoint", docs_url=None, redoc_url=None, openapi_url=None)
MAX_ERROR_BODY_BYTES = 64_000  # an engine's error answer relayed whole; a bigger one is cut


def serve_bind_host() -> str | None:
    """The address Serve's HTTP proxy binds (from `serve.start` or the config file's `http_options`); None if
    the controller cannot be asked."""
    try:
        from ray.serve.context import _get_global_client

        client = _get_global_client()
        return None if client is None else str(client.http_config.host)
    except Exception:  # noqa: BLE001 - any failure means "unknown", which the caller treats as public
        return None


class IngressMetrics:
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
        # a stream already answered 200 and then ended by an error event (timeout 504, engine gone 503)
        self.stream_errors = Counter("specdec_stream_errors", "streams ended by an error event, by route and "
                                     "status", ["route", "status"], registry=self.registry)


async def bounded(call: Any, timeout_s: float) -> Any:
    """Await a Serve handle call for at most `timeout_s`; on timeout (or cancellation) the call is cancelled too."""
    try:
        return await asyncio.wait_for(asyncio.ensure_future(call), timeout_s)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        call.cancel()
        raise


def engine_message(payload: bytes) -> str | None:
    """The message of an engine's error body (OpenAI's, SGLang's or the CPU engine's shape), None if unreadable."""
    try:
        data = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    message = error.get("message") if isinstance(error, dict) else data.get("message")
    return message if isinstance(message, str) else None


def engine_error(status: int, payload: bytes) -> Response:
    """An engine's error answer in OpenAI's shape (the CPU engine's, SGLang's and llama-server's differ)."""
    message = engine_message(payload) or f"the engine answered {status}"
    return error_response(status, message, "invalid_request_error" if status < 500 else "server_error")


# Serve freezes the FastAPI app while this module is still being imported (`@serve.ingress` pickles the app, whose
# routes point at the class, and unpickling rebinds the class's methods to a copy of this module's globals taken at
# that moment). A name a method uses must therefore be bound ABOVE this line: one defined further down is missing
# in the replica (a NameError on every request that reaches it). tests/unit/test_production_ingress.py checks it.
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
        self.metrics = IngressMetrics()
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

    async def _body(self, request: Request) -> tuple[bytes, dict[str, Any], int | None]:
        """(body to forward, its JSON object, the max_tokens the endpoint filled in or None)."""
        body = await read_body(request.receive, self.settings.max_request_bytes, request.headers.get("content-length"))
        try:
            data = parse_json(body)
        except BadJson as exc:
            raise RequestRejected(400, f"request body: {exc}") from None
        if not isinstance(data, dict):
            raise RequestRejected(400, "request body must be a JSON object")
        check_max_tokens(data, self.settings.max_tokens_limit)
        filled = fill_max_tokens(data, request.url.path.endswith("/chat/completions"), self.settings.max_tokens_limit)
        if filled is not None:
            body = json.dumps(data).encode()
        request.state.body = data  # what the engine was asked, for the capture
        return body, data, filled

    # --- routes --------------------------------------------------------------------------------------------------

    @app.get("/health")
    async def health(self) -> Response:
        # Healthy only when every engine of the policy is: a request may be routed to either. Bounded: a paused or
        # wedged engine makes this a 504 after health_timeout_s, never a hang.
        started = time.monotonic()
        timeout_s = self.settings.health_timeout_s
        response: Response = Response(b"", status_code=200)
        for engine in self.engines.values():
            try:
                status, _, body = await bounded(engine.call.remote("GET", "/health"), timeout_s)
            except asyncio.TimeoutError:
                response = error_response(504, f"an engine did not answer /health within health_timeout_s="
                                               f"{timeout_s:g}", "timeout_error")
                break
            except Exception as exc:  # noqa: BLE001 - a dead engine or replica is a 503, anything else a 500
                response = self._failure("/health", exc)
                break
            if status != 200:
                response = Response(body, status_code=status)
                break
        self.metrics.requests.labels("/health", str(response.status_code)).inc()
        self.metrics.latency.labels("/health").observe(time.monotonic() - started)
        return response

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
        try:  # the engine's counters are a bonus: a dead engine must not hide the ingress's own metrics
            status, _, body = await bounded(self.engine.call.remote("GET", "/server_info"),
                                            self.settings.health_timeout_s)
            states = (json.loads(body).get("internal_states") or [{}]) if status == 200 else [{}]
        except Exception:  # noqa: BLE001
            states = [{}]
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
        """Auth, the handler within request_timeout_s, and one answer for every outcome (each counted)."""
        started = time.monotonic()
        try:
            self._authorize(request)
            response = await asyncio.wait_for(handler(request), self.settings.request_timeout_s)
        except RequestRejected as rejected:
            response = error_response(rejected.status, rejected.message, rejected.kind, rejected.headers)
        except BackPressureError:
            response = busy_response("the engine's queue is full", self.settings.retry_after_s)
        except asyncio.TimeoutError:
            response = error_response(504, f"the request took longer than request_timeout_s="
                                           f"{self.settings.request_timeout_s:g}; it was cancelled", "timeout_error")
        except Exception as exc:  # noqa: BLE001 - every failure is an answer in OpenAI's shape, and is counted
            response = self._failure(route, exc)
        data = getattr(request.state, "body", None)
        response = await self.capture.observe(route, data, response)  # opt-in traffic capture (serve.capture)
        self.metrics.requests.labels(route, str(response.status_code)).inc()
        self.metrics.latency.labels(route).observe(time.monotonic() - started)
        return response

    def _failure(self, route: str, exc: BaseException) -> Response:
        status, message = failure_answer(exc)
        if status == 503:
            return unavailable_response(message, self.settings.retry_after_s)
        if status == 500:
            log_failure(route, exc)
        return error_response(status, message, "timeout_error" if status == 504 else "server_error")

    async def _forward(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET":
            status, ctype, body = await self.engine.call.remote("GET", path)
            return Response(body, status_code=status, media_type=ctype or None)
        body, data, filled = await self._body(request)
        route = self.policy.route(self.in_flight + 1)  # +1: this request counts towards the level it creates
        release = self._enter(route)
        try:
            response = await self._generate(self.engines[route], path, body, bool(data.get("stream")), release)
        except BaseException:
            release()
            raise
        if response.status_code == 400 and filled is not None:
            response = self._explain_filled(response, filled)
        response.headers["x-specdec-route"] = route
        return response

    def _explain_filled(self, response: Response, filled: int) -> Response:
        """The engine refused a request whose max_tokens the endpoint filled in (a long chat prompt leaves less
        room than the endpoint's limit): say so, since the client never sent the field the engine names."""
        message = engine_message(bytes(response.body)) or "the engine refused the request"
        return error_response(400, f"{message} (the request had no max_tokens, so this endpoint applied "
                                   f"max_tokens={filled}, its max_tokens_limit; send a max_tokens that fits)",
                              "invalid_request_error")

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
            except BaseException:  # client gone, request_timeout_s, or the engine is down before the first byte
                stream.cancel()
                raise
            if status in (429, 503):  # the engine refused before streaming (its waiting queue is full)
                stream.cancel()
                release()
                return busy_response("the engine's queue is full", self.settings.retry_after_s)
            if status != 200:  # an error answer (400 ...): relayed whole, as a plain response
                payload = b""
                try:
                    async for chunk in stream:
                        payload += chunk
                        if len(payload) > MAX_ERROR_BODY_BYTES:
                            break
                finally:
                    stream.cancel()
                    release()
                return engine_error(status, payload[:MAX_ERROR_BODY_BYTES])
            route = path

            def failed(code: int) -> None:
                self.metrics.stream_errors.labels(route, str(code)).inc()

            chunks = relay(stream, self.settings.request_timeout_s, release, failed)
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
            return busy_response("the engine's queue is full", self.settings.retry_after_s)
        if status != 200:
            return engine_error(status, payload)
        try:
            self.metrics.tokens.inc(json.loads(payload).get("usage", {}).get("completion_tokens", 0))
        except (ValueError, AttributeError):
            pass
        return Response(payload, status_code=status, media_type=ctype or None)
