"""The live records of one ingress replica: a bounded ring of `serve.closed_loop.live.LiveRecord`s (the feed and summary of
`GET /v1/live` and `GET /v1/live/summary`) and the same figures as Prometheus metrics.

Bounds. The ring holds the latest `capacity` records (`ProductionSettings.live_records`); older ones are dropped and
a reader that fell behind is told how many (`LiveFeed.dropped`). Each ingress replica keeps its own ring and its
own metrics: with `num_replicas` > 1 a call reaches one replica, and its figures are that replica's traffic only.
Sequence numbers start at the replica's start time in microseconds, so a replica that replaces another (a roll, a
restart) continues above every number the old one gave out, and a reader's `after` stays meaningful.

Prometheus (labels `version`, `arm`, `route`, `bucket`): the label values are bounded by design: `version` is the
config this replica serves (a roll starts new replicas), `arm` production or candidate, `route` low or high, and
`bucket` a power-of-two concurrency bucket (`serve.closed_loop.live.bucket_label`: at most ~10 below the replica's
`max_ongoing_requests`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import ValidationError

from serve.http_errors import RequestRejected
from serve.closed_loop.live import MAX_ITL_SAMPLES, LiveFeed, LiveRecord, LiveSummary, bucket_label, summarize_live
from serve.closed_loop.live_stream import Measure

__all__ = ["LiveBook", "LiveMetrics", "version_label", "feed_query", "MAX_FEED_LIMIT", "subsample"]

log = logging.getLogger("serve.production.ingress")
# ASCII digits only, at most 19 (below 2**63): str.isdigit() also accepts "²" and other digits int() refuses, and
# int() refuses more than 4300 digits; both were 500s
_COUNT = re.compile(r"[0-9]{1,19}")
MAX_FEED_LIMIT = 10_000  # records per `GET /v1/live` answer
LABELS = ("version", "arm", "route", "bucket")
_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 300.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
_TOK_S = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0)
_TOKENS = (1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0)


def version_label(serving: dict[str, Any]) -> str:
    """The registry version served, or 'file:<sha1 prefix>' of the served config for a config file."""
    version = (serving.get("origin") or {}).get("version")
    if version:
        return str(version)
    digest = hashlib.sha1(json.dumps(serving.get("config"), sort_keys=True).encode()).hexdigest()
    return f"file:{digest[:12]}"


def subsample(gaps: list[float], limit: int = MAX_ITL_SAMPLES) -> tuple[float, ...]:
    """At most `limit` gaps, evenly spaced over the stream (all of them when there are fewer). Pure."""
    if len(gaps) <= limit:
        return tuple(gaps)
    return tuple(gaps[(i * len(gaps)) // limit] for i in range(limit))


def feed_query(params: Any) -> tuple[int, int]:
    """(after, limit) of `GET /v1/live?after=<seq>&limit=<n>`; a bad value is a 400 naming it."""
    out = []
    for name, default, low, high in (("after", 0, 0, None), ("limit", 1000, 1, MAX_FEED_LIMIT)):
        text = params.get(name)
        if text is None:
            out.append(default)
            continue
        if not _COUNT.fullmatch(text) or int(text) < low or (high is not None and int(text) > high):
            bound = f"between {low} and {high}" if high is not None else f">= {low}"
            raise RequestRejected(400, f"query parameter {name}={text[:40]!r} must be an integer {bound}")
        out.append(int(text))
    return out[0], out[1]


class LiveMetrics:
    """The live figures on `/metrics`; one observation per answered generation request."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = list(LABELS)
        self.requests = Counter("specdec_generation_requests", "answered generation requests (status as in the "
                                "live record: an error event's code, 499 for a stream the client left)",
                                [*labels, "status"], registry=registry)
        self.completion_tokens = Counter("specdec_completion_tokens", "completion tokens served (the engine's "
                                         "usage, streamed or not)", labels, registry=registry)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "prompt tokens of answered requests", labels,
                                     registry=registry)
        self.verify_steps = Counter("specdec_spec_verify_steps", "engine verify steps of requests that report "
                                    "them", labels, registry=registry)
        self.verified_tokens = Counter("specdec_spec_completion_tokens", "completion tokens of requests that "
                                       "report verify steps (accept length = this / specdec_spec_verify_steps)",
                                       labels, registry=registry)
        self.ttft = Histogram("specdec_ttft_seconds", "arrival to the first generated text", labels,
                              buckets=_LATENCY, registry=registry)
        self.itl = Histogram("specdec_itl_seconds", "gaps between consecutive streamed text chunks", labels,
                             buckets=_ITL, registry=registry)
        self.e2e = Histogram("specdec_e2e_seconds", "arrival to the last byte (a stream's [DONE])", labels,
                             buckets=_LATENCY, registry=registry)
        self.tput = Histogram("specdec_output_tokens_per_second", "per-request completion tokens / e2e seconds",
                              labels, buckets=_TOK_S, registry=registry)
        self.prompt_len = Histogram("specdec_request_prompt_tokens", "prompt tokens per request", labels,
                                    buckets=_TOKENS, registry=registry)
        self.completion_len = Histogram("specdec_request_completion_tokens", "completion tokens per request",
                                        labels, buckets=_TOKENS, registry=registry)

    def observe(self, record: LiveRecord, gaps: list[float]) -> None:
        key = (record.version, record.arm, record.route, bucket_label(record.concurrency))
        self.requests.labels(*key, str(record.status)).inc()
        if not record.ok:
            return
        self.completion_tokens.labels(*key).inc(record.completion_tokens)
        self.prompt_tokens.labels(*key).inc(record.prompt_tokens)
        if record.spec_verify_ct:
            self.verify_steps.labels(*key).inc(record.spec_verify_ct)
            self.verified_tokens.labels(*key).inc(record.completion_tokens)
        if record.ttft_s is not None:
            self.ttft.labels(*key).observe(record.ttft_s)
        itl = self.itl.labels(*key)
        for gap in gaps:  # every gap here; the record keeps a subsample
            itl.observe(gap)
        self.e2e.labels(*key).observe(record.e2e_s)
        if record.tput_tok_s is not None:
            self.tput.labels(*key).observe(record.tput_tok_s)
        self.prompt_len.labels(*key).observe(record.prompt_tokens)
        self.completion_len.labels(*key).observe(record.completion_tokens)


class LiveBook:
    """One ingress replica's live records (module docstring for the bounds)."""

    def __init__(self, capacity: int, version: str, registry: CollectorRegistry) -> None:
        self.capacity, self.version = capacity, version
        self.records: deque[LiveRecord] = deque(maxlen=capacity)
        self.first_seq = time.time_ns() // 1000  # numbers this replica gives out are above it
        self.seq = self.first_seq
        self.metrics = LiveMetrics(registry)

    def record(self, measure: Measure, sent: int, ended: float) -> LiveRecord | None:
        """Add the record of one answered request (`sent`: the HTTP status sent; `ended`: monotonic end time).
        None (logged) when the answer does not make a valid record: measuring never fails a request."""
        status = measure.status(sent)
        e2e = max(0.0, ended - measure.arrived)
        ttft = None if measure.first_text is None else max(0.0, measure.first_text - measure.arrived)
        try:
            record = LiveRecord(
                seq=self.seq + 1, t_ms=int(time.time() * 1000), version=measure.version or self.version,
                arm=measure.arm,  # type: ignore[arg-type]
                route=measure.route, api=measure.api, concurrency=measure.concurrency,  # type: ignore[arg-type]
                status=status, streamed=measure.streamed, prompt_tokens=measure.prompt_tokens,
                completion_tokens=measure.completion_tokens, e2e_s=e2e, ttft_s=ttft, itl_s=subsample(measure.gaps),
                spec_verify_ct=measure.verify_steps)
        except ValidationError as exc:
            log.warning("live record of a %s answer not kept: %s", measure.api[:40], exc.errors()[0]["msg"])
            return None
        self.seq += 1
        self.records.append(record)
        self.metrics.observe(record, measure.gaps)
        return record

    def feed(self, after: int, limit: int) -> LiveFeed:
        held = list(self.records)
        oldest = held[0].seq if held else self.seq + 1
        # numbers this replica gave out after `after` but no longer holds
        dropped = max(0, oldest - max(after + 1, self.first_seq + 1))
        rows = [r for r in held if r.seq > after][:limit]
        return LiveFeed(records=tuple(rows), next=rows[-1].seq if rows else after, dropped=dropped,
                        capacity=self.capacity)

    def summary(self) -> LiveSummary:
        return summarize_live(self.records)
