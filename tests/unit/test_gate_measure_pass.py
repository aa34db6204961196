"""The equivalence gate (pipeline/trial/gate.py) decides which more passes a mode needs and judges them; the trial
measures them (`MeasurePass`, `pipeline.trial.lifecycle.another_pass`). So the gate's `deterministic` mode runs here
without an engine: the pass it asks for (its flags, label and folder), what it records, and its verdicts, against
the baseline trial's stored pass in MLflow on SQLite."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.config import TrialConfig, load_study
from pipeline.measure.summary import RequestRecord
from pipeline.records.tracking import Tracker
from pipeline.trial.context import Measurement
from pipeline.trial.gate import (DETERMINISTIC_ARTIFACT, baseline_passes, deterministic_flags, judge_trial,
                                 records_json)
from pipeline.vocabulary.outcome import Ending, Outcome
from serve.spec import NgramSpec

ROOT = Path(__file__).resolve().parents[2]
NGRAM = TrialConfig(spec=NgramSpec(num_draft_tokens=4, max_bfs_breadth=1))


def record(i: int, tokens: tuple[int, ...]) -> RequestRecord:
    return RequestRecord(request_id=f"r{i}", phase="measure", prompt_index=i, concurrency=1, start_s=0.0, ttft_s=0.1,
                         e2e_s=0.5, prompt_tokens=3, completion_tokens=len(tokens), finish_reason="length",
                         output_ids=tokens)


OUTPUTS = [record(i, (i, i + 1, i + 2)) for i in range(4)]
# an engine kind whose deterministic passes need flags (SGLang), so the mode stays `deterministic`
STUDY = load_study(None, {"engine.kind": "sglang", "engine.device": "cuda",
                          "model.target": str(ROOT / "examples" / "models" / "deepseek-v2-236b"),
                          "model.dtype": "auto", "promotion.equivalence": "deterministic",
                          "workload.measure_prompts": 4})


class Passes:
    """A trial's `MeasurePass` that answers with `measured` and remembers what it was asked."""

    def __init__(self, measured: Measurement) -> None:
        self.measured = measured
        self.asked: list[tuple[list[str], str, Path]] = []

    def __call__(self, flags, label: str, log_dir: Path) -> Measurement:
        self.asked.append((list(flags), label, log_dir))
        return self.measured


def test_the_baseline_asks_the_trial_for_its_deterministic_pass_and_records_it(tmp_path):
    measure = Passes(Measurement(records=list(OUTPUTS), launches=1))
    got = baseline_passes(STUDY, TrialConfig(), OUTPUTS, "trial-0", tmp_path, measure)
    flags = deterministic_flags(STUDY)
    assert flags and measure.asked == [(flags, "trial-0-deterministic", tmp_path / "deterministic")]
    assert got.problem is None and got.launches == 1
    assert [r["output_ids"] for r in json.loads(got.texts[DETERMINISTIC_ARTIFACT])] == [list(r.output_ids)
                                                                                        for r in OUTPUTS]
    assert baseline_passes(STUDY, NGRAM, OUTPUTS, "trial-1", tmp_path, measure).texts == {}  # a baseline's only
    assert len(measure.asked) == 1


def test_a_trial_is_judged_on_its_own_deterministic_pass_against_the_baselines(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "s", artifact_dir=tmp_path / "artifacts")
    parent = tracker.start_study("s", "name: s\n", resume=False)
    tracker.log_trial(parent, study_name="s", run_name="baseline", kind="trial", config={"spec": {"algorithm": "none"}},
                      outcome=Outcome.COMPLETE, reason="", metrics={}, requests=None,
                      texts={DETERMINISTIC_ARTIFACT: records_json(OUTPUTS)})

    def verdict(measured: Measurement):
        measure = Passes(measured)
        result = judge_trial(STUDY, tracker, parent, NGRAM, OUTPUTS, "trial-1", tmp_path, OUTPUTS, measure)
        assert [label for _, label, _ in measure.asked] == ["trial-1-deterministic"]
        return result

    same = verdict(Measurement(records=list(OUTPUTS), launches=1))
    assert same.passed is True and same.launches == 1 and same.report is not None
    wrong = verdict(Measurement(records=[record(0, (9, 9, 9)), *OUTPUTS[1:]], launches=1))
    assert wrong.passed is False and wrong.launches == 1
    failed = verdict(Measurement(failure=Ending(Outcome.UNHEALTHY, "engine died"), launches=1))
    assert failed.passed is False and "engine died" in failed.reason and failed.launches == 1
