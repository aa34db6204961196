"""pipeline.measure.summary: the per-request record, its Arrow table, and the summary. Expectations are hand-computed."""

from __future__ import annotations

import hashlib
import io
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.measure.summary import REQUEST_SCHEMA, RequestRecord, Summary, output_sha1, summarize, to_records, to_table


def rec(i: int = 0, **kw: Any) -> RequestRecord:
    base: dict[str, Any] = dict(
        request_id=f"r{i}", phase="measure", prompt_index=i, concurrency=1, start_s=0.0, ttft_s=0.1, e2e_s=1.0,
        itl_s=(), prompt_tokens=10, completion_tokens=10, finish_reason="length", output_ids=(1, 2, 3))
    base.update(kw)
    return RequestRecord(**base)


# --- record and table -------------------------------------------------------------------------------------------

def test_output_sha1_is_sha1_of_comma_joined_decimal_ids():
    assert output_sha1([5, 17, 2]) == hashlib.sha1(b"5,17,2").hexdigest()
    assert rec(output_ids=[5, 17, 2]).output_sha1 == hashlib.sha1(b"5,17,2").hexdigest()


def test_record_rejects_a_sha1_that_does_not_match_the_ids():
    with pytest.raises(ValueError, match="output_sha1='abc' does not match output_ids"):
        rec(output_ids=[1, 2], output_sha1="abc")


@pytest.mark.parametrize(("field", "value", "message"), [
    ("phase", "warm", "phase must be one of"),
    ("concurrency", 0, "concurrency must be an integer >= 1, got concurrency=0"),
    ("completion_tokens", -1, "completion_tokens must be an integer >= 0"),
    ("e2e_s", float("nan"), "e2e_s must be a finite number >= 0"),
    ("ttft_s", -0.5, "ttft_s must be a finite number >= 0"),
    ("spec_verify_ct", 2.5, "spec_verify_ct must be an integer"),
    ("itl_s", [0.1, -0.2], "itl_s must hold finite gaps >= 0"),
])
def test_record_validation_names_field_and_value(field, value, message):
    with pytest.raises(ValueError, match=message) as err:
        rec(request_id="req-7", **{field: value})
    assert "req-7" in str(err.value)


def test_table_has_the_schema_and_round_trips_through_parquet_with_nulls():
    records = [
        rec(0, itl_s=[0.05, 0.07], spec_verify_ct=4, spec_num_correct_drafts=6, spec_num_proposed_drafts=12,
            spec_accept_length=2.5),
        rec(1, phase="warmup", ttft_s=None, error="timeout", finish_reason="error", completion_tokens=0,
            output_ids=[]),
    ]
    table = to_table(records)
    assert table.schema.equals(REQUEST_SCHEMA)
    assert RequestRecord.to_table(records).equals(table)
    assert table.column("spec_verify_ct").to_pylist() == [4, None]
    assert table.column("ttft_s").to_pylist() == [0.1, None]
    buf = io.BytesIO()
    pq.write_table(table, buf)
    back = to_records(pq.read_table(io.BytesIO(buf.getvalue())))
    assert back == records


def test_empty_record_list_gives_an_empty_table_of_the_schema():
    table = to_table([])
    assert table.num_rows == 0 and table.schema.equals(REQUEST_SCHEMA)


def test_table_missing_a_column_is_rejected_by_name():
    table = to_table([rec()]).drop_columns(["output_sha1"])
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['output_sha1'\]"):
        summarize(table, seed=0)


# --- summary ----------------------------------------------------------------------------------------------------

def test_throughput_is_tokens_over_first_start_to_last_end():
    # r0 runs 0..2 s with 10 tokens, r1 runs 1..4 s with 30 tokens: 40 tokens over a 4 s window.
    s = summarize([rec(0, start_s=0.0, e2e_s=2.0, completion_tokens=10),
                   rec(1, start_s=1.0, e2e_s=3.0, completion_tokens=30)], seed=0)
    assert s.window_s == 4.0
    assert s.tput_tok_s == 10.0
    assert s.req_per_s == 0.5
    assert s.completion_tokens == 40 and s.n_requests == 2 and s.n_ok == 2


def test_warmup_requests_do_not_count():
    measured = [rec(0, start_s=0.0, e2e_s=2.0, completion_tokens=10), rec(1, start_s=1.0, e2e_s=3.0,
                                                                       completion_tokens=30)]
    warm = [rec(9, phase="warmup", start_s=0.0, e2e_s=50.0, completion_tokens=5000, error="boom",
                finish_reason="error")]
    s = summarize(measured + warm, seed=0)
    assert s.tput_tok_s == 10.0
    assert (s.n_warmup_requests, s.n_warmup_errors, s.n_errors) == (1, 1, 0)


def test_failed_request_adds_no_tokens_but_holds_the_window():
    # The failure ends at 6 s: 40 tokens over 6 s; 1 error of 3 requests.
    s = summarize([rec(0, start_s=0.0, e2e_s=2.0, completion_tokens=10),
                   rec(1, start_s=1.0, e2e_s=3.0, completion_tokens=30),
                   rec(2, start_s=2.0, e2e_s=4.0, completion_tokens=0, error="timeout", finish_reason="error",
                       ttft_s=None, output_ids=[])], seed=0)
    assert s.window_s == 6.0
    assert s.tput_tok_s == pytest.approx(40 / 6)
    assert (s.n_requests, s.n_ok, s.n_errors) == (3, 2, 1)
    assert s.error_rate == pytest.approx(1 / 3)


def test_accept_lengths_aggregate_over_requests_with_spec_counts():
    # accept_len = (100 + 50) / (40 + 10) = 3.0; drafts: 1 + (55 + 35) / 50 = 2.8. The third request finished in
    # prefill (no spec counts): its 1 token must not enter either ratio.
    s = summarize([
        rec(0, completion_tokens=100, spec_verify_ct=40, spec_num_correct_drafts=55, spec_num_proposed_drafts=120),
        rec(1, completion_tokens=50, spec_verify_ct=10, spec_num_correct_drafts=35, spec_num_proposed_drafts=30),
        rec(2, completion_tokens=1),
    ], seed=0)
    assert s.accept_len == 3.0
    assert s.accept_len_drafts == 2.8


def test_no_speculation_gives_null_accept_length():
    s = summarize([rec(0), rec(1)], seed=0)
    assert s.accept_len is None and s.accept_len_drafts is None
    assert "accept_len" not in s.to_metrics()


def test_latency_percentiles_in_ms_with_linear_interpolation():
    # e2e 10..50 ms: p50 = 30, p90 = 40 + 0.6 * 10 = 46, p99 = 40 + 0.96 * 10 = 49.6.
    records = [rec(i, start_s=0.0, e2e_s=ms / 1000, ttft_s=ms / 2000, itl_s=[ms / 1000, ms / 1000])
               for i, ms in enumerate([30, 10, 50, 20, 40])]
    s = summarize(records, seed=0)
    assert (s.e2e_p50_ms, s.e2e_p90_ms, s.e2e_p99_ms) == pytest.approx((30.0, 46.0, 49.6))
    assert (s.ttft_p50_ms, s.ttft_p90_ms) == pytest.approx((15.0, 23.0))
    # ITL pools all ten gaps: 10,10,20,20,30,30,40,40,50,50; rank 0.5 * 9 = 4.5 -> 30, rank 0.9 * 9 = 8.1 -> 50.
    assert (s.itl_p50_ms, s.itl_p90_ms) == pytest.approx((30.0, 50.0))


def test_empty_input_gives_zero_throughput_not_an_exception():
    s = summarize([], seed=0)
    assert isinstance(s, Summary)
    assert (s.tput_tok_s, s.req_per_s, s.n_requests, s.n_errors, s.error_rate) == (0.0, 0.0, 0, 0, 0.0)
    assert s.tput_ci_low is None and s.e2e_p50_ms is None and s.concurrency is None


def test_all_failed_input_reports_errors_and_zero_throughput():
    failed = [rec(i, start_s=float(i), e2e_s=1.0, completion_tokens=0, ttft_s=None, error="HTTP 500",
                  finish_reason="error", output_ids=[]) for i in range(3)]
    s = summarize(failed, seed=0)
    assert (s.tput_tok_s, s.n_requests, s.n_ok, s.n_errors, s.error_rate) == (0.0, 3, 0, 3, 1.0)
    assert s.tput_ci_low is None and s.ttft_p50_ms is None


def test_mixed_concurrency_levels_are_rejected():
    with pytest.raises(ValueError, match=r"mix concurrency levels \[1, 4\]"):
        summarize([rec(0, concurrency=1), rec(1, concurrency=4)], seed=0)


@pytest.mark.parametrize("n_boot", [0, 99, True, 1000.0])
def test_bad_n_boot_is_rejected(n_boot):
    with pytest.raises(ValueError, match="n_boot must be an integer >= 100"):
        summarize([rec()], seed=0, n_boot=n_boot)


# --- bootstrap CI -----------------------------------------------------------------------------------------------

def test_overlapping_requests_ci_is_window_throughput_not_per_request_rate():
    # Four identical requests run together at concurrency 4: 400 tokens in a 10 s window = 40 tok/s, while each
    # request alone streams 10 tok/s. Every resample has the same tokens/e2e ratio, so the CI collapses onto 40.
    records = [rec(i, concurrency=4, start_s=0.0, e2e_s=10.0, completion_tokens=100) for i in range(4)]
    s = summarize(records, seed=3)
    assert s.tput_tok_s == 40.0
    assert s.tput_ci_low == pytest.approx(40.0) and s.tput_ci_high == pytest.approx(40.0)


def test_ci_brackets_the_estimate_is_seeded_and_widens_with_spread():
    steady = [rec(i, start_s=float(i), e2e_s=1.0, completion_tokens=20 + (i % 2)) for i in range(20)]
    spread = [rec(i, start_s=float(i), e2e_s=1.0, completion_tokens=5 if i % 2 else 36) for i in range(20)]
    a, b = summarize(steady, seed=7), summarize(spread, seed=7)
    widths = []
    for s in (a, b):
        assert s.tput_ci_low is not None and s.tput_ci_high is not None
        assert s.tput_ci_low < s.tput_tok_s < s.tput_ci_high
        widths.append(s.tput_ci_high - s.tput_ci_low)
    steady_width, spread_width = widths
    assert spread_width > 5 * steady_width
    assert summarize(spread, seed=7) == b
    assert summarize(pa.Table.from_batches(to_table(spread).to_batches()), seed=7) == b


def test_single_successful_request_has_no_ci():
    s = summarize([rec(0)], seed=0)
    assert s.tput_tok_s == 10.0
    assert s.tput_ci_low is None and s.tput_ci_high is None


def test_metrics_are_numeric_and_skip_nulls():
    m = summarize([rec(0), rec(1, start_s=0.5)], seed=0).to_metrics()
    assert m["tput_tok_s"] == pytest.approx(20 / 1.5)
    assert all(isinstance(v, float) for v in m.values())
    assert "seed" not in m and "accept_len" not in m
