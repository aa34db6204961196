"""A config's re-runs that disagree are measured again, for real (pipeline/decide/spread.py): three fresh engines of
one NGRAM config through Ray Serve replicas of the CPU engine, the second of them slowed as a whole
(`--test-fault slow-engine=2@speculative`: every round of that one engine takes 6x as long, its siblings run at full
speed). A speculative run has no plain steps for the window check to time, so only the runs' spread can see it.
Forced: 6x is beyond the run-to-run noise of a busy 2-core machine (2.4x seen), so the slow run is always farther
from the median than any other and is replaced by a fresh engine (a noisy sibling may be replaced too, within
`promotion.spread_reruns`), and it stays in MLflow with why."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.records.cycles import counted_reruns
from pipeline.records.tracking import Tracker
from pipeline.study.driver import build_context, connect_ray
from pipeline.study.finalists import measure_levels
from pipeline.trial.replicas import delete_study_apps
from serve.engines.cpu.faults import SLOW_ENGINE_FACTOR
from serve.spec import NgramSpec
from tests.integration.conftest import SMOL, TEST_THREADS

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
NAME = "it-run-spread"


def test_the_run_an_engine_slowed_as_a_whole_is_measured_again_and_kept_on_record(tmp_path: Path):
    study = load_study(None, {"name": NAME, "output_dir": str(tmp_path), "model.target": SMOL,
                              "engine.threads": TEST_THREADS, "engine.start_timeout_s": 300,
                              "engine.extra_flags": ["--verify-probe-seconds", "0",
                                                     "--test-fault", "slow-engine=2@speculative"],
                              "engine.env": {"SPECDEC_TEST_FAULT_STATE": str(tmp_path / "fault-state")},
                              "workload.source": "free-text", "workload.warmup_prompts": 1,
                              "workload.measure_prompts": 3, "workload.max_new_tokens": 16,
                              "workload.remeasure": 0, "promotion.spread_reruns": 2,
                              "budget.early_stopping": False})
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", NAME, artifact_dir=tmp_path / "mlartifacts")
    parent = tracker.start_study(NAME, f"name: {NAME}\n", resume=False)
    ctx = build_context(study, tmp_path, connect_ray(NAME), tracker, parent)
    config = TrialConfig(spec=NgramSpec(num_draft_tokens=4, max_bfs_breadth=1), concurrency=1)
    try:
        # the config as the "baseline" of a stage without finalists: its runs are measured, judged and recorded
        (level,) = measure_levels(ctx, config, [], [1], 3)
    finally:
        delete_study_apps(NAME)
    runs = tracker.client().search_runs([tracker.experiment_id()], "tags.`specdec.kind` = 'finalist'",
                                        order_by=["attributes.start_time ASC"])
    by_name = {r.info.run_name: r for r in runs}
    slow = by_name.get("final-baseline-run1-replaced")
    assert slow is not None, sorted(by_name)  # the second engine's run, kept on record under its own name
    why = slow.data.tags["run_replaced"]
    assert why.startswith("replaced by final-baseline-run") and "below the runs' median" in why, why
    counted = [r for name, r in by_name.items() if not name.endswith("-replaced")]
    assert len(counted) == 3 and len(runs) - 3 <= study.promotion.spread_reruns, sorted(by_name)
    assert [r.data.tags["outcome"] for r in counted] == ["COMPLETE"] * 3, [r.data.tags.get("reason") for r in counted]
    slow_tput = slow.data.metrics["tput_tok_s"]
    # what the decision reads: the three counted runs, never the slowed one
    assert len(level.baseline) == 3
    assert all(r.tput_tok_s > slow_tput * SLOW_ENGINE_FACTOR / 3 for r in level.baseline), (slow_tput, level.baseline)
    assert sorted(r.tput_tok_s for r in level.baseline) == sorted(r.data.metrics["tput_tok_s"] for r in counted)
    # the loop's drift reference reads the counted runs only (pipeline.records.cycles.measured_requests)
    assert sorted(r.info.run_name for r in counted_reruns(runs)) == sorted(r.info.run_name for r in counted)
