"""A drift over the finalist stage moves a sequential comparison and not an interleaved one, for real
(pipeline/decide/spread.py): a stage of two identical configs (the baseline and a "twin" finalist, both without
speculation, so their true ratio is 1) through Ray Serve replicas of the CPU engine, every fresh engine slower than the
one before (`--test-fault drift-steps=3`: the n-th start runs every round 1 + 3n times as long). The stage runs
interleaved (B F F B); since the configs are identical its four runs are exchangeable, and the same runs given the
sequential roles (the first two engines the baseline's, the last two the finalist's) show what the old order measured.

Forced: the drift's own factors (1, 4, 7, 10) give the interleaved pairs 1/4 and 10/7 (median ratio 0.84) and the
sequential ones 1/7 and 4/10 (median 0.27). The bound stated here, the true ratio 1 within 2x either way, holds the
interleaved ratio unless the machine's noise moves it by more than 1.68x, and leaves the sequential ratio outside
unless the noise moves it by more than 1.85x: beyond the run-to-run spread of one config on a busy 2-core box (1.45x),
the more so as most of a slowed engine's round is a sleep that no other work slows.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.decide.spread import paired_ratios
from pipeline.records.tracking import Tracker
from pipeline.study.driver import build_context, connect_ray
from pipeline.study.finalists import ORDER_KIND_TAG, ORDER_TAG, SEQUENCE_TAG, STAGE_TAG, measure_levels
from pipeline.trial.replicas import delete_study_apps
from serve.spec import NoSpec
from tests.integration.conftest import SMOL, TEST_THREADS

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
NAME = "it-finalist-order"
BOUND = 2.0  # the interleaved ratio within this factor of the true 1; the sequential one beyond it


def test_a_drift_over_the_stage_moves_the_sequential_ratio_and_not_the_interleaved_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    study = load_study(None, {"name": NAME, "output_dir": str(tmp_path), "model.target": SMOL,
                              "engine.threads": TEST_THREADS, "engine.start_timeout_s": 300,
                              "engine.extra_flags": ["--verify-probe-seconds", "0", "--test-fault", "drift-steps=3"],
                              "engine.env": {"SPECDEC_TEST_FAULT_STATE": str(tmp_path / "fault-state")},
                              "workload.source": "free-text", "workload.warmup_prompts": 1,
                              "workload.measure_prompts": 3, "workload.max_new_tokens": 16,
                              "workload.remeasure": 0, "promotion.spread_reruns": 0,
                              "budget.early_stopping": False})
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", NAME, artifact_dir=tmp_path / "mlartifacts")
    parent = tracker.start_study(NAME, f"name: {NAME}\n", resume=False)
    ctx = build_context(study, tmp_path, connect_ray(NAME), tracker, parent)
    config = TrialConfig(spec=NoSpec(), concurrency=1)
    try:
        (level,) = measure_levels(ctx, config, [("twin", config)], [1], 2)
    finally:
        delete_study_apps(NAME)
    console = capsys.readouterr().out
    assert "final-baseline run 0: slot 1 of 4 in the interleaved order" in console, console
    assert "twin run 1: slot 3 of 4 in the interleaved order" in console, console

    runs = tracker.client().search_runs([tracker.experiment_id()], "tags.`specdec.kind` = 'finalist'")
    by_name = {r.info.run_name: r for r in runs}
    assert sorted(by_name) == ["final-baseline-run0", "final-baseline-run1", "twin-run0", "twin-run1"]
    slots = {name: int(r.data.tags[ORDER_TAG]) for name, r in by_name.items()}
    assert slots == {"final-baseline-run0": 1, "twin-run0": 2, "twin-run1": 3, "final-baseline-run1": 4}
    assert all(r.data.tags[SEQUENCE_TAG] == r.data.tags[ORDER_TAG] for r in runs)  # no replacement here
    assert {r.data.tags[ORDER_KIND_TAG] for r in runs} == {"interleaved"}
    assert len({r.data.tags[STAGE_TAG] for r in runs}) == 1
    tput = {name: r.data.metrics["tput_tok_s"] for name, r in by_name.items()}
    in_order = [tput[name] for name in sorted(tput, key=slots.__getitem__)]
    # the drift is there: the fourth engine runs every round 10x as long as the first
    assert in_order[3] < in_order[0] / BOUND, in_order

    # what the decision reads: each run with its slot, so the levels rule pairs run k with the baseline's run k
    (twin,) = level.candidates
    assert [r.order for r in level.baseline] == [0, 3] and [r.order for r in twin.runs] == [1, 2]
    pairs = paired_ratios([r.tput_tok_s for r in level.baseline], [r.tput_tok_s for r in twin.runs])
    assert pairs == pytest.approx([in_order[1] / in_order[0], in_order[2] / in_order[3]])
    interleaved = statistics.median(pairs)
    sequential = statistics.median(paired_ratios(in_order[:2], in_order[2:]))
    assert 1 / BOUND < interleaved < BOUND, (interleaved, in_order)
    assert sequential < 1 / BOUND, (sequential, in_order)
