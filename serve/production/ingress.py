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
(`serve.production.stream_relay`); `/health` asks every engine within `health_timeout_s` (503 when one is gone, 504 when one
does not answer). Every answer, 401s and 500s included, is counted in `/metrics`; a streamed answer's latency ends at
its last byte. Auth (`serve.production.auth`) follows the address Serve's proxy really binds
(`serve.production.settings`). No `/docs` or `/openapi.json`. API keys, request bodies and generated text are never
logged.

Serving policy (`serve.serving.RoutingPolicy`, shown by `/v1/config`): with two engines, a generation request that
makes more than `switch_above` generation requests in flight at this ingress replica goes to the high-concurrency
engine; the answer's `x-specdec-route` header says which engine served it (`low` / `high`).

Live figures (`serve.closed_loop.live`, `serve.closed_loop.live_book`, `serve.closed_loop.live_stream`): every generation request forwarded to an engine
becomes one `LiveRecord` when its answer ends (a stream: at `data: [DONE]`), with the engine's token counts (a
streamed request asks the engine for its usage chunk, which a client that did not ask never sees) and the same
figures as Prometheus histograms and counters (labels `version`, `arm`, `route`, `bucket`). `GET /v1/live` and
`GET /v1/live/summary` serve them (this replica's ring of `live_records`); the closed loop posts its drift verdicts
to `POST /v1/drift` (shown on `/v1/config` and `/metrics`) and reads the capture's parts from `GET /v1/capture` and
`GET /v1/capture/<name>`; it runs a canary of a candidate version on a share of the traffic (`serve.closed_loop.candidate_arm`, routes
`/v1/canary*`; a candidate that fails is taken over by production, `serve.closed_loop.failover`). The capture,
drift and canary routes take an admin key only (`serve.production.settings`); `/v1/config` shows a user key no
captured text and no server path (`serve.production.config_view`). Rolls, their gap and the replica's stop:
`serve.production.ingress_lifecycle`.
"""


import asyncio
import json
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import generate_latest
from ray import serve
from ray.serve.exceptions import BackPressureError

from serve.closed_loop.candidate_arm import CanaryArm
from serve.closed_loop.control import (CANARY_PATH, CANARY_SHARE_PATH, CANARY_START_PATH, CANARY_STOP_PATH, CAPTURE_PATH,
                                   DRIFT_PATH, CanaryShare, CanaryStart, CanaryStop, DriftReport)
from serve.closed_loop.capture import Capture
from serve.closed_loop.failover import CandidateUnfit, resumable
from serve.http_errors import (RequestRejected, busy_response, error_response, failure_answer, log_failure,
                               unavailable_response)
from serve.engines import engine_for
from serve.production.auth import IngressAuth
from serve.http_limits import BadJson, check_max_tokens, check_required, fill_max_tokens, parse_json, read_body
from serve.production.config_view import user_view
from serve.production.generate import generate, production_stream, takeover_for
from serve.production.ingress_support import IngressMetrics, bounded, explain_filled, serve_bind_host, timed
from serve.closed_loop.live import CANDIDATE_ARM, LIVE_PATH, LIVE_SUMMARY_PATH, PRODUCTION_ARM, summarize_live
from serve.closed_loop.live_book import LiveBook, feed_query, version_label
from serve.closed_loop.live_stream import Added, Measure, ask_spec_details, ask_usage
from serve.closed_loop.control_routes import PARQUET_MEDIA_TYPE, DriftBoard, capture_listing, capture_part, contract_body
from serve.production.ingress_lifecycle import IngressLifecycle
from serve.production.stream_relay import leaving
from serve.production.settings import (ProductionSettings, admin_access, auth_problem, auth_required,
                                       load_admin_keys, load_api_keys)
from serve.serving import HIGH, LOW, RoutingPolicy, ServingConfig

app = FastAPI(title="specdec-tuner production endpoint", docs_url=None, redoc_url=None, openapi_url=None)


# Serve freezes the FastAPI app while this module is still being imported (`@serve.ingress` pickles the app, whose
# routes point at the class, and unpickling rebinds the class's methods to a copy of this module's globals taken at
# that moment). A name a method uses must therefore be bound ABOVE this line: one defined further down is missing
# in the replica (a NameError on every request that reaches it). tests/unit/test_production_ingress.py checks it.
@serve.deployment(max_ongoing_requests=512, ray_actor_options={"num_cpus": 0.1}, graceful_shutdown_timeout_s=120,
                  graceful_shutdown_wait_loop_s=1)
@serve.ingress(app)
class OpenAIIngress(IngressAuth, IngressLifecycle):
    def __init__(self, engine: Any, settings: dict[str, Any], serving: dict[str, Any],
                 high_engine: Any = None, gap: bool = False) -> None:
        self.engine = engine
        # The policy decides which engine a generation request goes to (one config: always `engine`).
        served = ServingConfig.model_validate(serving["config"])
        self.policy = served.policy or RoutingPolicy(
            text="one config at every level (a serving config without a per-level policy)", source="(replica)")
        if (self.policy.high is None) != (high_engine is None):
            raise RuntimeError(f"the serving policy has {'two' if self.policy.high else 'one'} engine(s) but the "
                               f"ingress was given {'two' if high_engine is not None else 'one'}")
        self.engines = {LOW: engine, **({HIGH: high_engine} if high_engine is not None else {})}
        self.in_flight = 0  # generation requests this replica is forwarding now (the router's load signal)
        self.routed = {route: 0 for route in self.engines}
        # per arm and engine: a live record's concurrency
        self.route_in_flight = {(arm, route): 0 for arm in (PRODUCTION_ARM, CANDIDATE_ARM) for route in (LOW, HIGH)}
        self.settings = ProductionSettings.model_validate(settings)
        self.serving = serving
        # live accept length where the engine returns per-request spec counters (Engine.spec_details)
        self.spec_details = engine_for(served.replica.engine).spec_details
        self.keys = [key.encode() for key in load_api_keys(self.settings)]
        self.admin_keys = [key.encode() for key in load_admin_keys(self.settings)]
        # unknown bind address: assume it is public (fail closed)
        self.bind_host = serve_bind_host() or "0.0.0.0"
        problem = auth_problem(self.settings, self.bind_host, [k.decode() for k in self.keys],
                               [k.decode() for k in self.admin_keys])
        if problem:
            raise RuntimeError(problem)
        self.enforce = bool(self.keys or self.admin_keys) or auth_required(self.settings, self.bind_host)
        self.metrics = IngressMetrics()
        self.live = LiveBook(self.settings.live_records, version_label(serving), self.metrics.registry)
        self.drift = DriftBoard(self.metrics.registry)
        self.canary = CanaryArm(self.settings)
        self.capture = Capture(self.settings.capture, self.settings.max_tokens_limit)  # off unless configured
        self.begin(gap, served, list(self.engines))

    # --- checks --------------------------------------------------------------------------------------------------

    async def _body(self, request: Request) -> tuple[bytes, dict[str, Any], int | None]:
        """(body to forward, its JSON object, the max_tokens the endpoint filled in or None)."""
        body = await read_body(request.receive, self.settings.max_request_bytes, request.headers.get("content-length"))
        try:
            data = parse_json(body)
        except BadJson as exc:
            raise RequestRejected(400, f"request body: {exc}") from None
        if not isinstance(data, dict):
            raise RequestRejected(400, "request body must be a JSON object")
        check_required(data, request.url.path)
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
        if self.gap is not None:
            response = unavailable_response(self.gap, self.settings.retry_after_s)
        for engine in self.engines.values() if self.gap is None else ():
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
        # A user key sees no captured text and no server path (serve.production.config_view).
        shown = {**self.serving["config"], "origin": self.serving["origin"],
                 "version": self.serving["origin"].get("version"),
                 "routing": {"switch_above": self.policy.switch_above, "in_flight": self.in_flight,
                             "routed": dict(self.routed)},
                 "drift": self.drift.shown(), "canary": self.canary.status().model_dump(mode="json")}
        admin = admin_access(self.bind_host, len(self.keys), len(self.admin_keys), self._key_kind(request)) is None
        return JSONResponse(shown if admin else user_view(shown))

    @app.get("/metrics")
    async def prometheus(self, request: Request) -> Response:
        return await self._guarded(request, "/metrics", self._prometheus)

    async def _prometheus(self, request: Request) -> Response:
        try:  # the engine's counters are a bonus: a dead engine must not hide the ingress's own metrics
            status, _, body = await bounded(self.engine.call.remote("GET", "/server_info"),
                                            self.settings.health_timeout_s)
            self.metrics.engine_state(body if status == 200 else b"{}")
        except Exception:  # noqa: BLE001
            pass
        return PlainTextResponse(generate_latest(self.metrics.registry).decode(), media_type="text/plain")

    @app.get(LIVE_PATH)
    async def live_feed(self, request: Request) -> Response:
        return await self._guarded(request, LIVE_PATH, self._live_feed)

    async def _live_feed(self, request: Request) -> Response:
        after, limit = feed_query(request.query_params)
        return JSONResponse(self.live.feed(after, limit).model_dump(mode="json"))

    @app.get(LIVE_SUMMARY_PATH)
    async def live_summary(self, request: Request) -> Response:
        return await self._guarded(request, LIVE_SUMMARY_PATH, self._live_summary)

    async def _live_summary(self, request: Request) -> Response:
        held = list(self.live.records)  # a copy: the ring changes while the summary is computed off the loop
        return JSONResponse((await asyncio.to_thread(summarize_live, held)).model_dump(mode="json"))

    @app.post(DRIFT_PATH)
    async def post_drift(self, request: Request) -> Response:
        return await self._guarded(request, DRIFT_PATH, self._post_drift, admin=True)

    async def _post_drift(self, request: Request) -> Response:
        self.drift.post(contract_body(DriftReport, await self._posted(request)))
        return JSONResponse({"drift": self.drift.shown()})

    async def _posted(self, request: Request) -> Any:
        body = await read_body(request.receive, self.settings.max_request_bytes, request.headers.get("content-length"))
        try:
            return parse_json(body)
        except BadJson as exc:
            raise RequestRejected(400, f"request body: {exc}") from None

    @app.get(CANARY_PATH)
    async def canary_status(self, request: Request) -> Response:
        return await self._guarded(request, CANARY_PATH, self._canary, admin=True)

    @app.post(CANARY_START_PATH)
    async def canary_start(self, request: Request) -> Response:
        return await self._guarded(request, CANARY_START_PATH, self._canary, admin=True)

    @app.post(CANARY_SHARE_PATH)
    async def canary_share(self, request: Request) -> Response:
        return await self._guarded(request, CANARY_SHARE_PATH, self._canary, admin=True)

    @app.post(CANARY_STOP_PATH)
    async def canary_stop(self, request: Request) -> Response:
        return await self._guarded(request, CANARY_STOP_PATH, self._canary, admin=True)

    async def _canary(self, request: Request) -> Response:
        path, canary = request.url.path, self.canary
        canary.called()
        if path == CANARY_START_PATH:
            canary.start(contract_body(CanaryStart, await self._posted(request)))
        elif path == CANARY_SHARE_PATH:
            canary.share = contract_body(CanaryShare, await self._posted(request)).share
        elif path == CANARY_STOP_PATH:
            canary.stop(contract_body(CanaryStop, await self._posted(request)).reason)
        return JSONResponse(canary.status().model_dump(mode="json"))

    @app.get(CAPTURE_PATH)
    async def capture_parts(self, request: Request) -> Response:
        return await self._guarded(request, CAPTURE_PATH, self._capture_parts, admin=True)

    async def _capture_parts(self, request: Request) -> Response:
        return JSONResponse((await capture_listing(self.settings.capture)).model_dump(mode="json"))

    @app.get(CAPTURE_PATH + "/{name}")
    async def capture_file(self, request: Request, name: str) -> Response:
        return await self._guarded(request, CAPTURE_PATH + "/<name>", self._capture_file, admin=True)

    async def _capture_file(self, request: Request) -> Response:
        name = request.path_params["name"]
        return Response(await capture_part(self.settings.capture, name), media_type=PARQUET_MEDIA_TYPE)

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        return await self._guarded(request, "/v1/models", self._forward)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._guarded(request, "/v1/completions", self._forward)

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._guarded(request, "/v1/chat/completions", self._forward)

    async def _guarded(self, request: Request, route: str, handler: Any, admin: bool = False) -> Response:
        """Auth (`admin`: an admin key only), the handler within request_timeout_s, and one answer for every outcome
        (each counted)."""
        started = request.state.arrived = time.monotonic()
        try:
            self._authorize(request, admin)
            async with asyncio.timeout(self.settings.request_timeout_s):  # in this task: no exception left unread
                response = await handler(request)
        except RequestRejected as rejected:
            response = error_response(rejected.status, rejected.message, rejected.kind, rejected.headers)
        except BackPressureError:
            response = busy_response("the engine's queue is full", self.settings.retry_after_s)
        except asyncio.TimeoutError:
            response = error_response(504, f"the request took longer than request_timeout_s="
                                           f"{self.settings.request_timeout_s:g}; it was cancelled", "timeout_error")
        except Exception as exc:  # noqa: BLE001 - every failure is an answer in OpenAI's shape, and is counted
            if leaving():  # the client left and Serve cancelled the calls (RequestCancelledError): no one to answer
                raise asyncio.CancelledError from None
            response = self._failure(route, exc)
        data = getattr(request.state, "body", None)
        response = await self.capture.observe(route, data, response)  # opt-in traffic capture (serve.closed_loop.capture)
        measure = getattr(request.state, "live", None)
        if measure is not None and not measure.metered:  # a metered stream records itself when it ends
            self.live.record(measure, response.status_code, time.monotonic())
        self.metrics.requests.labels(route, str(response.status_code)).inc()
        latency = self.metrics.latency.labels(route)
        if getattr(response, "body_iterator", None) is not None:
            response.body_iterator = timed(response.body_iterator,
                                           lambda: latency.observe(time.monotonic() - started))
        else:
            latency.observe(time.monotonic() - started)
        return response

    def _failure(self, route: str, exc: BaseException) -> Response:
        status, message = failure_answer(exc)
        if status == 503:
            return unavailable_response(message, self.settings.retry_after_s)
        if status == 500:
            log_failure(route, exc)
        return error_response(status, message, "timeout_error" if status == 504 else "server_error")

    async def _forward(self, request: Request) -> Response:
        self.in_gap()
        path = request.url.path
        if request.method == "GET":
            status, ctype, body = await self.engine.call.remote("GET", path)
            return Response(body, status_code=status, media_type=ctype or None)
        body, data, filled = await self._body(request)
        route = self.policy.route(self.in_flight + 1)  # +1: this request counts towards the level it creates
        streaming = bool(data.get("stream"))
        # What the engine is asked for the live figures and the client did not ask: kept from the client's answer.
        added = Added(usage=streaming and ask_usage(data), spec=self.spec_details and ask_spec_details(data))
        if added.usage or added.spec:
            body = json.dumps(data).encode()
        candidate = self.canary.pick()  # None: production's engine
        if candidate is not None:  # the candidate runs its config's one (low-concurrency) engine
            try:
                return await self._answer(request, candidate, CANDIDATE_ARM, LOW, body, streaming, added, filled,
                                          production_route=route, greedy=resumable(data))
            except (asyncio.CancelledError, RequestRejected):
                raise
            except Exception as exc:  # noqa: BLE001 - it failed before its first byte: production answers
                busy = isinstance(exc, CandidateUnfit) and exc.status in (429, 503)
                if not busy:  # a full queue is load, not a failure of the candidate
                    self.canary.candidate_failed(str(exc) if isinstance(exc, CandidateUnfit)
                                                 else failure_answer(exc)[1])
        return await self._answer(request, self.engines[route], PRODUCTION_ARM, route, body, streaming, added,
                                  filled)

    async def _answer(self, request: Request, engine: Any, arm: str, route: str, body: bytes, streaming: bool,
                      added: Added, filled: int | None, production_route: str = LOW, greedy: bool = False
                      ) -> Response:
        """One arm's attempt at a generation request. The candidate's: a failure before its first byte is recorded
        against it (its live record) and raised for `_forward` to hand the request to production."""
        release = self._enter(route, arm)
        path = request.url.path
        measure = request.state.live = Measure(getattr(request.state, "arrived", time.monotonic()), path, route,
                                               self.route_in_flight[(arm, route)], streaming, arm,
                                               self.canary.version if arm == CANDIDATE_ARM else None)
        takeover = None
        if arm == CANDIDATE_ARM:
            def failed(why: str) -> None:  # the candidate failed mid-stream; production finishes the answer
                measure.error_status = 503
                self.canary.candidate_failed(why)

            production = self.engines[production_route]
            takeover = takeover_for(lambda: production_stream(production, path, body), greedy, failed)
        try:
            response = await generate(engine, path, body, streaming, release, measure, added, self.settings,
                                      self.metrics, self.live, takeover)
        except BaseException as exc:
            release()
            if arm == CANDIDATE_ARM and isinstance(exc, Exception):
                request.state.live = None  # recorded here: _guarded records the attempt that answers
                self.live.record(measure, getattr(exc, "status", None) or failure_answer(exc)[0], time.monotonic())
            raise
        if response.status_code == 400 and filled is not None:
            response = explain_filled(response, filled)
        response.headers["x-specdec-route"] = route
        return response

    def _enter(self, route: str, arm: str) -> Any:
        """Count a generation request in flight; returns its idempotent release (a stream releases when it ends)."""
        self.in_flight += 1
        self.route_in_flight[(arm, route)] += 1
        self.canary.in_flight += arm == CANDIDATE_ARM
        if arm == PRODUCTION_ARM:
            self.routed[route] += 1
            self.metrics.routed.labels(route).inc()
        self.metrics.in_flight.set(self.in_flight)
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.in_flight -= 1
                self.route_in_flight[(arm, route)] -= 1
                self.canary.in_flight -= arm == CANDIDATE_ARM
                self.metrics.in_flight.set(self.in_flight)

        return release
