"""The production ingress's life around the requests it answers (a base of `OpenAIIngress`): what it tells the
driver, the gap of a stop-then-start roll (`serve.production.roll`), and what it leaves behind when Serve stops it.
"""

from __future__ import annotations

import threading
from typing import Any

from serve.closed_loop.candidate_arm import CanaryArm
from serve.closed_loop.capture import Capture
from serve.http_errors import RequestRejected
from serve.production.roll import await_engines, deploy_timeout_s
from serve.production.settings import ProductionSettings
from serve.serving import ENGINE_DEPLOYMENTS, ServingConfig

__all__ = ["IngressLifecycle"]


class IngressLifecycle:
    """Set by `OpenAIIngress`'s constructor: these attributes, then `begin(roll, ...)`."""

    settings: ProductionSettings
    serving: dict[str, Any]
    capture: Capture
    canary: CanaryArm
    gap: str | None = None

    def begin(self, gap: bool, served: ServingConfig, routes: list[str]) -> None:
        """A new replica: any canary a replaced one left is removed. `gap`: no engine that could answer runs yet (a
        stop-then-start roll, a rollback after a failed roll), so until the controller reports this config's engines
        healthy, generation requests and /health answer 503 + Retry-After instead of queueing."""
        self.canary.remove_leftover()
        if gap:
            self.gap = (f"the endpoint is switching to version {self.serving['origin'].get('version') or 'new'}: "
                        "its engine is starting")
            names = [ENGINE_DEPLOYMENTS[route] for route in routes]
            threading.Thread(target=await_engines, name="roll-gap", daemon=True, args=(
                self.settings.app_name, names, deploy_timeout_s(served), self.announce_gap)).start()

    def __del__(self) -> None:
        """Serve calls this once the replica has drained (a roll, a scale-down, `serve.shutdown`): buffered capture
        rows are written, and a canary this replica runs goes with it (its engine would outlive it otherwise)."""
        capture, canary = getattr(self, "capture", None), getattr(self, "canary", None)
        if capture is not None:
            capture.close()
        if canary is not None:
            canary.abandon()

    def serving_now(self) -> dict[str, Any]:
        """What this replica serves (`serve.production.app.resolve_serving`'s dict): the driver compares a roll's."""
        return self.serving

    def announce_gap(self, why: str | None) -> None:
        """From now on (until None), generation requests and /health answer 503 + Retry-After saying `why`."""
        self.gap = why

    def in_gap(self) -> None:
        """Refuse a request during the gap (RequestRejected 503 + Retry-After)."""
        if self.gap is not None:
            raise RequestRejected(503, f"{self.gap}; retry after {self.settings.retry_after_s} s",
                                  "service_unavailable", {"Retry-After": str(self.settings.retry_after_s)})
