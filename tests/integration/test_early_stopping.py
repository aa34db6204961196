"""Early stopping on the real stack (local Ray, CPU engine, MLflow and Optuna on SQLite): a speculative trial made
10x slower by the engine's test-only `slow-steps` fault (serve/engines/cpu/faults.py, `@speculative`: the baseline
runs at full speed) is stopped after a few measured requests. It must be PRUNED in Optuna and in MLflow, with the
bound that stopped it in the reason, its requests and engine log recorded like any trial, and never a finalist.

Why it is deterministic: 10x slower is ~0.1-0.2x the baseline (an accept length of 1-2 on a cold trie cannot make up
for it), while the statistical bound at 3-5 requests allows at most ~2.2x the measured figure plus the run noise
(pipeline/search/stopping.py); the last of 6 measured requests is never needed. 4 new tokens a request: each slowed
request costs ~10x its baseline time in wall clock, and the rule needs no longer outputs."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from pipeline.config import load_study
from pipeline.measure.summary import to_records
from pipeline.records.tracking import Tracker
from pipeline.search.space import load_space
from pipeline.study.driver import run_study
from tests.integration.conftest import TEST_THREADS

pytestmark = pytest.mark.integration

SPACE = ("algorithms: [none, ngram]\ncommon:\n  warmup_requests: {type: fixed, value: 0}\nbranches:\n  ngram:\n"
         "    num_draft_tokens: {type: fixed, value: 3}\n    max_bfs_breadth: {type: fixed, value: 1}\n"
         "    capacity: {type: fixed, value: 100000}\n")
MEASURED = 6


def test_a_config_that_cannot_beat_the_baseline_is_pruned_in_optuna_and_mlflow(tmp_path):
    import pyarrow.parquet as pq

    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    study = load_study(None, {
        "name": "it-early-stop", "output_dir": str(tmp_path), "search_space": str(space), "seed": 0,
        "workload.warmup_prompts": 0, "workload.measure_prompts": MEASURED, "workload.max_new_tokens": 4,
        "budget.max_trials": 2, "promotion.finalists": 1, "engine.start_timeout_s": 300,
        "engine.threads": TEST_THREADS,
        "engine.extra_flags": ["--verify-probe-seconds", "0", "--test-fault", "slow-steps=10@speculative"]})
    assert study.budget.early_stopping  # the default

    assert run_study(study, load_space(space)) == 0

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", study.name)
    client = tracker.client()
    runs = [r for r in client.search_runs([tracker.experiment_id()], order_by=["attributes.start_time ASC"])
            if r.data.tags.get("specdec.kind") == "trial"]
    assert [r.data.params.get("spec.algorithm") for r in runs] == ["none", "ngram"]
    baseline, slow = runs
    assert baseline.data.tags["outcome"] == "COMPLETE"  # the baseline is never stopped
    assert baseline.data.tags["early_stopping"] == "not applied: the baseline is never stopped"
    assert baseline.data.metrics["n_requests"] == MEASURED

    tags, metrics = slow.data.tags, slow.data.metrics
    assert tags["outcome"] == "PRUNED", f"{tags['outcome']}: {tags.get('reason')}"
    assert tags["early_stopping"].startswith("on (alpha 0.001, sigma 0.05, baseline ")
    stopped_after = int(metrics["stop_requests"])
    assert 2 <= stopped_after < MEASURED
    assert f"stopped after {stopped_after} of {MEASURED} measured requests" in tags["reason"]
    assert "is below the baseline's lower bound" in tags["reason"]
    assert metrics["stop_statistical_high_tok_s"] < metrics["stop_baseline_low_tok_s"]
    assert metrics["stop_baseline_low_tok_s"] < baseline.data.metrics["tput_tok_s"]
    # recorded like any trial: the requests it measured and the engine's own log
    path = client.download_artifacts(slow.info.run_id, "requests.parquet", str(tmp_path))
    measured = [r for r in to_records(pq.read_table(path)) if r.phase == "measure"]
    assert len(measured) == stopped_after and all(r.ok for r in measured)
    assert [r.request_id for r in measured] == [f"measure-{i}" for i in range(stopped_after)]
    assert metrics["n_requests"] == stopped_after and metrics["tput_tok_s"] < metrics["stop_baseline_low_tok_s"]
    engine_log = Path(client.download_artifacts(slow.info.run_id, "engine.log", str(tmp_path))).read_text()
    assert "TEST FAULT armed: slow-steps=10@speculative" in engine_log

    trials = optuna.load_study(study_name=study.name, storage=f"sqlite:///{tmp_path / 'optuna.db'}").get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "PRUNED"]
    pruned = trials[1]
    # its value is the partial throughput it reported, and each measured chunk reached Optuna as a step
    assert pruned.value == pytest.approx(metrics["tput_tok_s"])
    assert len(pruned.intermediate_values) >= stopped_after

    # never a finalist: nothing was re-measured, the study kept the baseline
    assert not client.search_runs([tracker.experiment_id()], "tags.`specdec.kind` = 'finalist'")
    study_run = client.search_runs([tracker.experiment_id()], "tags.`specdec.kind` = 'study'")[0]
    assert study_run.data.tags.get("decision") == "keep_baseline"
