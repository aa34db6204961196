"""Open-loop arrivals in the trial's measurement (issue #17): the `workload.arrival` section's validation, the
measurement phase sending on the study's seeded Poisson schedule (against a tiny local SSE server), early stopping
switched off, and the offered / drawn / achieved rates in the summary."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pipeline.config import OBJECTIVE_METRICS, ArrivalSettings, StudyConfig, load_study, study_to_yaml
from pipeline.errors import ConfigError
from pipeline.measure.load import LoadRequest
from pipeline.measure.summary import RequestRecord, summarize
from pipeline.measure.openloop import poisson_schedule
from pipeline.measure.server_info import ServerInfo
from pipeline.trial.pruning import Watch, measure_phase, trial_watch
from pipeline.decide.stopping import StoppingPolicy

POISSON = {"workload.arrival": {"mode": "poisson", "rate_per_s": 20.0, "max_duration_s": 30.0}}


# --- workload.arrival -----------------------------------------------------------------------------------------------

def test_the_default_is_closed_loop_and_poisson_loads_with_rate_and_bound():
    assert StudyConfig().workload.arrival == ArrivalSettings(mode="closed")
    assert not StudyConfig().workload.arrival.open_loop
    study = load_study(None, POISSON)
    arrival = study.workload.arrival
    assert arrival.open_loop and arrival.rate_per_s == 20.0 and arrival.max_duration_s == 30.0
    assert "arrival:\n    mode: poisson\n    rate_per_s: 20.0\n    max_duration_s: 30.0" in study_to_yaml(study)
    assert arrival.describe(1) == "open loop: poisson 20 req/s, arrivals within 30 s"
    assert StudyConfig().workload.arrival.describe(4) == "closed loop: concurrency 4"


@pytest.mark.parametrize(("arrival", "words"), [
    ({"mode": "poisson", "max_duration_s": 30}, ["workload.arrival", "mode poisson needs rate_per_s",
                                                 "rate_per_s=None", "Fix: e.g. arrival: {mode: poisson"]),
    ({"mode": "poisson", "rate_per_s": 2}, ["mode poisson needs max_duration_s", "bounded in time and count"]),
    ({"rate_per_s": 2}, ["rate_per_s=2.0 apply to mode poisson only, got mode closed", "Fix: set mode: poisson"]),
    ({"mode": "poisson", "rate_per_s": 0, "max_duration_s": 30}, ["workload.arrival.rate_per_s", "greater than 0"]),
    ({"mode": "poisson", "rate_per_s": float("inf"), "max_duration_s": 30}, ["workload.arrival.rate_per_s",
                                                                             "finite number"]),
    ({"mode": "burst"}, ["workload.arrival.mode", "'closed' or 'poisson'", "'burst'"]),
    ({"mode": "poisson", "rate_per_s": 2, "max_duration_s": 30, "rate_per_sec": 3}, ["unknown key 'rate_per_sec'",
                                                                             "did you mean 'rate_per_s'"]),
])
def test_a_bad_arrival_section_names_the_key_the_value_and_the_fix(arrival, words):
    with pytest.raises(ConfigError) as err:
        load_study(None, {"workload.arrival": arrival})
    for word in words:
        assert word in str(err.value), str(err.value)


def test_open_loop_has_one_level():
    with pytest.raises(ConfigError, match=r"poisson measures at an arrival rate.*concurrency=\[1, 4\].*Fix: list one"):
        load_study(None, {**POISSON, "concurrency": [1, 4]})
    assert load_study(None, {**POISSON, "concurrency": [2]}).search_concurrency == 2  # the warm-up's level


def test_the_rates_are_load_not_objectives():
    assert "offered_rate_per_s" not in OBJECTIVE_METRICS and "arrival_rate_per_s" not in OBJECTIVE_METRICS
    with pytest.raises(ConfigError, match="unknown objective metric"):
        load_study(None, {"objective.metrics": ["offered_rate_per_s"]})


# --- summary --------------------------------------------------------------------------------------------------------

def rec(i: int, start: float, e2e: float = 1.0) -> RequestRecord:
    return RequestRecord(request_id=f"measure-{i}", phase="measure", prompt_index=i, concurrency=1, start_s=start,
                         ttft_s=0.1, e2e_s=e2e, prompt_tokens=3, completion_tokens=10, finish_reason="length",
                         output_ids=(1,) * 10)


def test_open_loop_summary_carries_offered_drawn_and_achieved_rates():
    records = [rec(0, 0.0), rec(1, 0.5), rec(2, 1.0), rec(3, 2.0, e2e=2.0)]  # last ends at 4.0
    closed = summarize(records, seed=0)
    assert closed.offered_rate_per_s is None and closed.arrival_rate_per_s is None
    assert "offered_rate_per_s" not in closed.to_metrics()
    s = summarize(records, seed=0, offered_rate_per_s=2.0)
    assert s.offered_rate_per_s == 2.0
    assert s.arrival_rate_per_s == pytest.approx(3 / 2.0)  # 3 gaps in 2 s of arrivals
    assert s.req_per_s == pytest.approx(4 / 4.0) and s.tput_tok_s == pytest.approx(40 / 4.0)  # tokens / window
    assert s.to_metrics()["offered_rate_per_s"] == 2.0
    assert summarize(records[:1], seed=0, offered_rate_per_s=2.0).arrival_rate_per_s is None
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="offered_rate_per_s must be a finite number > 0"):
            summarize(records, seed=0, offered_rate_per_s=bad)


# --- the measurement phase ------------------------------------------------------------------------------------------

class _Gate(BaseHTTPRequestHandler):
    """Answers no request until `expected` requests are open at once: only open-loop load gets past it (a closed loop
    at concurrency 1 would wait for its first answer and time out at the barrier)."""

    barrier: threading.Barrier
    wait_s = 20.0  # only bounds a failing test

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        try:
            self.barrier.wait(timeout=self.wait_s)
            meta = {"completion_tokens": 2, "prompt_tokens": 2, "finish_reason": {"type": "length"}}
            body = f"data: {json.dumps({'output_ids': [5, 6], 'meta_info': meta})}\n\ndata: [DONE]\n\n".encode()
            self.send_response(200)
        except threading.BrokenBarrierError:
            body = b"the requests did not overlap"
            self.send_response(503)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture()
def gate() -> Iterator[tuple[str, type[_Gate]]]:
    handler = type("Gate", (_Gate,), {})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", handler
    httpd.shutdown()
    httpd.server_close()


ITEMS = [LoadRequest(index=10 + i, text=f"p{i}", max_new_tokens=2) for i in range(5)]
KWARGS = {"concurrency": 1, "temperature": 0.0, "timeout_s": 30.0}


def test_poisson_measurement_sends_every_request_on_the_seeded_schedule_without_waiting(gate):
    url, handler = gate
    arrival = load_study(None, POISSON).workload.arrival
    schedule = poisson_schedule(len(ITEMS), 20.0, seed=3, max_duration_s=30.0)
    assert len(schedule) == len(ITEMS)
    handler.barrier = threading.Barrier(len(ITEMS))
    records, pruned = measure_phase(url, ITEMS, KWARGS, None, ServerInfo(), arrival=arrival, seed=3)
    assert pruned is None
    assert [r.error for r in records] == [None] * len(ITEMS)  # all five were open at once: an open loop
    assert [r.prompt_index for r in records] == [10, 11, 12, 13, 14]
    assert [r.request_id for r in records] == [f"measure-{i}" for i in range(5)]
    assert all(r.phase == "measure" and r.concurrency == 1 for r in records)
    assert all(r.start_s >= offset for r, offset in zip(records, schedule))  # none before its arrival time


def test_the_gate_refuses_a_closed_loop_at_concurrency_1(gate):
    """The control of the test above: the same two requests closed loop never have two in flight."""
    url, handler = gate
    handler.barrier, handler.wait_s = threading.Barrier(2), 0.5
    records, _ = measure_phase(url, ITEMS[:2], KWARGS, None, ServerInfo(), arrival=StudyConfig().workload.arrival,
                               seed=3)
    assert records[0].error is not None and "did not overlap" in records[0].error


def test_the_time_bound_drops_late_arrivals(gate):
    url, handler = gate
    arrival = ArrivalSettings(mode="poisson", rate_per_s=1.0, max_duration_s=1.5)
    items = [LoadRequest(index=i, text="p", max_new_tokens=2) for i in range(20)]
    expected = poisson_schedule(20, 1.0, seed=5, max_duration_s=1.5)
    assert 1 <= len(expected) < 20
    handler.barrier = threading.Barrier(1)
    records, _ = measure_phase(url, items, KWARGS, None, ServerInfo(), arrival=arrival, seed=5)
    assert len(records) == len(expected) and all(r.ok for r in records)


def test_open_loop_switches_early_stopping_off():
    study = load_study(None, POISSON)
    assert study.budget.early_stopping  # on by default, yet not applied
    from pipeline.config import TrialConfig
    from serve.spec import NgramSpec

    config = TrialConfig(spec=NgramSpec(num_draft_tokens=4))
    watch, note = trial_watch(study, None, [ITEMS[0]], config, None)
    assert watch is None and note.startswith("off (workload.arrival.mode: poisson")
    arrival = study.workload.arrival
    watched = Watch(baseline=None, total_requests=1, draft_tokens=4, max_new_tokens=2, policy=StoppingPolicy())
    with pytest.raises(ValueError, match="open-loop measurement cannot be watched"):
        measure_phase("http://127.0.0.1:9", ITEMS, KWARGS, watched, ServerInfo(), arrival=arrival, seed=0)


def test_resume_refuses_a_changed_arrival_mode():
    from pipeline.study.resume import identity_changes, study_identity

    closed = study_identity(StudyConfig(), {}, "w")
    changes = identity_changes(closed, study_identity(load_study(None, POISSON), {}, "w"))
    assert len(changes) == 1 and changes[0].startswith('arrival: was {"max_duration_s": null, "mode": "closed"')
    assert identity_changes({k: v for k, v in closed.items() if k != "arrival"}, closed) == []  # older records


def test_no_request_starts_before_its_arrival_under_uvloop(gate):
    """Trial processes may run uvloop (Ray Serve installs it), whose timers fire up to 1 ms early; the integration
    study caught requests starting before their arrival time. The runner must wait out the rest."""
    import asyncio

    uvloop = pytest.importorskip("uvloop")
    url, handler = gate
    handler.barrier = threading.Barrier(1)
    items = [LoadRequest(index=i, text="p", max_new_tokens=2) for i in range(60)]
    arrival = ArrivalSettings(mode="poisson", rate_per_s=200.0, max_duration_s=30.0)
    schedule = poisson_schedule(60, 200.0, seed=11, max_duration_s=30.0)
    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    try:
        records, _ = measure_phase(url, items, KWARGS, None, ServerInfo(), arrival=arrival, seed=11)
    finally:
        asyncio.set_event_loop_policy(previous)
    assert len(records) == 60 and all(r.ok for r in records)
    early = [(r.start_s, offset) for r, offset in zip(records, schedule) if r.start_s < offset]
    assert early == []
