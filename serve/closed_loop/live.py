"""Live figures of the production endpoint: the record kept for every answered generation request, the JSON shapes of
the routes that export them, and the concurrency buckets they are grouped by. Pure types and functions, no I/O.

The endpoint (`serve/production/ingress.py`) fills one `LiveRecord` per generation request it answered and serves them, in
order, on `GET /v1/live?after=<seq>&limit=<n>` (`LiveFeed`) and summarized per group on `GET /v1/live/summary`
(`LiveSummary`, computed by `summarize_live`); the closed loop (`pipeline/loop/`) reads them to test for drift and to
compare a canary with production. Both sides use these types, so the shapes cannot drift apart. Prometheus metrics
of the same figures use the same groups (`version`, `arm`, `route`, `bucket_label(concurrency)`).

Definitions (what the endpoint must measure, streamed or not):
- `e2e_s`: from the request's arrival at the ingress to the last byte of the answer (for a stream, `data: [DONE]`).
- `ttft_s`: to the first byte carrying generated text; None when none was sent.
- `itl_s`: gaps between consecutive streamed chunks after the first (a chunk may carry several tokens when drafts
  are accepted); at most `MAX_ITL_SAMPLES`, a uniform subsample of a longer stream; empty for a non-streamed answer.
- `completion_tokens` / `prompt_tokens`: the engine's counts for this request (OpenAI `usage`; for a stream, the
  engine's final usage chunk), never a count of chunks.
- `spec_verify_ct`: the engine's verify steps for this request (SGLang `meta_info.spec_verify_ct`), None when the
  engine reports none; accept length = completion_tokens / spec_verify_ct, as the study measures it.
- `concurrency`: generation requests in flight at the engine that answered (this arm and route, at this ingress
  replica), this request included, when it was forwarded: the closed-loop concurrency a study measures at.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np
from pydantic import Field

from serve.latency import latency_percentiles_ms
from serve.spec import FrozenModel

__all__ = ["LIVE_PATH", "LIVE_SUMMARY_PATH", "MAX_ITL_SAMPLES", "PRODUCTION_ARM", "CANDIDATE_ARM", "Arm",
           "LiveRecord", "LiveFeed", "LiveFigures", "LiveSummary", "bucket_of", "bucket_label", "summarize_live"]

LIVE_PATH = "/v1/live"
LIVE_SUMMARY_PATH = "/v1/live/summary"
MAX_ITL_SAMPLES = 256
PRODUCTION_ARM, CANDIDATE_ARM = "production", "candidate"
Arm = Literal["production", "candidate"]


class LiveRecord(FrozenModel):
    """One answered generation request, as the endpoint saw it (module docstring for every definition)."""

    seq: int = Field(ge=0, description="position in the endpoint's feed, increasing by one per record")
    t_ms: int = Field(ge=0, description="unix time (ms) at which the answer ended")
    version: str = Field(min_length=1, description="registry version of the config that answered, or "
                                                   "'file:<sha1 prefix>' for a config file")
    arm: Arm = Field(description="production, or the candidate of a running canary")
    route: Literal["low", "high"] = Field(description="serving-policy engine (serve.serving LOW/HIGH)")
    api: Literal["/v1/completions", "/v1/chat/completions"]
    concurrency: int = Field(ge=1)
    status: int = Field(ge=100, le=599, description="HTTP status sent (a stream cut by an error event counts as "
                                                    "the error's code)")
    streamed: bool
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    e2e_s: float = Field(ge=0, allow_inf_nan=False)
    ttft_s: float | None = Field(None, ge=0, allow_inf_nan=False)
    itl_s: tuple[float, ...] = Field((), max_length=MAX_ITL_SAMPLES)
    spec_verify_ct: int | None = Field(None, ge=0)

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def accept_length(self) -> float | None:
        """Tokens per verify step of this request (None: failed, or no speculative counters)."""
        if not self.ok or not self.spec_verify_ct:
            return None
        return self.completion_tokens / self.spec_verify_ct

    @property
    def tput_tok_s(self) -> float | None:
        """Output tokens per second of this request, end to end (None: failed, empty, or no duration)."""
        if not self.ok or self.completion_tokens <= 0 or self.e2e_s <= 0:
            return None
        return self.completion_tokens / self.e2e_s


class LiveFeed(FrozenModel):
    """`GET /v1/live?after=<seq>&limit=<n>`: the records with `seq > after`, oldest first, at most `limit`.
    `next` is the `after` of the following call; `dropped` counts records after `after` that the endpoint no longer
    holds (its buffer of `capacity` records wrapped), so a reader knows it missed some."""

    records: tuple[LiveRecord, ...]
    next: int = Field(ge=0)
    dropped: int = Field(0, ge=0)
    capacity: int = Field(ge=1)


class LiveFigures(FrozenModel):
    """One group's figures in `GET /v1/live/summary` (None = no sample)."""

    version: str
    arm: Arm
    route: Literal["low", "high"]
    bucket: str = Field(description="concurrency bucket (bucket_label)")
    requests: int
    errors: int
    tput_tok_s_p50: float | None = Field(description="median of the per-request output tokens/s")
    accept_length: float | None = Field(description="sum completion tokens / sum verify steps")
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    itl_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p90_ms: float | None
    e2e_p99_ms: float | None
    prompt_tokens_p50: float | None
    prompt_tokens_p90: float | None
    completion_tokens_p50: float | None
    completion_tokens_p90: float | None


class LiveSummary(FrozenModel):
    """`GET /v1/live/summary`: the records the endpoint holds, grouped, from `first_ms` to `last_ms`."""

    first_ms: int | None
    last_ms: int | None
    figures: tuple[LiveFigures, ...]


def bucket_of(concurrency: int) -> int:
    """The power of two at or above `concurrency` (1, 2, 4, 8, ...): live requests at 3 or 4 in flight are compared
    with a study's level 4. Pure."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency must be an integer >= 1, got {concurrency!r}")
    return 1 << (concurrency - 1).bit_length()


def bucket_label(concurrency: int) -> str:
    """'1', '2', '3-4', '5-8', ...: the bucket of `concurrency` as a Prometheus label value."""
    top = bucket_of(concurrency)
    low = top // 2 + 1
    return str(top) if low >= top else f"{low}-{top}"


def _quantile(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else None


def summarize_live(records: Iterable[LiveRecord]) -> LiveSummary:
    """Group by (version, arm, route, concurrency bucket) and compute each group's figures. Pure."""
    groups: dict[tuple[str, str, str, str], list[LiveRecord]] = defaultdict(list)
    first: int | None = None
    last: int | None = None
    for r in records:
        groups[(r.version, r.arm, r.route, bucket_label(r.concurrency))].append(r)
        first = r.t_ms if first is None else min(first, r.t_ms)
        last = r.t_ms if last is None else max(last, r.t_ms)
    figures = []
    for (version, arm, route, bucket), rows in sorted(groups.items()):
        ok = [r for r in rows if r.ok]
        verify = sum(r.spec_verify_ct or 0 for r in ok if r.spec_verify_ct)
        spec_tokens = sum(r.completion_tokens for r in ok if r.spec_verify_ct)
        tputs = [t for t in (r.tput_tok_s for r in ok) if t is not None]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        itl = [gap for r in ok for gap in r.itl_s]
        e2e = [r.e2e_s for r in ok]
        figures.append(LiveFigures(
            version=version, arm=arm, route=route, bucket=bucket,  # type: ignore[arg-type]
            requests=len(rows), errors=len(rows) - len(ok), tput_tok_s_p50=_quantile(tputs, 50),
            accept_length=spec_tokens / verify if verify else None,
            **latency_percentiles_ms(ttft, itl, e2e),
            prompt_tokens_p50=_quantile([r.prompt_tokens for r in ok], 50),
            prompt_tokens_p90=_quantile([r.prompt_tokens for r in ok], 90),
            completion_tokens_p50=_quantile([r.completion_tokens for r in ok], 50),
            completion_tokens_p90=_quantile([r.completion_tokens for r in ok], 90)))
    return LiveSummary(first_ms=first, last_ms=last, figures=tuple(figures))
