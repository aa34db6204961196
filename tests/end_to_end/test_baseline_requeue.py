"""Issue 40 item 4 through a real study: the baseline's first engine start never gets healthy (a cold node's first
launch; the CPU engine's `--test-fault hang-at-start=1@baseline`, counted in `$SPECDEC_TEST_FAULT_STATE`), so it
TIMEOUTs whatever the timeout. The study queues the baseline again and measures it, in the same run and on
`--resume`. Real local Ray, Serve, the CPU engine (smallest model), MLflow on SQLite."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_study
from pipeline.records.tracking import Tracker
from pipeline.search.space import load_space
from pipeline.study.driver import run_study
from tests.integration.conftest import TEST_THREADS

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]

SPACE = ("algorithms: [none, ngram]\ncommon:\n  warmup_requests: {type: fixed, value: 1}\nbranches:\n  ngram:\n"
         "    num_draft_tokens: {type: fixed, value: 3}\n    max_bfs_breadth: {type: fixed, value: 1}\n"
         "    capacity: {type: fixed, value: 100000}\n")


def study_of(tmp_path: Path, name: str, trials: int):
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    # The hung start is certain to time out (it never answers), so the timeout is the test's wall time twice over:
    # 30 s, still several times what a healthy start of this engine (no probe, smallest model) takes under CI load.
    return load_study(None, {
        "name": name, "output_dir": str(tmp_path), "search_space": str(space), "seed": 0,
        "search.strategy": "tpe", "budget.max_trials": trials, "promotion.finalists": 0,
        "workload.warmup_prompts": 1, "workload.measure_prompts": 2, "workload.max_new_tokens": 8, "workload.remeasure": 0,
        "engine.start_timeout_s": 30, "engine.threads": TEST_THREADS,
        "engine.env": {"SPECDEC_TEST_FAULT_STATE": str(tmp_path / "fault-state")},
        "engine.extra_flags": ["--verify-probe-seconds", "0", "--test-fault", "hang-at-start=1@baseline"]})


def trial_runs(study, out: Path):
    tracker = Tracker(f"sqlite:///{out / 'mlflow.db'}", study.name)
    client = tracker.client()
    runs = client.search_runs([tracker.experiment_id()], max_results=100, order_by=["attributes.start_time ASC"])
    return [r for r in runs if r.data.tags.get("specdec.kind") == "trial"]


def outcomes(runs) -> list[tuple[str | None, str | None]]:
    return [(r.data.params.get("spec.algorithm"), r.data.tags.get("outcome")) for r in runs]


def test_a_baseline_that_timed_out_is_queued_again_and_measured(tmp_path):
    study = study_of(tmp_path, "it-baseline-requeue", trials=3)
    assert run_study(study, load_space(study.search_space_path())) == 0
    runs = trial_runs(study, tmp_path)
    assert outcomes(runs) == [("none", "TIMEOUT"), ("none", "COMPLETE"), ("ngram", "COMPLETE")], \
        [r.data.tags.get("reason") for r in runs]
    assert "engine not ready after 30 s" in (runs[0].data.tags.get("reason") or "")


def test_resume_queues_a_baseline_that_timed_out_and_measures_it(tmp_path):
    first = study_of(tmp_path, "it-baseline-requeue-resume", trials=1)
    assert run_study(first, load_space(first.search_space_path())) == 1  # no baseline measured: nothing decided
    assert outcomes(trial_runs(first, tmp_path)) == [("none", "TIMEOUT")]
    resumed = study_of(tmp_path, "it-baseline-requeue-resume", trials=2)
    assert run_study(resumed, load_space(resumed.search_space_path()), resume=True) == 0
    assert outcomes(trial_runs(resumed, tmp_path)) == [("none", "TIMEOUT"), ("none", "COMPLETE")]
