"""The candidate arm of the production endpoint's canary (`serve.closed_loop.control` states the semantics).

One ingress replica owns it: `POST /v1/canary/start` deploys the candidate's engine as its own Serve application
(`<app>-canary`, no HTTP route; the production app and its engines are never touched), and once it runs, `pick`
sends each generation request to it with probability `share`. `stop` sends every new request to production, waits
for the candidate's in-flight requests (at most `request_timeout_s`) and deletes the candidate's application.

Lease: a canary whose controller called no canary route for `lease_s` is stopped by the endpoint itself (`lease
expired`). A call checks the lease before it renews it (a status poll cannot revive an expired canary), and a timer
checks it every `LEASE_CHECK_S` while the canary is on, so an abandoned canary ends without any traffic.

A candidate whose engine fails (`candidate_failed`: the ingress saw it fail a request, which production then served)
ends the canary in state `failed` with the reason, and the loop rolls back.

Nothing outlives its owner: `abandon` (the ingress replica stops: a roll, `serve.shutdown`) deletes the candidate's
application, and a new ingress replica deletes one a replaced replica left (`remove_leftover`), so no candidate
engine keeps its resources (a GPU) once no ingress routes to it.

The candidate serves its registered config's low-concurrency engine (`replica`); a two-engine policy's second
engine is not canaried. The canary needs one ingress replica (`num_replicas: 1`): a second replica would deploy,
share and stop its own copy of the same application.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from serve.closed_loop.control import CanaryStart, CanaryStatus
from serve.closed_loop.live import CANDIDATE_ARM, PRODUCTION_ARM
from serve.http_errors import RequestRejected
from serve.production.settings import ProductionSettings
from serve.replica.status import app_state, wait_for_app

__all__ = ["CanaryArm", "CANARY_ENGINE", "LEASE_CHECK_S"]

log = logging.getLogger("serve.production.ingress")
CANARY_ENGINE = "EngineBackend"  # the candidate app's engine deployment
LEASE_CHECK_S = 1.0  # the lease timer's period while a canary is on


class CanaryArm:
    def __init__(self, settings: ProductionSettings, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.app = f"{settings.app_name}-canary"
        self.rng = rng or random.Random()
        self.clock = clock
        self.state = "off"
        self.start_request: CanaryStart | None = None
        self.share = 0.0
        self.started_ms: int | None = None
        self.requests = {PRODUCTION_ARM: 0, CANDIDATE_ARM: 0}
        self.reason: str | None = None
        self.handle: Any = None
        self.in_flight = 0
        self.last_call = clock()
        self.deploying: asyncio.Task[None] | None = None
        self.tearing_down: asyncio.Task[None] | None = None
        self.watching: asyncio.Task[None] | None = None
        self.final_state = "off"  # what a stop ends in: `failed` when the candidate's engine failed
        self.abandoned = False

    @property
    def version(self) -> str:
        return self.start_request.candidate.version if self.start_request is not None else ""

    def status(self) -> CanaryStatus:
        return CanaryStatus(state=self.state, candidate=self.start_request.candidate if self.start_request else None,
                            share=self.share, started_ms=self.started_ms, requests=dict(self.requests),  # type: ignore[arg-type]
                            reason=self.reason)

    def called(self) -> None:
        """A canary route was called: the lease is checked as it stood, then renewed."""
        self.check_lease()
        self.last_call = self.clock()

    def check_lease(self) -> None:
        lease = self.start_request.lease_s if self.start_request is not None else None
        if self.state in ("starting", "running") and lease is not None and self.clock() - self.last_call > lease:
            self.stop("lease expired")

    def start(self, start: CanaryStart) -> CanaryStatus:
        if self.state in ("starting", "running", "stopping"):
            raise RequestRejected(409, f"a canary is {self.state} (candidate version {self.version}); stop it "
                                       "first (POST /v1/canary/stop)", "conflict_error")
        self.start_request, self.share, self.state, self.reason = start, start.share, "starting", None
        self.started_ms, self.requests, self.final_state = None, {PRODUCTION_ARM: 0, CANDIDATE_ARM: 0}, "off"
        self.last_call = self.clock()
        loop = asyncio.get_running_loop()
        self.deploying = loop.create_task(self._deploy(start))
        self.watching = loop.create_task(self._watch_lease())
        return self.status()

    async def _watch_lease(self) -> None:
        while self.state in ("starting", "running"):
            await asyncio.sleep(LEASE_CHECK_S)
            self.check_lease()

    async def _deploy(self, start: CanaryStart) -> None:
        try:
            handle = await asyncio.to_thread(self.deploy_blocking, start)
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot start leaves production serving
            if self.state == "starting":
                self.state, self.reason = "failed", f"{type(exc).__name__}: {str(exc)[:1500]}"
            return
        if self.state == "starting":
            self.handle, self.state, self.started_ms = handle, "running", int(time.time() * 1000)

    def deploy_blocking(self, start: CanaryStart) -> Any:
        """Deploy the candidate's engine and wait until it runs; its Serve handle (a worker thread)."""
        from ray import serve

        from serve.production.engine_app import engine_deployment, load_serving_config

        ref = start.candidate
        config = load_serving_config(self.settings.tracking_uri, f"models:/{ref.registered_model}/{ref.version}")
        replica = config.replica
        if self.settings.threads is not None:
            replica = replica.model_copy(update={"threads": self.settings.threads})
        serve.run_many([serve.RunTarget(engine_deployment(self.settings, replica, CANARY_ENGINE), name=self.app,
                                        route_prefix=None)], wait_for_applications_running=False)
        state = wait_for_app(self.app, replica.start_timeout_s + 60, lambda s: s.status in ("RUNNING", "DEPLOY_FAILED"),
                             keep_waiting=lambda: self.state == "starting")
        if state is not None and state.status == "RUNNING":
            return serve.get_deployment_handle(CANARY_ENGINE, self.app)
        if state is not None:
            raise RuntimeError(f"the candidate's engine failed to deploy: {state.message}")
        raise TimeoutError(f"the candidate's engine was not running after {replica.start_timeout_s + 60:.0f} s")

    def pick(self) -> Any:
        """The candidate's engine handle for this request (None: production's), counted per arm."""
        self.check_lease()
        if self.state != "running":
            return None
        arm = CANDIDATE_ARM if self.rng.random() < self.share else PRODUCTION_ARM
        self.requests[arm] += 1
        return self.handle if arm == CANDIDATE_ARM else None

    def candidate_failed(self, why: str) -> None:
        """The candidate's engine failed a request (production served it instead): the canary ends `failed`."""
        if self.state not in ("starting", "running"):
            return
        log.warning("canary of version %s: the candidate's engine failed (%s); production serves every request",
                    self.version, why[:300])
        self.stop(f"the candidate's engine failed: {why[:1500]}", final_state="failed")

    def stop(self, reason: str, final_state: str = "off") -> CanaryStatus:
        if self.state in ("off", "stopping"):
            return self.status()
        self.state, self.reason, self.final_state = "stopping", reason, final_state
        self.tearing_down = asyncio.get_running_loop().create_task(self._teardown())
        return self.status()

    async def _teardown(self) -> None:
        if self.deploying is not None:
            await self.deploying  # its poll ends once the state left `starting`; it never raises
        deadline = time.monotonic() + self.settings.request_timeout_s
        while self.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)  # the candidate's last requests finish (bounded by request_timeout_s)
        self.handle = None
        try:
            await asyncio.to_thread(self.delete_blocking)
        except Exception as exc:  # noqa: BLE001 - the app may never have been created (a failed start)
            self.reason = f"{self.reason}; deleting {self.app}: {type(exc).__name__}"
        if self.state == "stopping":
            self.state = self.final_state

    def delete_blocking(self, wait: bool = True) -> None:
        """Delete the candidate's application (a no-op when there is none)."""
        from ray import serve

        if app_state(self.app).exists:
            serve.delete(self.app, _blocking=wait)

    def remove_leftover(self) -> threading.Thread:
        """A new ingress replica starts with no canary: a candidate application that exists was left by a replica
        that is gone (a roll replaced it mid-canary). Deleted on a thread; returned for tests to join."""
        def remove() -> None:
            try:
                from ray import serve

                if self.state == "off" and app_state(self.app).exists:
                    log.warning("deleting %s: a canary left by a replaced ingress replica", self.app)
                    serve.delete(self.app, _blocking=False)
            except Exception as exc:  # noqa: BLE001 - never stops the ingress from starting
                log.warning("could not check for a leftover %s: %s", self.app, type(exc).__name__)

        thread = threading.Thread(target=remove, name="canary-leftover", daemon=True)
        thread.start()
        return thread

    def abandon(self) -> None:
        """The ingress replica stops: delete the candidate's application with it (without waiting). Once."""
        torn = self.tearing_down is not None and self.tearing_down.done()
        if self.abandoned or (self.state == "off" and (self.tearing_down is None or torn)) or \
                (self.state == "failed" and torn):
            return  # never started, or stopped and deleted already
        self.abandoned, self.state, self.handle = True, "off", None
        try:
            self.delete_blocking(wait=False)
        except Exception as exc:  # noqa: BLE001 - shutting down: say it, do not raise
            log.warning("could not delete %s at shutdown: %s", self.app, type(exc).__name__)
