"""The control routes the closed loop drives on the production endpoint: canary start / share / stop / status, and the
traffic capture's parts. Paths and JSON shapes only (pure types); the endpoint implements them,
`pipeline/loop/client.py` calls them, and both validate against these models, so neither can change a shape alone.

Canary semantics the endpoint guarantees:
- `POST /v1/canary/start` (`CanaryStart`): deploy the candidate's engines (the registered serving config
  `models:/<registered_model>/<version>`) beside production's, and once they are ready send each generation request
  to the candidate with probability `share`, independently of everything else (so both arms see the same traffic
  mix). Production's engines are never touched. While the candidate starts, `state` is `starting` and every request
  goes to production; a candidate that fails to start leaves `state` `failed` with the reason, production serving.
  A second start while a canary is on is refused (409).
- `POST /v1/canary/share` (`CanaryShare`): change the share (0 < share <= 1).
- `POST /v1/canary/stop` (`CanaryStop`): send every new request to production; the candidate's engines are deleted
  once their in-flight requests have finished (state `stopping`, then `off`). Idempotent.
- `GET /v1/canary` (`CanaryStatus`): the state, the candidate, the share and the requests each arm got. A call renews
  the lease: a canary whose controller has not called any canary route for `lease_s` is stopped by the endpoint
  itself (reason `lease expired`), so a loop that died mid-canary cannot leave traffic on an unwatched candidate.
- Every answer carries the live records' `arm` (`serve.closed_loop.live.LiveRecord`), and `/v1/config` adds `canary` (the
  `CanaryStatus`) beside what it serves.

Drift: `POST /v1/drift` (`DriftReport`): the loop posts its drift verdicts and workload-shift summary after every
poll; the endpoint shows the latest on `/v1/config` (`drift`) and `/metrics` (`specdec_drift_statistic` and
`specdec_drift_alarm`, labels `metric`, `bucket`), so the test runs in one place and both read the same.

Capture: `GET /v1/capture` (`CaptureListing`) lists the capture directory's parts (`serve/closed_loop/capture.py`), `GET
/v1/capture/<name>` returns one part's Parquet bytes. Captured rows hold user prompts and answers: these routes, like
the canary routes, take only an admin key (`ADMIN_KEYS_ENV`), never a user key; without admin keys they answer 403,
except on an endpoint bound to localhost without keys at all (docs/security.md).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from serve.spec import FrozenModel

__all__ = ["CANARY_PATH", "CANARY_START_PATH", "CANARY_SHARE_PATH", "CANARY_STOP_PATH", "CAPTURE_PATH",
           "ADMIN_KEYS_ENV", "CandidateRef", "CanaryStart", "CanaryShare", "CanaryStop", "CanaryState",
           "CanaryStatus", "CapturePart", "CaptureListing", "PART_NAME", "DRIFT_PATH", "DriftLine", "DriftReport"]

CANARY_PATH = "/v1/canary"
CANARY_START_PATH = "/v1/canary/start"
CANARY_SHARE_PATH = "/v1/canary/share"
CANARY_STOP_PATH = "/v1/canary/stop"
CAPTURE_PATH = "/v1/capture"
DRIFT_PATH = "/v1/drift"
ADMIN_KEYS_ENV = "SPECDEC_ADMIN_KEYS"
PART_NAME = re.compile(r"^part-[A-Za-z0-9]+-[0-9]+\.parquet$")  # serve/closed_loop/capture.py's part names; nothing else served

CanaryState = Literal["off", "starting", "running", "stopping", "failed"]


class CandidateRef(FrozenModel):
    """A registered serving config: the endpoint loads it from its own registry (its `tracking_uri`)."""

    registered_model: str = Field(min_length=1)
    version: str = Field(pattern=r"^[0-9]+$", description="a version number, never an alias: what is canaried must "
                                                          "not move while it runs")


class CanaryStart(FrozenModel):
    candidate: CandidateRef
    share: float = Field(gt=0, le=1)
    lease_s: float = Field(900.0, ge=10, description="stop the canary when no canary route was called for this long")


class CanaryShare(FrozenModel):
    share: float = Field(gt=0, le=1)


class CanaryStop(FrozenModel):
    reason: str = Field(min_length=1, max_length=2000)


class CanaryStatus(FrozenModel):
    state: CanaryState
    candidate: CandidateRef | None = None
    share: float = Field(0.0, ge=0, le=1)
    started_ms: int | None = Field(None, description="unix ms the candidate began taking requests")
    requests: dict[Literal["production", "candidate"], int] = Field(
        default_factory=dict, description="generation requests each arm got since the canary started")
    reason: str | None = Field(None, description="why the canary is failed / stopping / off (the last stop)")


class CapturePart(FrozenModel):
    name: str
    rows: int = Field(ge=0)
    bytes: int = Field(ge=0)
    mtime_ms: int = Field(ge=0)

    @field_validator("name")
    @classmethod
    def _part(cls, value: str) -> str:
        if not PART_NAME.match(value):
            raise ValueError(f"capture part name {value!r} is not a part file name (part-<tag>-<seq>.parquet)")
        return value


class CaptureListing(FrozenModel):
    parts: tuple[CapturePart, ...]
    max_rows: int = Field(ge=1, description="the capture's bound; capture stops at it (serve/closed_loop/capture.py)")


class DriftLine(FrozenModel):
    """One figure's drift test at one concurrency bucket (`pipeline.loop.drift.DriftVerdict`, flattened)."""

    metric: str
    bucket: int = Field(ge=1)
    alarm: bool
    statistic: float
    threshold: float
    requests: int = Field(ge=0)
    live_mean: float | None
    reference_mean: float
    text: str


class DriftReport(FrozenModel):
    at_ms: int = Field(ge=0)
    reference_version: str
    lines: tuple[DriftLine, ...]
    shift: str | None = Field(None, description="the workload-shift summary, when the loop computed one")
