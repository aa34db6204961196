"""Per-request records of one trial's traffic and their summary: throughput, accept length, latencies, a bootstrap CI.

Pure: no I/O, no Ray, no MLflow, no torch. The load generator (`pipeline/measure/load.py`) fills one `RequestRecord` per
request; `pipeline/records/tracking.py` writes `to_table(records)` as Parquet (an equivalence pass's as
`records_json`) and logs `summarize(...).to_metrics()`.

Field meanings follow SGLang 0.5.23 `/generate` `meta_info` (reference/sglang-0.5.23.md §4.1): the `spec_*` counts
are null when the engine reports none (no speculation, or a request that finished in prefill).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from serve.latency import latency_percentiles_ms

# `reference`: requests a trial sends after its measurement only to record their answers (the baseline answers the
# rest of the warm-up split for the acceptance simulator, pipeline/simulate); never part of a summary.
PHASES: tuple[str, ...] = ("warmup", "measure", "reference")

REQUEST_SCHEMA: pa.Schema = pa.schema(
    [
        pa.field("request_id", pa.string(), nullable=False),
        pa.field("phase", pa.string(), nullable=False),
        pa.field("prompt_index", pa.int32(), nullable=False),
        pa.field("concurrency", pa.int32(), nullable=False),
        pa.field("start_s", pa.float64(), nullable=False),
        pa.field("ttft_s", pa.float64()),
        pa.field("e2e_s", pa.float64(), nullable=False),
        pa.field("itl_s", pa.list_(pa.float64()), nullable=False),
        pa.field("prompt_tokens", pa.int32(), nullable=False),
        pa.field("completion_tokens", pa.int32(), nullable=False),
        pa.field("spec_verify_ct", pa.int32()),
        pa.field("spec_num_correct_drafts", pa.int32()),
        pa.field("spec_num_proposed_drafts", pa.int32()),
        pa.field("spec_accept_length", pa.float64()),
        pa.field("finish_reason", pa.string(), nullable=False),
        pa.field("error", pa.string()),
        pa.field("output_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("output_sha1", pa.string(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32())),
    ],
    metadata={"specdec_tuner.request_schema": "2"},
)


def output_sha1(output_ids: Iterable[int]) -> str:
    """sha1 hex of the output token ids written as ASCII decimals joined by ',' (e.g. b"5,17,2"); language-neutral."""
    return hashlib.sha1(",".join(str(int(t)) for t in output_ids).encode("ascii")).hexdigest()


@dataclass(frozen=True, kw_only=True)
class RequestRecord:
    """One request as the client saw it. Times are seconds on a monotonic clock.

    `start_s` is relative to the start of the request's phase window. `ttft_s` is null when no token arrived.
    `itl_s` holds the gaps between streamed chunks after the first one (a chunk may carry several tokens when
    speculation accepts drafts). A failed request sets `error` (its `finish_reason` is then e.g. "error").
    `output_sha1` may be left empty: it is then computed from `output_ids`; if given it must match them.
    `prompt_ids`: the prompt's token ids as the engine saw them, when the client knew them (sent as `input_ids`, or
    the text tokenized as the engine tokenizes it); None otherwise. The acceptance simulator replays them.
    """

    request_id: str
    phase: Literal["warmup", "measure", "reference"]
    prompt_index: int
    concurrency: int
    start_s: float
    ttft_s: float | None
    e2e_s: float
    itl_s: tuple[float, ...] = ()
    prompt_tokens: int
    completion_tokens: int
    spec_verify_ct: int | None = None
    spec_num_correct_drafts: int | None = None
    spec_num_proposed_drafts: int | None = None
    spec_accept_length: float | None = None
    finish_reason: str
    error: str | None = None
    output_ids: tuple[int, ...] = ()
    output_sha1: str = ""
    prompt_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        where = f"request {self.request_id!r}"
        if self.phase not in PHASES:
            raise ValueError(f"{where}: phase must be one of {PHASES}, got phase={self.phase!r}")
        for name, low in (("prompt_index", 0), ("concurrency", 1), ("prompt_tokens", 0), ("completion_tokens", 0)):
            _check_int(where, name, getattr(self, name), low)
        for name in ("spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts"):
            if getattr(self, name) is not None:
                _check_int(where, name, getattr(self, name), 0)
        for name in ("start_s", "e2e_s", "ttft_s", "spec_accept_length"):
            _check_seconds(where, name, getattr(self, name))
        # Tuples keep the record immutable and hashable even when the caller passes lists.
        itl = tuple(float(x) for x in self.itl_s)
        if any(not math.isfinite(x) or x < 0 for x in itl):
            raise ValueError(f"{where}: itl_s must hold finite gaps >= 0, got {list(itl)}")
        ids = tuple(int(t) for t in self.output_ids)
        digest = output_sha1(ids)
        if self.output_sha1 and self.output_sha1 != digest:
            raise ValueError(
                f"{where}: output_sha1={self.output_sha1!r} does not match output_ids (expected {digest!r}); "
                "leave output_sha1 empty to have it computed")
        object.__setattr__(self, "itl_s", itl)
        object.__setattr__(self, "output_ids", ids)
        object.__setattr__(self, "output_sha1", digest)
        if self.prompt_ids is not None:
            object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))

    @property
    def ok(self) -> bool:
        return self.error is None

    @staticmethod
    def to_table(records: Iterable[RequestRecord]) -> pa.Table:
        """Records as an Arrow table with `REQUEST_SCHEMA` (what `pipeline/records/tracking.py` writes as Parquet)."""
        return to_table(records)


_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(RequestRecord))
_LATER_FIELDS: frozenset[str] = frozenset({"prompt_ids"})  # schema 2


def to_table(records: Iterable[RequestRecord]) -> pa.Table:
    """Records as an Arrow table with `REQUEST_SCHEMA`; an empty input gives an empty table of that schema."""
    rows = [{name: getattr(r, name) for name in _FIELD_NAMES} for r in records]
    return pa.Table.from_pylist(rows, schema=REQUEST_SCHEMA)


def to_records(table_or_records: pa.Table | Iterable[RequestRecord]) -> list[RequestRecord]:
    """Accept a table (e.g. read back from Parquet) or records; rows are validated as `RequestRecord`s."""
    if not isinstance(table_or_records, pa.Table):
        records = list(table_or_records)
        for i, r in enumerate(records):
            if not isinstance(r, RequestRecord):
                raise TypeError(f"records[{i}] must be a RequestRecord, got {type(r).__name__}")
        return records
    # columns added to the schema later (an older table lacks them): read as their default
    missing = [n for n in _FIELD_NAMES if n not in table_or_records.column_names and n not in _LATER_FIELDS]
    if missing:
        raise ValueError(
            f"request table lacks column(s) {missing}; it must follow pipeline.measure.summary.REQUEST_SCHEMA "
            f"(columns {list(_FIELD_NAMES)})")
    present = [n for n in _FIELD_NAMES if n in table_or_records.column_names]
    return [RequestRecord(**{n: row[n] for n in present}) for row in table_or_records.to_pylist()]


def records_json(records: Iterable[RequestRecord]) -> str:
    """The measured requests among `records` as JSON (a run's artifact: a baseline's equivalence pass)."""
    return json.dumps([asdict(r) for r in records if r.phase == "measure"])


def records_from_json(text: str) -> list[RequestRecord]:
    """`records_json`'s text read back, each row validated as a `RequestRecord`."""
    rows: list[dict[str, Any]] = [{k: tuple(v) if isinstance(v, list) else v for k, v in item.items()}
                                  for item in json.loads(text)]
    return [RequestRecord(**row) for row in rows]


def chunks(total: int, size: int) -> list[range]:
    """Positions of a phase of `total` requests measured in chunks of `size` (the concurrency: every chunk keeps
    `size` requests in flight, as the unchunked closed loop does, except the last one's tail)."""
    for name, value, low in (("total", total, 0), ("size", size, 1)):
        _check_int("chunks", name, value, low)
    return [range(first, min(first + size, total)) for first in range(0, total, size)]


def continue_records(records: Iterable[RequestRecord], *, offset_s: float, first_position: int) -> list[RequestRecord]:
    """One chunk's records re-based onto the whole phase: `start_s` shifted by `offset_s` (when the chunk started in
    the phase's window) and ids renumbered from `first_position` (`<phase>-<position>`, as the load generator names
    them), so that a phase measured in chunks summarizes like one run of the phase."""
    _check_seconds("continue_records", "offset_s", offset_s)
    _check_int("continue_records", "first_position", first_position, 0)
    return [replace(r, start_s=r.start_s + offset_s, request_id=f"{r.phase}-{first_position + i}")
            for i, r in enumerate(records)]


def _check_int(where: str, name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where}: {name} must be an integer >= {low}, got {name}={value!r}")


def _check_seconds(where: str, name: str, value: float | None) -> None:
    if value is None:
        if name in ("start_s", "e2e_s"):
            raise ValueError(f"{where}: {name} is required, got None")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {name} must be a finite number >= 0, got {name}={value!r}")


class Summary(BaseModel):
    """One trial's measurement, flat and named for MLflow metrics. None = not measurable (see each field).

    Only measurement-phase requests count; throughput and latencies use the successful ones (error is null).
    - `window_s`: last end - first start over *all* measurement requests, failed ones included, because a request
      that timed out still held the engine; `tput_tok_s` = completion tokens of successful requests / `window_s`.
    - `accept_len`: sum completion_tokens / sum spec_verify_ct over successful requests that carry spec counts
      (SGLang's per-request `spec_accept_length`, aggregated; it includes the prefill token). `accept_len_drafts`
      = 1 + sum correct drafts / sum verify steps (excludes the prefill token). Both None without speculation.
    - Percentiles (linear interpolation) in milliseconds; ITL pools every gap of every successful request.
      None when there is no sample.
    - `tput_ci_low/high`: seeded bootstrap 95% CI of `tput_tok_s`; None with fewer than 2 successful requests (or a
      zero-latency one, which only a clock bug makes).
      Requests overlap at concurrency > 1, so resampling requests and recomputing a window is meaningless. The
      bootstrap resamples requests as (completion tokens, e2e seconds) pairs and recomputes the ratio
      R = sum tokens / sum e2e; throughput = R x (sum e2e / window), and the second factor is the mean number of
      requests in flight, which the load generator holds fixed, so the CI is tput x the 2.5/97.5% quantiles of
      R_boot / R. It covers request-to-request variation within this run only; run-to-run noise is what the
      promotion rule's repeated runs and MAD are for. Under open-loop arrivals the number in flight is not held
      fixed, so there the CI covers the per-request rate only.
    - Open loop (`offered_rate_per_s` given, else both None): `offered_rate_per_s` is the configured Poisson rate,
      `arrival_rate_per_s` the rate the seeded schedule actually drew ((sent - 1) / time from the first start to the
      last; None with one request). The achieved rate is `req_per_s` (completed requests per second of window); when
      it falls short of the arrival rate, the engine did not keep up and requests queued (latencies show it). Throughput
      is then bounded by the offered load, so configs that both keep up differ mainly in latency.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    n_requests: int
    n_ok: int
    n_errors: int
    error_rate: float
    n_warmup_requests: int
    n_warmup_errors: int
    concurrency: int | None
    window_s: float
    completion_tokens: int
    tput_tok_s: float
    tput_ci_low: float | None
    tput_ci_high: float | None
    req_per_s: float
    accept_len: float | None
    accept_len_drafts: float | None
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    itl_p99_ms: float | None
    e2e_p50_ms: float | None
    e2e_p90_ms: float | None
    e2e_p99_ms: float | None
    seed: int
    n_boot: int
    offered_rate_per_s: float | None = None
    arrival_rate_per_s: float | None = None

    def to_metrics(self) -> dict[str, float]:
        """The numeric fields for `mlflow.log_metrics` (None dropped: MLflow has no null metric)."""
        skip = {"seed", "n_boot"}
        return {k: float(v) for k, v in self.model_dump().items() if v is not None and k not in skip}


MIN_BOOT = 100
# Bound the bootstrap's index matrix (n_boot x n) to about 8 MB per chunk.
_BOOT_CHUNK_ELEMENTS = 1_000_000


def summarize(table_or_records: pa.Table | Iterable[RequestRecord], *, seed: int, n_boot: int = 1000,
              offered_rate_per_s: float | None = None) -> Summary:
    """Summarize one trial's records at one concurrency (see `Summary` for every definition). `offered_rate_per_s`:
    the Poisson rate of an open-loop measurement (None = closed loop).

    Empty or all-failed input gives zero throughput and the error counts, not an exception. Mixed concurrency
    levels among the measurement requests are an error: summarize each level on its own.
    """
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < MIN_BOOT:
        raise ValueError(f"n_boot must be an integer >= {MIN_BOOT} for a 95% interval, got n_boot={n_boot!r}")
    if offered_rate_per_s is not None and not (
            isinstance(offered_rate_per_s, (int, float)) and math.isfinite(offered_rate_per_s)
            and offered_rate_per_s > 0):
        raise ValueError(f"offered_rate_per_s must be a finite number > 0 or None, got {offered_rate_per_s!r}")
    records = to_records(table_or_records)
    warmup = [r for r in records if r.phase == "warmup"]
    measured = [r for r in records if r.phase == "measure"]
    ok = [r for r in measured if r.ok]
    levels = sorted({r.concurrency for r in measured})
    if len(levels) > 1:
        raise ValueError(
            f"measurement records mix concurrency levels {levels}; summarize each level separately "
            "(filter the records by concurrency first)")

    window = 0.0
    if measured:
        window = max(r.start_s + r.e2e_s for r in measured) - min(r.start_s for r in measured)
    tokens = sum(r.completion_tokens for r in ok)
    tput = tokens / window if window > 0 else 0.0
    ci_low, ci_high = _bootstrap_ci(ok, tput, seed=seed, n_boot=n_boot)
    accept_len, accept_len_drafts = _accept_lengths(ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    e2e = [r.e2e_s for r in ok]
    n_errors = len(measured) - len(ok)
    return Summary(
        n_requests=len(measured),
        n_ok=len(ok),
        n_errors=n_errors,
        error_rate=n_errors / len(measured) if measured else 0.0,
        n_warmup_requests=len(warmup),
        n_warmup_errors=sum(1 for r in warmup if not r.ok),
        concurrency=levels[0] if levels else None,
        window_s=window,
        completion_tokens=tokens,
        tput_tok_s=tput,
        tput_ci_low=ci_low,
        tput_ci_high=ci_high,
        req_per_s=len(ok) / window if window > 0 else 0.0,
        accept_len=accept_len,
        accept_len_drafts=accept_len_drafts,
        **latency_percentiles_ms(ttft, itl, e2e),
        seed=seed,
        n_boot=n_boot,
        offered_rate_per_s=float(offered_rate_per_s) if offered_rate_per_s is not None else None,
        arrival_rate_per_s=_arrival_rate(measured) if offered_rate_per_s is not None else None,
    )


def _arrival_rate(measured: Sequence[RequestRecord]) -> float | None:
    starts = sorted(r.start_s for r in measured)
    span = starts[-1] - starts[0] if len(starts) > 1 else 0.0
    return (len(starts) - 1) / span if span > 0 else None


def _accept_lengths(ok: Sequence[RequestRecord]) -> tuple[float | None, float | None]:
    # A request that finished in prefill carries no spec counts (SGLang omits them); it is left out of both sums
    # rather than counted as zero verify steps.
    spec = [r for r in ok if r.spec_verify_ct]
    verify = sum(r.spec_verify_ct or 0 for r in spec)
    if not verify:
        return None, None
    accept_len = sum(r.completion_tokens for r in spec) / verify
    with_drafts = [r for r in spec if r.spec_num_correct_drafts is not None]
    drafts_verify = sum(r.spec_verify_ct or 0 for r in with_drafts)
    if not drafts_verify:
        return accept_len, None
    return accept_len, 1.0 + sum(r.spec_num_correct_drafts or 0 for r in with_drafts) / drafts_verify


def _bootstrap_ci(
    ok: Sequence[RequestRecord], tput: float, *, seed: int, n_boot: int,
) -> tuple[float | None, float | None]:
    if len(ok) < 2:
        return None, None
    tokens = np.array([r.completion_tokens for r in ok], dtype=np.float64)
    e2e = np.array([r.e2e_s for r in ok], dtype=np.float64)
    if e2e.min() <= 0.0:
        # A zero-latency request (a clock bug upstream) can make a resample's denominator zero: no honest CI.
        return None, None
    ratio = tokens.sum() / e2e.sum()
    if ratio == 0.0 or tput == 0.0:
        return 0.0, 0.0
    rng = np.random.default_rng(seed)
    n = len(ok)
    rows = max(1, _BOOT_CHUNK_ELEMENTS // n)
    ratios = []
    for start in range(0, n_boot, rows):
        idx = rng.integers(0, n, size=(min(rows, n_boot - start), n))
        ratios.append(tokens[idx].sum(axis=1) / e2e[idx].sum(axis=1))
    low, high = np.quantile(np.concatenate(ratios) / ratio, [0.025, 0.975])
    return float(tput * low), float(tput * high)
