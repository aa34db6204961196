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
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator

from serve.spec import FrozenModel

__all__ = ["Contract", "MAX_LEASE_S", "CANARY_PATH", "CANARY_START_PATH", "CANARY_SHARE_PATH", "CANARY_STOP_PATH", "CAPTURE_PATH",
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
MAX_LEASE_S = 86_400.0  # a day: a lease is how long an unwatched candidate may keep its share
# Strict numbers: a JSON number only, never a string ("0.5", "NaN", "inf") or a boolean; finite (allow_inf_nan off
# on every model below). A NaN that got into a drift report could not be written back out: `/v1/drift` and every
# later `/v1/config` answered 500.
Number = Annotated[float, Field(strict=True)]
Count = Annotated[int, Field(strict=True)]
Flag = Annotated[bool, Field(strict=True)]


class Contract(FrozenModel):
    """Base of the contract's shapes: unknown keys refused, immutable, numbers finite."""

    model_config = ConfigDict(**FrozenModel.model_config, allow_inf_nan=False)


class CandidateRef(Contract):
    """A registered serving config: the endpoint loads it from its own registry (its `tracking_uri`)."""

    registered_model: str = Field(min_length=1)
    version: str = Field(pattern=r"^[0-9]+$", description="a version number, never an alias: what is canaried must "
                                                          "not move while it runs")


class CanaryStart(Contract):
    candidate: CandidateRef
    share: Number = Field(gt=0, le=1)
    lease_s: Number = Field(900.0, ge=10, le=MAX_LEASE_S, description="stop the canary when no canary route was "
                                                                        "called for this long")


class CanaryShare(Contract):
    share: Number = Field(gt=0, le=1)


class CanaryStop(Contract):
    reason: str = Field(min_length=1, max_length=2000)


class CanaryStatus(Contract):
    state: CanaryState
    candidate: CandidateRef | None = None
    share: Number = Field(0.0, ge=0, le=1)
    started_ms: Count | None = Field(None, description="unix ms the candidate began taking requests")
    requests: dict[Literal["production", "candidate"], int] = Field(
        default_factory=dict, description="generation requests each arm got since the canary started")
    reason: str | None = Field(None, description="why the canary is failed / stopping / off (the last stop)")


class CapturePart(Contract):
    name: str
    rows: Count = Field(ge=0)
    bytes: Count = Field(ge=0)
    mtime_ms: Count = Field(ge=0)

    @field_validator("name")
    @classmethod
    def _part(cls, value: str) -> str:
        if not PART_NAME.match(value):
            raise ValueError(f"capture part name {value!r} is not a part file name (part-<tag>-<seq>.parquet)")
        return value


class CaptureListing(Contract):
    parts: tuple[CapturePart, ...]
    max_rows: Count = Field(ge=1, description="the capture's bound; capture stops at it (serve/closed_loop/capture.py)")


class DriftLine(Contract):
    """One figure's drift test at one concurrency bucket (`pipeline.loop.drift.DriftVerdict`, flattened)."""

    metric: str
    bucket: Count = Field(ge=1)
    alarm: Flag
    statistic: Number
    threshold: Number
    requests: Count = Field(ge=0)
    live_mean: Number | None
    reference_mean: Number
    text: str


class DriftReport(Contract):
    at_ms: Count = Field(ge=0)
    reference_version: str
    lines: tuple[DriftLine, ...]
    shift: str | None = Field(None, description="the workload-shift summary, when the loop computed one")
