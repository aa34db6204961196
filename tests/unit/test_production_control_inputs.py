"""What the closed loop's control routes accept (issue 42 items 3, 9, 13): strict, finite numbers in the contract
(serve/closed_loop/control.py), and the live feed's query (serve/closed_loop/live_book.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from prometheus_client import CollectorRegistry

from serve.closed_loop.control import MAX_LEASE_S, CanaryShare, CanaryStart, DriftReport
from serve.closed_loop.control_routes import DriftBoard, contract_body
from serve.closed_loop.live_book import feed_query
from serve.http_errors import RequestRejected

LINE = {"metric": "tput", "bucket": 4, "alarm": False, "statistic": 1.5, "threshold": 8.0, "requests": 64,
        "live_mean": 1.2, "reference_mean": 2.0, "text": "tput at 4"}


def report(**line) -> dict:
    return {"at_ms": 1, "reference_version": "1", "lines": [{**LINE, **line}], "shift": None}


@pytest.mark.parametrize("field, value", [("statistic", "NaN"), ("statistic", "inf"), ("threshold", "1e999"),
                                          ("statistic", float("nan")), ("live_mean", float("inf")),
                                          ("statistic", "2.5"), ("alarm", "true"), ("alarm", 1),
                                          ("bucket", "4"), ("requests", True), ("bucket", 4.0)])
def test_a_drift_line_takes_strict_finite_numbers_only(field, value):
    # issue 42 item 3: "NaN" as a string was accepted, could not be written back out, and /v1/drift and every later
    # /v1/config answered 500 until a valid report replaced it
    with pytest.raises(RequestRejected) as refused:
        contract_body(DriftReport, report(**{field: value}))
    assert refused.value.status == 422 and f"lines.0.{field}" in refused.value.message


def test_a_valid_report_is_shown_and_serialises():
    board = DriftBoard(CollectorRegistry())
    board.post(contract_body(DriftReport, report(statistic=2, live_mean=None)))  # a JSON integer is a number
    assert json.loads(json.dumps(board.shown()))["lines"][0]["statistic"] == 2.0


@pytest.mark.parametrize("body, field", [
    ({"share": "0.5"}, "share"), ({"share": True}, "share"), ({"share": float("nan")}, "share"),  # issue 42 item 13
    ({"share": 0.5, "lease_s": "inf"}, "lease_s"), ({"share": 0.5, "lease_s": float("inf")}, "lease_s"),
    ({"share": 0.5, "lease_s": MAX_LEASE_S + 1}, "lease_s"), ({"share": 0.5, "lease_s": "900"}, "lease_s")])
def test_canary_inputs_are_strict_and_the_lease_bounded(body, field):
    with pytest.raises(RequestRejected) as refused:
        contract_body(CanaryStart, {"candidate": {"registered_model": "m", "version": "2"}, **body})
    assert refused.value.status == 422 and field in refused.value.message
    with pytest.raises(ValidationError):
        CanaryShare.model_validate({"share": "0.5"})
    assert contract_body(CanaryStart, {"candidate": {"registered_model": "m", "version": "2"}, "share": 1,
                                       "lease_s": MAX_LEASE_S}).share == 1.0


@pytest.mark.parametrize("value", ["²", "٣", "1²", "9" * 5000, "-1", "1.5", " 1", "", "0x10", "1" * 20])
def test_a_bad_live_cursor_is_a_400_naming_it_never_a_500(value):
    # issue 42 item 9: "²" passed str.isdigit() and int() raised (500), as did 5,000 digits
    with pytest.raises(RequestRejected) as refused:
        feed_query({"after": value})
    assert refused.value.status == 400 and "after=" in refused.value.message


def test_good_live_cursors_pass():
    assert feed_query({}) == (0, 1000)
    assert feed_query({"after": "1733240000000000", "limit": "10"}) == (1733240000000000, 10)
