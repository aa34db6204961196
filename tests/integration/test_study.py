"""The tuning loop end to end: local Ray, Ray Serve replicas of the real CPU engine (smallest model), MLflow on SQLite,
Optuna on SQLite. Small studies (few trials, tiny workload) so that the whole module stays within minutes."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

from pipeline.config import load_study
from pipeline.records.tracking import Tracker
from pipeline.records.registry import load_serving_config
from pipeline.search.space import BASELINE_ATTR, load_space
from pipeline.study.driver import run_study

from tests.conftest import APPS_LEFT

pytestmark = pytest.mark.integration


def write_space(tmp: Path, text: str) -> str:
    path = tmp / "space.yaml"
    path.write_text(text)
    return str(path)


def child_runs(study_cfg, out: Path):
    tracker = Tracker(f"sqlite:///{out / 'mlflow.db'}", study_cfg.name)
    client = tracker.client()
    runs = client.search_runs([tracker.experiment_id()], max_results=1000)
    return tracker, [r for r in runs if r.data.tags.get("specdec.kind") == "trial"]


def optuna_trials(out: Path, name: str):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{out / 'optuna.db'}").get_trials()


@pytest.fixture(scope="module")
def happy(finished_study):
    return finished_study


def test_study_runs_baseline_first_and_logs_every_trial(happy):
    study, out, code = happy
    assert code == 0
    trials = optuna_trials(out, study.name)
    assert len(trials) == 3
    assert trials[0].user_attrs.get(BASELINE_ATTR) and trials[0].number == 0
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    tracker, runs = child_runs(study, out)
    assert len(runs) == 3
    # The first trial started its engine in the standby replica the driver deployed, the others in that same replica.
    by_start = sorted(runs, key=lambda r: r.info.start_time)
    assert [r.data.tags["serve_replica"] for r in by_start] == ["standby", "reused", "reused"]
    client = tracker.client()
    for run in runs:
        assert run.data.tags["outcome"] == "COMPLETE", run.data.tags.get("reason")
        assert "spec.algorithm" in run.data.params and run.data.metrics["tput_tok_s"] > 0
        # The run spans the trial (deploy, warm-up, measurement), so the MLflow UI shows real durations.
        assert (run.info.end_time - run.info.start_time) / 1000 >= run.data.metrics["time_total_s"]
        if run.data.tags["engine_launch"] == "shared":  # the previous trial's engine settings: its engine ran it
            assert "time_engine_start_s" not in run.data.metrics and run.data.metrics["engine_launches"] == 0
        else:
            assert 0 < run.data.metrics["time_engine_start_s"] < run.data.metrics["time_deploy_s"]
        files = {f.path for f in client.list_artifacts(run.info.run_id)}
        assert {"requests.parquet", "engine.log", "server_info.json", "trial_config.json"} <= files


def test_promoted_config_is_in_the_registry_and_no_trial_app_is_left(happy):
    study, out, _ = happy
    config = load_serving_config(f"sqlite:///{out / 'mlflow.db'}", f"models:/specdec-{study.name}@production")
    # Search only (TINY_STUDY: promotion.finalists 0): the baseline is registered as the first production version,
    # nothing was re-measured, and the decision says so instead of posing as a verdict on the trials.
    assert config.replica.model == "smollm2-135m" and config.replica.spec.algorithm == "none"
    assert (out / "promoted.yaml").exists() and (out / "deploy" / "engine_command.sh").exists()
    tracker, _ = child_runs(study, out)
    client = tracker.client()
    assert not client.search_runs([tracker.experiment_id()], "tags.`specdec.kind` = 'finalist'")
    (parent,) = client.search_runs([tracker.experiment_id()], "tags.`specdec.kind` = 'study'")
    assert parent.data.tags["decision"] == "keep_baseline"
    decision = Path(client.download_artifacts(parent.info.run_id, "decision.txt")).read_text()
    assert "promotion.finalists is 0, so nothing was re-measured" in decision, decision
    # the workers' and the finalists' apps too, as Serve listed them right after the study (tests/conftest.py)
    assert json.loads((out / APPS_LEFT).read_text()) == []


TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 4, "vocab_size": 1000,
              "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6}


def test_an_sglang_study_on_a_cluster_without_gpus_fails_fast_and_says_why(tmp_path):
    # The replica asks Ray for a GPU; no node has one, so it could never be placed. The trial says so at once instead
    # of waiting out the deploy timeout. (Preflight and node checks in the replica: tests/end_to_end/test_cluster.py.)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    study = load_study(None, {"name": "it-sglang", "output_dir": str(tmp_path / "out"), "engine.kind": "sglang",
                              "engine.device": "cuda",
                              "model.target": str(model), "search_space": "ngram.yaml", "budget.max_trials": 1})
    assert run_study(study, load_space(study.search_space_path())) == 1  # no baseline could be measured
    _, runs = child_runs(study, tmp_path / "out")
    (run,) = runs
    assert run.data.tags["outcome"] == "LAUNCH_FAILED"
    reason = run.data.tags["reason"]
    assert "no Ray node can host this replica" in reason and "GPU=1" in reason and "engine.kind: cpu" in reason
