"""HTTP client of the production endpoint's routes the loop uses: `/v1/config` (what it serves), the live feed
(`serve.closed_loop.live`), the canary and capture routes (`serve.closed_loop.control`). Every answer is validated against those
types; a route the endpoint does not serve is an `EndpointError` saying so, with the fix.
"""

from __future__ import annotations

from typing import Any

import httpx
from pydantic import BaseModel, ValidationError

from pipeline.errors import PipelineError
from serve.closed_loop.control import (CANARY_PATH, CANARY_SHARE_PATH, CANARY_START_PATH, CANARY_STOP_PATH,
                                   CAPTURE_PATH, DRIFT_PATH, CanaryShare, CanaryStart, CanaryStatus, CanaryStop,
                                   CaptureListing, DriftReport)
from serve.closed_loop.live import LIVE_PATH, LiveFeed

__all__ = ["EndpointError", "RouteMissing", "EndpointClient"]


class EndpointError(PipelineError):
    """The endpoint refused or is unreachable (the loop tries again at its next poll)."""


class RouteMissing(EndpointError):
    """The endpoint does not serve a route the loop needs: trying again cannot help."""


class EndpointClient:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: BaseModel | None = None, params: dict[str, Any] | None = None,
              raw: bool = False) -> Any:
        try:
            response = httpx.request(method, f"{self.url}{path}", headers=self.headers, params=params,
                                     content=body.model_dump_json() if body is not None else None,
                                     timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise EndpointError(f"{method} {self.url}{path}: {type(exc).__name__}: {exc}") from None
        if response.status_code == 404:
            raise RouteMissing(f"{self.url} does not serve {method} {path}: the endpoint predates the closed loop "
                                "(docs/loop.md, 'What the endpoint serves'); update it, or run the step by hand")
        if response.status_code in (401, 403):
            raise EndpointError(f"{method} {self.url}{path}: {response.status_code}; the loop's routes take an admin "
                                "key: pass --api-key (or set SPECDEC_ADMIN_KEY)")
        if response.status_code >= 400:
            raise EndpointError(f"{method} {self.url}{path}: {response.status_code} {response.text[:500]}")
        if raw:
            return response.content
        try:
            return response.json()
        except ValueError:
            raise EndpointError(f"{method} {self.url}{path}: the answer is not JSON: {response.text[:200]!r}") \
                from None

    @staticmethod
    def _typed(kind: type[BaseModel], data: Any, where: str) -> Any:
        try:
            return kind.model_validate(data)
        except ValidationError as exc:
            raise EndpointError(f"{where}: the endpoint's answer does not follow {kind.__name__} "
                                f"({exc.errors()[0]['msg']} at {exc.errors()[0]['loc']})") from None

    def config(self) -> dict[str, Any]:
        """`/v1/config`: the served ServingConfig fields plus `origin` and `version`."""
        data = self._call("GET", "/v1/config")
        if not isinstance(data, dict):
            raise EndpointError(f"{self.url}/v1/config did not answer a JSON object")
        return data

    def served_version(self) -> str | None:
        version = self.config().get("version")
        return None if version is None else str(version)

    def live(self, after: int, limit: int = 5000) -> LiveFeed:
        return self._typed(LiveFeed, self._call("GET", LIVE_PATH, params={"after": after, "limit": limit}),
                           LIVE_PATH)

    def canary(self) -> CanaryStatus:
        return self._typed(CanaryStatus, self._call("GET", CANARY_PATH), CANARY_PATH)

    def canary_start(self, start: CanaryStart) -> CanaryStatus:
        return self._typed(CanaryStatus, self._call("POST", CANARY_START_PATH, start), CANARY_START_PATH)

    def canary_share(self, share: float) -> CanaryStatus:
        return self._typed(CanaryStatus, self._call("POST", CANARY_SHARE_PATH, CanaryShare(share=share)),
                           CANARY_SHARE_PATH)

    def canary_stop(self, reason: str) -> CanaryStatus:
        return self._typed(CanaryStatus, self._call("POST", CANARY_STOP_PATH, CanaryStop(reason=reason[:2000])),
                           CANARY_STOP_PATH)

    def post_drift(self, report: DriftReport) -> None:
        self._call("POST", DRIFT_PATH, report)

    def capture_listing(self) -> CaptureListing:
        return self._typed(CaptureListing, self._call("GET", CAPTURE_PATH), CAPTURE_PATH)

    def capture_part(self, name: str) -> bytes:
        return self._call("GET", f"{CAPTURE_PATH}/{name}", raw=True)
