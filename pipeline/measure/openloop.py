"""Open-loop load: requests arrive at a given rate (Poisson), whether or not earlier ones finished.

Closed-loop load (`pipeline/measure/load.py`) holds `concurrency` requests in flight, so a slow engine slows its own traffic
down; production traffic does not wait. Here arrivals are a seeded Poisson process (exponential gaps, mean
1/`rate_per_s`), bounded by a request count (the prompts given) and a time window (`max_duration_s`: no request
starts after it; started ones run to completion or their timeout). Each request goes through load.py's own
streaming request path, so records have the same format as `run_phase`'s. `RequestRecord.concurrency` must hold one
level per window (`pipeline.measure.summary.summarize`), so every record carries `label` there (default 1): open-loop load
has no fixed concurrency, and the rate is the caller's to record (`summarize(..., offered_rate_per_s=...)`).
A study uses it when `workload.arrival.mode` is `poisson` (`pipeline.trial.pruning.measure_phase`, for trials and finalist
re-runs alike).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from typing import Any

import httpx

from pipeline.measure.load import LoadRequest, _one  # the one streaming request path (engineer I owns load.py)
from pipeline.measure.summary import RequestRecord


def poisson_schedule(count: int, rate_per_s: float, *, seed: int, max_duration_s: float | None = None) -> list[float]:
    """Start offsets (s, from the window start) of up to `count` Poisson arrivals at `rate_per_s`, seeded. The first
    arrival is at 0 (the window opens with a request); arrivals past `max_duration_s` are dropped. Pure."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an integer >= 0, got count={count!r}")
    if not (isinstance(rate_per_s, (int, float)) and math.isfinite(rate_per_s) and rate_per_s > 0):
        raise ValueError(f"rate_per_s must be a finite number > 0 (requests per second), got {rate_per_s!r}")
    if max_duration_s is not None and not (math.isfinite(max_duration_s) and max_duration_s > 0):
        raise ValueError(f"max_duration_s must be a finite number > 0 or None, got {max_duration_s!r}")
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for i in range(count):
        if i:
            now += rng.expovariate(rate_per_s)
        if max_duration_s is not None and now > max_duration_s:
            break
        offsets.append(now)
    return offsets


async def run_open_loop_async(base_url: str, items: Sequence[LoadRequest], *, rate_per_s: float, seed: int,
                              phase: str = "measure", max_duration_s: float | None = None, label: int = 1,
                              temperature: float = 0.0, timeout_s: float = 300.0) -> list[RequestRecord]:
    """Send `items` in order at Poisson arrival times; returns one record per request sent, in order. Requests
    whose arrival falls after `max_duration_s` are not sent."""
    offsets = poisson_schedule(len(items), rate_per_s, seed=seed, max_duration_s=max_duration_s)
    if label < 1:
        raise ValueError(f"label must be >= 1 (it fills RequestRecord.concurrency), got {label}")
    # Every request may be in flight at once: the pool must not queue them, or the loop would close again.
    limits = httpx.Limits(max_connections=len(offsets) + 2, max_keepalive_connections=len(offsets) + 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s, connect=30),
                                 limits=limits) as client:
        window_start = time.monotonic()

        async def arrive(position: int, offset: float) -> RequestRecord:
            # A loop, not one sleep: uvloop's (libuv's) timers are millisecond-granular and fire up to 1 ms early,
            # and a trial process may run uvloop (Ray Serve installs it); no request may start before its arrival.
            while (delay := window_start + offset - time.monotonic()) > 0:
                await asyncio.sleep(delay)
            return await _one(client, items[position], phase=phase, concurrency=label, window_start=window_start,
                              temperature=temperature, timeout_s=timeout_s, request_id=f"{phase}-{position}")

        return list(await asyncio.gather(*(arrive(i, off) for i, off in enumerate(offsets))))


def run_open_loop(base_url: str, items: Sequence[LoadRequest], **kwargs: Any) -> list[RequestRecord]:
    """Synchronous wrapper of `run_open_loop_async`."""
    return asyncio.run(run_open_loop_async(base_url, items, **kwargs))
