"""A plain-decoding window whose steps run slower than the engine's own calibration is measured again and flagged
(pipeline/measure/window.py), for real: a baseline trial through a Ray Serve replica of the CPU engine, whose
round table is its quiet calibration (the probe times the model's forward directly) while every scheduler round
takes four times as long (`--test-fault slow-steps=4`, serve/engines/cpu/faults.py: the round sleeps after its
forward). Neither the run-queue wait nor steal sees that: the engine sleeps, it does not wait for a core. Forced
both ways: a 4x slower step is over twice the limit on any machine, and the fault lasts the whole trial, so every window
is flagged and the trial is recorded with its flag, never dropped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.measure.window import STEP_LIMIT
from pipeline.records.tracking import Tracker
from pipeline.vocabulary.resolution import Resolution
from pipeline.study.driver import build_context, connect_ray
from pipeline.trial.lifecycle import run_trial
from pipeline.trial.replicas import delete_study_apps
from pipeline.vocabulary.outcome import Outcome
from serve.spec import NoSpec
from tests.integration.conftest import SMOL, TEST_THREADS

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
NAME = "it-window-steps"
SLOW = 4.0


def test_steps_slower_than_the_engines_calibration_are_measured_again_and_flagged(tmp_path: Path):
    study = load_study(None, {"name": NAME, "output_dir": str(tmp_path), "model.target": SMOL,
                              "engine.threads": TEST_THREADS, "engine.start_timeout_s": 300,
                              "engine.extra_flags": ["--test-fault", f"slow-steps={SLOW:g}"],
                              "workload.source": "templated", "workload.warmup_prompts": 1,
                              "workload.measure_prompts": 3, "workload.max_new_tokens": 8,
                              "workload.remeasure": 1, "budget.early_stopping": False})
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", NAME, artifact_dir=tmp_path / "mlartifacts")
    parent = tracker.start_study(NAME, f"name: {NAME}\n", resume=False)
    ctx = build_context(study, tmp_path, connect_ray(NAME), tracker, parent)
    try:
        result = run_trial(ctx, "baseline", Resolution(params={"algorithm": "none"},
                                                       config=TrialConfig(spec=NoSpec(), concurrency=1)))
    finally:
        delete_study_apps(NAME)
    run = tracker.client().get_run(result.run_id)
    tags, metrics = run.data.tags, run.data.metrics
    assert tags["outcome"] == Outcome.COMPLETE.value, tags.get("reason")  # recorded with its flag, not dropped
    info = json.loads(Path(tracker.client().download_artifacts(run.info.run_id, "server_info.json",
                                                               str(tmp_path))).read_text())
    assert info["verify_cost"]["round_cost"]["ms"], "the engine reported no round table to be judged against"
    windows = json.loads(Path(tracker.client().download_artifacts(run.info.run_id, "windows.json",
                                                                  str(tmp_path))).read_text())
    assert len(windows) == 2 and metrics["window_remeasured"] == 1  # measured again once (workload.remeasure)
    for window in windows:
        assert window["disturbed"] is True and window["step_ratio"] > STEP_LIMIT, window
        assert any("plain steps took" in reason for reason in window["reasons"]), window["reasons"]
    assert tags["measurement_flag"] == "disturbed"
    assert metrics["window_step_ratio"] == pytest.approx(windows[-1]["step_ratio"])
