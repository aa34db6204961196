"""A trial's flow (`pipeline.trial.lifecycle.run_trial`) with its stages stood in for: what it reads of the baseline,
once, before it measures, what early stopping and the judgement get of it, and what the baseline's reference pass
adds to its record. Real MLflow on SQLite for the record."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.measure.measurement import Measurement
from pipeline.measure.summary import RequestRecord
from pipeline.records.tracking import Tracker
from pipeline.trial import lifecycle
from pipeline.trial.context import TrialContext
from pipeline.trial.gate import References
from pipeline.vocabulary.outcome import Outcome
from pipeline.vocabulary.resolution import Resolution
from serve.spec import NgramSpec, Violation

NGRAM = TrialConfig(spec=NgramSpec(num_draft_tokens=4))
RECORD = RequestRecord(request_id="r0", phase="measure", prompt_index=0, concurrency=1, start_s=0.0, ttft_s=0.1,
                       e2e_s=0.5, prompt_tokens=3, completion_tokens=3, finish_reason="length", output_ids=(1, 2, 3))


@pytest.fixture()
def ctx(tmp_path) -> TrialContext:
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "s", artifact_dir=tmp_path / "artifacts")
    parent = tracker.start_study("s", "name: s\n", resume=False)
    return TrialContext(study=load_study(None), output_dir=str(tmp_path), serve_url="http://127.0.0.1:1",
                        tracker=tracker, parent_run_id=parent, warmup=(), measure=())


class Stages:
    """The trial's reads and passes, stood in for: what each was given, and the baseline's reference pass's answer."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, references: References = References()) -> None:
        self.calls: dict[str, Any] = {}
        self.references = references
        monkeypatch.setattr(lifecycle, "read_baseline", self.read_baseline)
        monkeypatch.setattr(lifecycle, "measure_and_check", self.measure_and_check)
        monkeypatch.setattr(lifecycle, "reference_pass", self.reference_pass)

    def read_baseline(self, tracker: Tracker, parent_run_id: str, stored_pass: str | None = None) -> None:
        self.calls["read_baseline"] = stored_pass
        raise RuntimeError("the store is down")

    def measure_and_check(self, ctx: TrialContext, config: TrialConfig, label: str, log_dir: Path, watch: Any = None,
                          gate: Any = None, baseline: Any = None) -> lifecycle.Checked:
        self.calls["measure_and_check"] = (watch, gate, baseline)
        return lifecycle.Checked(Measurement(records=[RECORD], launches=1), Outcome.COMPLETE, "")

    def reference_pass(self, ctx: TrialContext, gate: Any, config: TrialConfig, label: str, log_dir: Path,
                       first: list[RequestRecord]) -> References:
        self.calls["reference_pass"] = first
        return self.references


def test_a_baseline_that_cannot_be_read_turns_early_stopping_off_and_leaves_the_judgement_to_read_it(ctx, monkeypatch):
    stages = Stages(monkeypatch)
    result = lifecycle.run_trial(ctx, "trial-1", Resolution(params={"algorithm": "ngram"}, config=NGRAM))
    assert stages.calls["read_baseline"] is None  # `exact` reads no stored pass of the baseline
    watch, gate, baseline = stages.calls["measure_and_check"]
    assert baseline is None and gate.compares  # measure_and_check reads it again before it compares
    assert watch is not None and watch.baseline is None
    run = ctx.tracker.client().get_run(result.run_id)
    assert run.data.tags["early_stopping"] == ("not applied: the baseline's run could not be read (RuntimeError: "
                                               "the store is down)")
    assert result.outcome is Outcome.COMPLETE and run.data.metrics["engine_launches"] == 1


def test_the_baseline_reads_no_baseline_and_records_its_reference_pass(ctx, monkeypatch):
    stages = Stages(monkeypatch, References({"equivalence/noise_requests.json": "[]"}, {"self_identical_share": 1.0},
                                            launches=1))
    result = lifecycle.run_trial(ctx, "trial-0", Resolution(params={"algorithm": "none"}, config=TrialConfig()))
    assert "read_baseline" not in stages.calls and stages.calls["reference_pass"] == [RECORD]
    run = ctx.tracker.client().get_run(result.run_id)
    assert (result.outcome, result.reason) == (Outcome.COMPLETE, "")
    assert run.data.metrics["engine_launches"] == 2 and run.data.metrics["self_identical_share"] == 1.0
    assert "noise_requests.json" in {f.path.split("/")[-1] for f in ctx.tracker.client().list_artifacts(
        result.run_id, "equivalence")}


def test_a_baseline_whose_reference_pass_failed_stays_complete_and_says_why(ctx, monkeypatch):
    Stages(monkeypatch, References(launches=1, problem="UNHEALTHY: engine died"))
    result = lifecycle.run_trial(ctx, "trial-0", Resolution(params={"algorithm": "none"}, config=TrialConfig()))
    assert result.outcome is Outcome.COMPLETE
    assert result.reason == ("its equivalence pass failed, so no trial can be compared with it: UNHEALTHY: engine "
                             "died")


def test_an_invalid_config_is_recorded_without_reading_or_measuring_anything(ctx, monkeypatch):
    stages = Stages(monkeypatch)
    broken = Violation("num_draft_tokens", "must be >= 1", "0")
    result = lifecycle.run_trial(ctx, "trial-2", Resolution(params={"algorithm": "ngram"}, config=None,
                                                            violations=[broken]))
    assert stages.calls == {} and (result.outcome, result.reason) == (Outcome.INVALID, str(broken))
    assert ctx.tracker.client().get_run(result.run_id).data.tags["early_stopping"] == ("not applied: the config is "
                                                                                       "invalid")
