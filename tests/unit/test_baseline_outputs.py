"""The baseline's outputs are the reference of every equivalence check. They are read from the baseline trial's MLflow
run (its requests.parquet), never from a driver's folder, so a second driver in a new folder compares against the
same outputs (issue #20); a baseline that lost a request is not COMPLETE (issue #15 item 12). Real MLflow on SQLite."""

import dataclasses

import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.decide.equivalence import judge_pass
from pipeline.measure.measurement import Measurement
from pipeline.measure.summary import RequestRecord, to_table
from pipeline.records.tracking import Tracker
from pipeline.records.trial_runs import read_baseline
from pipeline.trial import lifecycle
from pipeline.trial.engine_pass import lost_requests
from pipeline.trial.gate import gate_for
from pipeline.trial.context import TrialContext
from pipeline.vocabulary.outcome import Outcome
from serve.spec import NgramSpec


def record(index: int, error: str | None = None, ids: tuple[int, ...] = (1, 2, 3)) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{index}", phase="measure", prompt_index=index, concurrency=1, start_s=0.0,
        ttft_s=None if error else 0.1, e2e_s=0.5, prompt_tokens=5, completion_tokens=0 if error else len(ids),
        finish_reason="error" if error else "length", error=error, output_ids=() if error else ids)


@pytest.fixture()
def tracker(tmp_path):
    return Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "s", artifact_dir=tmp_path / "artifacts")


def context(tracker, parent: str, folder) -> TrialContext:
    return TrialContext(study=load_study(None), output_dir=str(folder), serve_url="http://127.0.0.1:1",
                        tracker=tracker, parent_run_id=parent, warmup=(), measure=())


def log_baseline(tracker, parent: str, records: list[RequestRecord],
                 outcome: Outcome = Outcome.COMPLETE) -> str:
    return tracker.log_trial(parent, study_name="s", run_name="trial-0", kind="trial",
                             config=TrialConfig().model_dump(mode="json"), outcome=outcome, reason="",
                             metrics={}, requests=to_table(records), texts={})


def test_a_baseline_with_one_failed_request_is_not_complete():
    lost = lost_requests([record(0), record(1), record(2), record(3, error="HTTP 500: engine died")])
    assert lost is not None
    assert lost.outcome is Outcome.UNHEALTHY
    assert "1 of 4 measured requests failed (prompts [3]); first: HTTP 500: engine died" in lost.reason


def test_a_baseline_whose_failures_are_timeouts_is_a_timeout():
    lost = lost_requests([record(0), record(1, error="timeout after 300 s")])
    assert lost is not None
    assert lost.outcome is Outcome.TIMEOUT


def test_a_driver_in_another_folder_compares_with_the_baseline_outputs_from_mlflow(tracker, tmp_path, monkeypatch):
    parent = tracker.start_study("s", "name: s\n", resume=False)
    log_baseline(tracker, parent, [record(0), record(1, ids=(4, 5, 6))])
    # A second driver: a fresh folder with nothing in it, the same tracking store and study run.
    other = context(tracker, parent, tmp_path / "driver2")
    baseline = read_baseline(tracker, parent)
    assert baseline is not None and [r.output_ids for r in baseline.requests] == [(1, 2, 3), (4, 5, 6)]
    ngram = TrialConfig(spec=NgramSpec())
    gate = gate_for(other, ngram)
    same = judge_pass(Measurement(records=[record(0), record(1, ids=(4, 5, 6))]), gate, baseline)
    assert (same.outcome, same.reason) == (Outcome.COMPLETE, "") and same.report is not None and same.report.passed
    differ = judge_pass(Measurement(records=[record(0), record(1, ids=(4, 5, 9))]), gate, baseline)
    assert differ.outcome is Outcome.NOT_EQUIVALENT and differ.report is not None and not differ.report.passed

    # A trial that started before the baseline completed reads it again once it has measured.
    passes: list[str] = []

    def measured(ctx, config, label, log_dir, watch=None):
        passes.append(label)
        return Measurement(records=[record(0), record(1, ids=(4, 5, 6))])

    monkeypatch.setattr(lifecycle, "measure_config", measured)
    checked = lifecycle.measure_and_check(other, ngram, "trial-1", tmp_path / "t", gate=gate, baseline=None)
    assert (checked.outcome, checked.reason) == (Outcome.COMPLETE, "") and checked.equivalence is not None
    assert passes == ["trial-1"] and checked.measurement.launches == 0  # `exact` compares with the stored outputs


def test_only_a_complete_baseline_is_a_reference(tracker, tmp_path):
    parent = tracker.start_study("s", "name: s\n", resume=False)
    log_baseline(tracker, parent, [record(0)], outcome=Outcome.UNHEALTHY)
    ctx = context(tracker, parent, tmp_path)
    assert read_baseline(tracker, parent) is None
    ngram = TrialConfig(spec=NgramSpec())
    missing = judge_pass(Measurement(records=[record(0)]), gate_for(ctx, ngram), None)
    assert (missing.outcome, missing.reason) == (
        Outcome.COMPLETE, "no baseline outputs to compare with (the baseline did not complete)")
    # the baseline is its own reference
    assert judge_pass(Measurement(records=[record(0)]), gate_for(ctx, TrialConfig()), None).outcome is Outcome.COMPLETE


def test_a_pass_whose_engine_ran_another_config_is_invalid_and_never_compared(tracker, tmp_path):
    ctx = context(tracker, "no-parent", tmp_path)
    ngram = TrialConfig(spec=NgramSpec())
    changed = Measurement(records=[record(0)], diffs={"num_draft_tokens": (8, 4), "max_running_requests": (8, 4)})
    verdict = judge_pass(changed, gate_for(ctx, ngram), None)
    assert verdict.outcome is Outcome.INVALID and verdict.report is None
    assert verdict.reason == "engine changed the requested settings: num_draft_tokens: requested 8, effective 4"
    capped = Measurement(records=[record(0)], diffs={"max_running_requests": (8, 4)})  # bounds the batch only
    assert capped.ending.outcome is Outcome.COMPLETE
    failed = Measurement(diffs={"num_draft_tokens": (8, 4)}, failure=lost_requests([record(0, error="timeout")]))
    assert failed.ending.outcome is Outcome.TIMEOUT  # the failure is what ended it


def test_sampled_outputs_are_not_compared(tracker, tmp_path):
    ctx = dataclasses.replace(context(tracker, "no-parent", tmp_path),
                              study=load_study(None, {"workload.temperature": 0.7}))
    gate = gate_for(ctx, TrialConfig(spec=NgramSpec()))
    assert not gate.compares and gate.stored_pass is None
    verdict = judge_pass(Measurement(records=[record(0)]), gate, None)
    assert (verdict.outcome, verdict.reason) == (Outcome.COMPLETE, "sampling (temperature > 0): outputs are not compared")
