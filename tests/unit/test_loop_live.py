"""The endpoint's live-figure and canary types (serve/closed_loop/live.py, serve/closed_loop/control.py): buckets, the per-request
figures, the summary the endpoint serves, and the shapes both sides validate."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from serve.closed_loop.control import CandidateRef, CanaryStart, CapturePart
from serve.closed_loop.live import LiveRecord, bucket_label, bucket_of, summarize_live


def record(seq: int, **kw) -> LiveRecord:
    base = dict(seq=seq, t_ms=1000 + seq, version="3", arm="production", route="low", api="/v1/completions",
                concurrency=1, status=200, streamed=True, prompt_tokens=10, completion_tokens=40, e2e_s=2.0,
                ttft_s=0.1, itl_s=(0.05, 0.05), spec_verify_ct=20)
    return LiveRecord(**{**base, **kw})


def test_buckets_are_powers_of_two_with_readable_labels():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    assert [bucket_label(n) for n in (1, 2, 3, 7, 16)] == ["1", "2", "3-4", "5-8", "9-16"]
    with pytest.raises(ValueError, match="concurrency must be an integer >= 1, got 0"):
        bucket_of(0)


def test_per_request_figures_exist_only_for_answered_requests():
    assert (record(1).accept_length, record(1).tput_tok_s) == (2.0, 20.0)
    failed = record(2, status=504)
    assert (failed.accept_length, failed.tput_tok_s) == (None, None)
    assert record(3, spec_verify_ct=None).accept_length is None


def test_the_summary_groups_by_version_arm_route_and_bucket():
    rows = [record(i) for i in range(4)] + [record(10, concurrency=3, completion_tokens=80, spec_verify_ct=20),
                                            record(11, concurrency=4, status=500), record(12, arm="candidate",
                                                                                          version="4")]
    summary = summarize_live(rows)
    groups = {(f.version, f.arm, f.bucket): f for f in summary.figures}
    assert set(groups) == {("3", "production", "1"), ("3", "production", "3-4"), ("4", "candidate", "1")}
    busy = groups[("3", "production", "3-4")]
    assert (busy.requests, busy.errors, busy.accept_length, busy.tput_tok_s_p50) == (2, 1, 4.0, 40.0)
    assert groups[("3", "production", "1")].itl_p50_ms == pytest.approx(50.0)
    assert (summary.first_ms, summary.last_ms) == (1000, 1012)


def test_contract_shapes_refuse_what_the_other_side_could_misread():
    with pytest.raises(ValidationError, match="version"):
        CandidateRef(registered_model="m", version="production")  # an alias could move under a running canary
    with pytest.raises(ValidationError, match="share"):
        CanaryStart(candidate=CandidateRef(registered_model="m", version="2"), share=0)
    with pytest.raises(ValidationError, match="is not a part file name"):
        CapturePart(name="../../etc/passwd", rows=1, bytes=1, mtime_ms=0)
    with pytest.raises(ValidationError, match="itl_s"):
        record(1, itl_s=tuple([0.01] * 257))
