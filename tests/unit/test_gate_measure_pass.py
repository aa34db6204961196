"""The equivalence gate's passes: which more pass a mode asks for is the `Gate`'s (pipeline/decide/equivalence.py),
the trial measures it through its own pass (`measure_config`, stood in for here) and `judge_pass` judges what it
measured. So the gate's `deterministic` mode runs here without an engine: the pass it asks for (its flags, label and
folder), what the baseline records of it, and a trial's verdicts against the baseline trial's stored pass, in MLflow
on SQLite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.measure.measurement import Measurement
from pipeline.measure.summary import RequestRecord, records_json, to_table
from pipeline.records.tracking import Tracker
from pipeline.records.trial_runs import NOISE_ARTIFACT, read_baseline
from pipeline.trial import gate as gate_module
from pipeline.trial import lifecycle
from pipeline.trial.context import TrialContext
from pipeline.trial.gate import DETERMINISTIC_ARTIFACT, References, deterministic_flags, gate_for, reference_pass
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
    """The trial's `measure_config`: answers with `measured` in turn and remembers what each pass was asked (the
    flags its engine starts with beyond the study's, its label and folder)."""

    def __init__(self, *measured: Measurement) -> None:
        self.measured = list(measured)
        self.asked: list[tuple[list[str], str, Path]] = []

    def __call__(self, ctx: TrialContext, config: TrialConfig, label: str, log_dir: Path,
                 watch: object = None) -> Measurement:
        self.asked.append((list(ctx.study.engine.extra_flags), label, log_dir))
        return self.measured.pop(0)


@pytest.fixture()
def tracker(tmp_path):
    return Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "s", artifact_dir=tmp_path / "artifacts")


def context(tracker: Tracker, parent: str, folder: Path) -> TrialContext:
    return TrialContext(study=STUDY, output_dir=str(folder), serve_url="http://127.0.0.1:1", tracker=tracker,
                        parent_run_id=parent, warmup=(), measure=())


def test_the_baseline_measures_its_deterministic_pass_and_records_it(tracker, tmp_path, monkeypatch):
    ctx = context(tracker, "parent", tmp_path)
    passes = Passes(Measurement(records=list(OUTPUTS), launches=1))
    monkeypatch.setattr(gate_module, "measure_config", passes)
    gate = gate_for(ctx, TrialConfig())
    assert (gate.mode, gate.reference_pass, gate.compares) == ("deterministic", "deterministic", False)
    got = reference_pass(ctx, gate, TrialConfig(), "trial-0", tmp_path, OUTPUTS)
    flags = deterministic_flags(STUDY, ctx.engine)
    assert flags and passes.asked == [(flags, "trial-0-deterministic", tmp_path / "deterministic")]
    assert got.problem is None and got.launches == 1 and got.metrics == {}
    assert [r["output_ids"] for r in json.loads(got.texts[DETERMINISTIC_ARTIFACT])] == [list(r.output_ids)
                                                                                        for r in OUTPUTS]
    trial_gate = gate_for(ctx, NGRAM)
    assert trial_gate.reference_pass is None  # a baseline's only
    assert reference_pass(ctx, trial_gate, NGRAM, "trial-1", tmp_path, OUTPUTS) == References()
    assert len(passes.asked) == 1


def test_a_failed_reference_pass_records_no_reference(tracker, tmp_path, monkeypatch):
    ctx = context(tracker, "parent", tmp_path)
    failed = Measurement(records=list(OUTPUTS), failure=Ending(Outcome.LAUNCH_FAILED, "refused"), launches=1)
    monkeypatch.setattr(gate_module, "measure_config", Passes(failed))
    got = reference_pass(ctx, gate_for(ctx, TrialConfig()), TrialConfig(), "trial-0", tmp_path, OUTPUTS)
    assert (got.texts, got.launches, got.problem) == ({}, 1, "LAUNCH_FAILED: refused")


def log_baseline(tracker: Tracker, texts: dict[str, str]) -> str:
    parent = tracker.start_study("s", "name: s\n", resume=False)
    tracker.log_trial(parent, study_name="s", run_name="baseline", kind="trial", config={"spec": {"algorithm": "none"}},
                      outcome=Outcome.COMPLETE, reason="", metrics={}, requests=to_table(OUTPUTS), texts=texts)
    return parent


def test_a_trial_is_judged_on_its_own_deterministic_pass_against_the_baselines(tracker, tmp_path, monkeypatch):
    ctx = context(tracker, log_baseline(tracker, {DETERMINISTIC_ARTIFACT: records_json(OUTPUTS)}), tmp_path)
    gate = gate_for(ctx, NGRAM)
    baseline = read_baseline(tracker, ctx.parent_run_id, gate.stored_pass)
    assert baseline is not None and baseline.deterministic == tuple(OUTPUTS) and baseline.noise is None

    def checked(own: Measurement) -> lifecycle.Checked:
        passes = Passes(Measurement(records=list(OUTPUTS)), own)  # the trial's pass, then its deterministic one
        monkeypatch.setattr(lifecycle, "measure_config", passes)
        monkeypatch.setattr(gate_module, "measure_config", passes)
        result = lifecycle.measure_and_check(ctx, NGRAM, "trial-1", tmp_path, gate=gate, baseline=baseline)
        assert [(flags, label) for flags, label, _ in passes.asked] == [
            ([], "trial-1"), (list(gate.flags), "trial-1-deterministic")]
        return result

    same = checked(Measurement(records=list(OUTPUTS), launches=1))
    assert same.outcome is Outcome.COMPLETE and same.measurement.launches == 1 and same.equivalence is not None
    wrong = checked(Measurement(records=[record(0, (9, 9, 9)), *OUTPUTS[1:]], launches=1))
    assert wrong.outcome is Outcome.NOT_EQUIVALENT and wrong.measurement.launches == 1
    failed = checked(Measurement(failure=Ending(Outcome.UNHEALTHY, "engine died"), launches=1))
    assert failed.outcome is Outcome.NOT_EQUIVALENT and "engine died" in failed.reason
    assert failed.measurement.launches == 1


def test_without_the_baselines_deterministic_pass_a_trial_measures_none_and_is_not_compared(tracker, tmp_path,
                                                                                           monkeypatch):
    ctx = context(tracker, log_baseline(tracker, {}), tmp_path)
    gate = gate_for(ctx, NGRAM)
    baseline = read_baseline(tracker, ctx.parent_run_id, gate.stored_pass)
    assert baseline is not None and baseline.deterministic is None
    passes = Passes(Measurement(records=list(OUTPUTS)))
    monkeypatch.setattr(lifecycle, "measure_config", passes)
    result = lifecycle.measure_and_check(ctx, NGRAM, "trial-1", tmp_path, gate=gate, baseline=baseline)
    assert [label for _, label, _ in passes.asked] == ["trial-1"]
    assert result.outcome is Outcome.COMPLETE and result.reason.startswith("not compared: the baseline has no "
                                                                           "deterministic-inference pass")


def test_the_baseline_measures_its_noise_pass_on_a_fresh_launch(tracker, tmp_path, monkeypatch):
    study = load_study(None, {"promotion.equivalence": "baseline-noise", "workload.measure_prompts": 8})
    ctx = TrialContext(study=study, output_dir=str(tmp_path), serve_url="http://127.0.0.1:1", tracker=tracker,
                       parent_run_id="parent", warmup=(), measure=())
    passes = Passes(Measurement(records=[record(0, (0, 1, 9)), *OUTPUTS[1:]], launches=1))
    launched: list[str] = []
    monkeypatch.setattr(gate_module, "measure_config", passes)
    monkeypatch.setattr(gate_module, "launch_fresh", launched.append)
    gate = gate_for(ctx, TrialConfig())
    got = reference_pass(ctx, gate, TrialConfig(), "trial-0", tmp_path, OUTPUTS)
    assert launched == [study.name] and passes.asked == [([], "trial-0-noise", tmp_path / "noise")]
    assert got.problem is None and got.launches == 1 and got.metrics["self_identical_share"] == 0.75
    assert len(json.loads(got.texts[NOISE_ARTIFACT])) == 4
    assert gate_for(ctx, NGRAM).stored_pass == "noise"  # what a trial reads of the baseline beside its requests
