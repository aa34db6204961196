"""Early stopping wired into trials (issue #16): the chunked measurement's records, the baseline's figures read from
MLflow, the watch's verdicts and Tune reports, when the rule applies, the slow-steps fault, and how a PRUNED trial
reaches Optuna through Ray's OptunaSearch (real Optuna, in memory; real MLflow on SQLite)."""

from __future__ import annotations

import math
from typing import Any, cast

import optuna
import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.measure.load import LoadRequest
from pipeline.measure.server_info import ServerInfo
from pipeline.measure.summary import RequestRecord, chunks, continue_records, summarize, to_table
from pipeline.trial.pruning import Watch, intermediate_report, stop_metrics, trial_watch
from pipeline.records.tracking import Tracker
from pipeline.records.trial_runs import baseline_trial, read_baseline
from pipeline.vocabulary.outcome import MEASURING, Outcome
from pipeline.decide.stopping import (BaselineFigures, StopResult, StoppingPolicy, baseline_figures, decode_step_s,
                                      rule_off)
from serve.engines.cpu.decode import Request
from serve.engines.cpu.faults import FaultSpecError, _SlowSteps, parse_fault
from serve.spec import NgramSpec

TOKENS = 24
SENTINEL = {"max": 0.0, "min": 1e12}


def record(i: int, tput: float, *, start: float = 0.0, ttft: float = 0.05, error: str | None = None,
           accept: float | None = None, tokens: int = TOKENS) -> RequestRecord:
    return RequestRecord(request_id="measure-0", phase="measure", prompt_index=i, concurrency=1, start_s=start,
                         ttft_s=None if error else ttft, e2e_s=tokens / tput, prompt_tokens=12,
                         completion_tokens=0 if error else tokens,
                         spec_verify_ct=max(1, round(tokens / accept)) if accept else None,
                         finish_reason="error" if error else "length", error=error, output_ids=(1,) * (0 if error else tokens))


def judged(watch: Watch, records: list[RequestRecord], server_info: dict[str, Any]) -> StopResult:
    """The verdict of a watch that has a baseline: it judges every chunk (None is the answer without one)."""
    result = watch(records, ServerInfo.parse(server_info))
    assert result is not None
    return result


# --- chunks and records -------------------------------------------------------------------------------------------

def test_chunks_cover_the_phase_in_order_with_concurrency_requests_each():
    assert chunks(5, 1) == [range(0, 1), range(1, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert chunks(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert chunks(0, 1) == []
    with pytest.raises(ValueError, match="size must be an integer >= 1, got size=0"):
        chunks(4, 0)


def test_chunked_records_summarize_as_one_phase_of_back_to_back_requests():
    # Each chunk's load generator starts its own window at 0 and names its request measure-0.
    per_chunk = [[record(i, 10.0 + i)] for i in range(4)]
    records, offset = [], 0.0
    for first, got in enumerate(per_chunk):
        records += continue_records(got, offset_s=offset, first_position=first)
        offset += max(r.start_s + r.e2e_s for r in got)
    assert [r.request_id for r in records] == ["measure-0", "measure-1", "measure-2", "measure-3"]
    ends = [r.start_s + r.e2e_s for r in records]
    assert [r.start_s for r in records[1:]] == pytest.approx(ends[:-1])  # laid end to end, no gap, no overlap
    summary = summarize(records, seed=0)
    assert summary.window_s == pytest.approx(sum(r.e2e_s for r in records))
    assert summary.tput_tok_s == pytest.approx(4 * TOKENS / sum(r.e2e_s for r in records))
    with pytest.raises(ValueError, match="offset_s must be a finite number >= 0"):
        continue_records(per_chunk[0], offset_s=-1.0, first_position=0)


# --- the baseline's figures and when the rule applies -------------------------------------------------------------

def test_the_decode_step_is_the_fastest_requests_time_per_decoded_token():
    fast, slow = record(0, 12.0, ttft=0.2), record(1, 8.0, ttft=0.2)
    assert decode_step_s([fast, slow]) == pytest.approx((TOKENS / 12.0 - 0.2) / (TOKENS - 1))
    # failed requests, one-token answers and warm-up requests say nothing about the step
    one = RequestRecord(request_id="x", phase="measure", prompt_index=2, concurrency=1, start_s=0, ttft_s=0.1,
                        e2e_s=0.1, prompt_tokens=3, completion_tokens=1, finish_reason="length")
    assert decode_step_s([record(3, 10.0, error="boom"), one]) is None
    figures = baseline_figures(10.0, [fast], 0.05)
    assert figures == BaselineFigures(tput_tok_s=10.0, sigma=0.05, runs=1, step_s=decode_step_s([fast]))
    assert baseline_figures(0.0, [fast], 0.05) is None and baseline_figures(None, [], 0.05) is None


@pytest.mark.parametrize("enabled, algorithm, concurrency, expected", [
    (True, "ngram", 1, None),
    (False, "ngram", 1, "early stopping is off (budget.early_stopping: false)"),
    (True, "none", 1, "the baseline is never stopped"),
    (True, "ngram", 4, "early stopping applies at search concurrency 1 only (this study searches at 4)"),
])
def test_the_rule_applies_to_speculative_trials_at_concurrency_one_only(enabled, algorithm, concurrency, expected):
    reason = rule_off(enabled=enabled, algorithm=algorithm, concurrency=concurrency)
    assert reason is None if expected is None else (reason is not None and reason.startswith(expected))


# --- the watch: verdicts and progress ------------------------------------------------------------------------------

def test_the_watch_reports_every_chunk_and_stops_a_slow_trial_with_its_bound():
    base = BaselineFigures(tput_tok_s=10.0, sigma=0.05, runs=1, step_s=0.09)
    seen = []
    watch = Watch(baseline=base, total_requests=8, draft_tokens=3, max_new_tokens=TOKENS, policy=StoppingPolicy(),
                  progress=lambda records, result: seen.append((len(records), result)))
    slow = [record(i, 2.0 * (1 + 0.01 * i)) for i in range(8)]
    verdicts = [judged(watch, slow[:k], {}) for k in range(1, 9)]
    first = next(k for k, v in enumerate(verdicts, 1) if v.stop)
    assert first <= 4, verdicts[-1].reason  # a 5x slower config is stopped well before the end
    assert [n for n, _ in seen] == list(range(1, 9)) and seen[0][1] is verdicts[0]
    stopped = verdicts[first - 1]
    assert watch.last is verdicts[-1]
    assert f"after {first} of 8 measured requests" in stopped.reason and "upper confidence bound" in stopped.reason
    metrics = stop_metrics(stopped)
    assert metrics["stop_statistical_high_tok_s"] < metrics["stop_baseline_low_tok_s"] == pytest.approx(
        10.0 * math.exp(-StoppingPolicy().z * 0.05))
    assert stop_metrics(None) == {}


def test_a_watch_without_baseline_only_reports_and_a_faster_trial_is_never_stopped():
    seen = []
    idle = Watch(baseline=None, total_requests=4, draft_tokens=0, max_new_tokens=TOKENS, policy=StoppingPolicy(),
                 progress=lambda records, result: seen.append(result))
    assert idle([record(0, 10.0)], ServerInfo()) is None and seen == [None] and idle.last is None
    base = BaselineFigures(tput_tok_s=10.0, sigma=0.05, runs=1, step_s=0.09)
    watch = Watch(baseline=base, total_requests=4, draft_tokens=3, max_new_tokens=TOKENS, policy=StoppingPolicy())
    fast = [record(i, 11.0, accept=2.5) for i in range(4)]
    curve = {"verify_cost": {"sizes": [1, 2, 4, 8], "relative": [1.0, 0.99, 1.45, 1.78]}}
    assert not any(judged(watch, fast[:k], curve).stop for k in range(1, 5))
    # a malformed curve is not the trial's fault: cost 1 (errs towards continuing), no exception
    broken = Watch(baseline=base, total_requests=4, draft_tokens=3, max_new_tokens=TOKENS, policy=StoppingPolicy())
    broken_curve = {"verify_cost": {"sizes": [2, 1], "relative": [1.0]}}
    assert judged(broken, fast[:2], broken_curve).analytic_high_tok_s is not None


def test_an_intermediate_report_carries_every_objective_metric_and_says_measuring():
    records = [record(0, 8.0), record(1, 9.0, start=3.0)]
    report = intermediate_report(records, None, ["tput_tok_s", "ttft_p99_ms"], ["max", "min"], SENTINEL, seed=0)
    assert report["outcome"] == MEASURING and report["measured_requests"] == 2
    assert report["tput_tok_s"] == pytest.approx(summarize(records, seed=0).tput_tok_s)
    assert report["ttft_p99_ms"] == pytest.approx(50.0)
    failed = intermediate_report([record(0, 8.0, error="boom")], None, ["accept_len"], ["max"], SENTINEL, seed=0)
    assert failed["accept_len"] == SENTINEL["max"]  # Tune refuses a result without the metric: the worst value


# --- the baseline from MLflow --------------------------------------------------------------------------------------

@pytest.fixture()
def tracker(tmp_path):
    return Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "s", artifact_dir=tmp_path / "artifacts")


def log_trial(tracker, parent, config, outcome, metrics, records):
    return tracker.log_trial(parent, study_name="s", run_name=f"trial-{config.spec.algorithm}-{outcome}",
                             kind="trial", config=config.model_dump(mode="json"), outcome=outcome, reason="",
                             metrics=metrics, requests=to_table(records), texts={})


def test_a_trial_watch_reads_the_completed_baselines_figures_from_mlflow(tracker):
    parent = tracker.start_study("s", "name: s\n", resume=False)
    study = load_study(None)
    measure = tuple(LoadRequest(i, "p", TOKENS) for i in range(4))
    ngram = TrialConfig(spec=NgramSpec(num_draft_tokens=4))
    assert read_baseline(tracker, parent) is None
    watch, note = trial_watch(study, None, measure, ngram, None)
    assert watch is not None and watch.baseline is None  # measured in chunks, never stopped: nothing to compare with
    assert note == "not applied: no baseline trial has completed yet: nothing to compare with"
    log_trial(tracker, parent, TrialConfig(), Outcome.UNHEALTHY, {"tput_tok_s": 50.0}, [record(0, 50.0)])
    assert baseline_trial(tracker, parent) is None  # only a COMPLETE baseline counts
    base_records = [record(0, 10.0, ttft=0.1), record(1, 11.0, ttft=0.1)]
    log_trial(tracker, parent, TrialConfig(), Outcome.COMPLETE, {"tput_tok_s": 10.2}, base_records)
    baseline = read_baseline(tracker, parent)
    assert baseline is not None and baseline.requests == tuple(base_records)
    watch, note = trial_watch(study, baseline, measure, ngram, None)
    assert watch is not None and watch.baseline is not None
    assert (watch.baseline.tput_tok_s, watch.baseline.sigma, watch.baseline.runs) == (10.2, 0.05, 1)
    assert watch.baseline.step_s == pytest.approx(decode_step_s(base_records))
    assert (watch.total_requests, watch.draft_tokens, watch.max_new_tokens) == (4, 3, TOKENS)
    assert note.startswith("on (alpha 0.001, sigma 0.05, baseline 10.20 tok/s, step ")
    base_watch, base_note = trial_watch(study, baseline, measure, TrialConfig(), None)
    assert base_watch is not None
    assert base_watch.baseline is None and base_note == "not applied: the baseline is never stopped"
    off = load_study(None, {"budget.early_stopping": False})
    assert trial_watch(off, baseline, measure, ngram, None) == (None, "off (budget.early_stopping: false)")


def test_the_switch_and_the_noise_are_validated_study_keys():
    assert load_study(None).budget.early_stopping is True
    with pytest.raises(Exception, match="early_stopping_sigma"):
        load_study(None, {"budget.early_stopping_sigma": -0.1})


# --- the slow-steps fault ------------------------------------------------------------------------------------------

def test_slow_steps_parses_and_rejects_a_factor_that_would_not_slow_down():
    assert str(parse_fault("slow-steps=4@speculative")) == "slow-steps=4@speculative"
    with pytest.raises(FaultSpecError, match="slow-steps needs a slow-down factor > 1, got '1'"):
        parse_fault("slow-steps=1")


def test_slow_steps_sleeps_factor_minus_one_times_each_rounds_own_time(monkeypatch):
    clock = iter([10.0, 10.5])  # the inner step takes 0.5 s on this clock
    slept: list[float] = []
    monkeypatch.setattr("serve.engines.cpu.faults.time.perf_counter", lambda: next(clock))
    monkeypatch.setattr("serve.engines.cpu.faults.time.sleep", slept.append)

    class Inner:
        speculator = "kept"

        def step_many(self, reqs):
            return [("stats", req) for req in reqs]

    slow = _SlowSteps(Inner(), 4.0)
    stand_in = cast(Request, "r")  # the wrapper only forwards its requests: a token shows it passed them on
    assert slow.step_many([stand_in]) == [("stats", "r")] and slow.speculator == "kept"
    assert slept == [pytest.approx(1.5)]


# --- PRUNED in Optuna through Ray's OptunaSearch ------------------------------------------------------------------

def optuna_search(storage):
    from pipeline.search.searcher import PruningOptunaSearch

    return PruningOptunaSearch({"x": __import__("ray.tune", fromlist=["uniform"]).uniform(0, 1)},
                               metric="tput_tok_s", mode="max", storage=storage, study_name="s", seed=0)


@pytest.mark.parametrize("final, state, value", [
    ({"outcome": "PRUNED", "tput_tok_s": 3.0}, "PRUNED", 3.0),  # the partial figure, reported last, is its value
    ({"outcome": "COMPLETE", "tput_tok_s": 12.0}, "COMPLETE", 12.0),
    ({"outcome": MEASURING, "tput_tok_s": 3.0}, "FAIL", None),  # ended on an intermediate report: never COMPLETE
])
def test_a_pruned_trial_reaches_optuna_as_pruned(final, state, value):
    storage = optuna.storages.InMemoryStorage()
    searcher = optuna_search(storage)
    searcher.suggest("t1")
    searcher.on_trial_result("t1", {"outcome": MEASURING, "tput_tok_s": 5.0, "training_iteration": 1})
    searcher.on_trial_result("t1", {**final, "training_iteration": 2})
    searcher.on_trial_complete("t1", result={**final, "training_iteration": 2})
    trial = optuna.load_study(study_name="s", storage=storage).trials[0]
    assert trial.state.name == state
    assert trial.value == value


def test_a_tracking_store_that_cannot_be_read_turns_the_rule_off_for_the_trial_instead_of_failing_it(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")  # SQLite cannot create its database under a file
    tracker = Tracker(f"sqlite:///{blocked / 'mlflow.db'}", "s")
    with pytest.raises(Exception) as raised:  # the reader says so; the trial turns the rule off (test_trial_flow.py)
        read_baseline(tracker, "no-parent")
    unread = f"the baseline's run could not be read ({type(raised.value).__name__})"
    measure = (LoadRequest(0, "p", TOKENS),)
    watch, note = trial_watch(load_study(None), None, measure, TrialConfig(spec=NgramSpec(num_draft_tokens=4)), None,
                              unread)
    assert watch is not None and watch.baseline is None
    assert note == f"not applied: {unread}"


def test_a_bound_beyond_any_float_means_continue_and_is_not_logged():
    # Two requests 1000x apart with one degree of freedom: exp(t(0.999, 1) * spread / sqrt(2)) overflows a float.
    records = [record(0, 0.01), record(1, 10.0)]
    base = BaselineFigures(tput_tok_s=10.0, sigma=0.05, runs=1, step_s=None)
    watch = Watch(baseline=base, total_requests=4, draft_tokens=3, max_new_tokens=TOKENS, policy=StoppingPolicy())
    result = judged(watch, records, {})
    assert not result.stop and result.statistical_high_tok_s == math.inf
    assert "stop_statistical_high_tok_s" not in stop_metrics(result)
