"""The MLflow UI opens where trials are compared (issue #20): the experiment is tagged as model development, and the
shared view the printed link names shows the comparison columns. Real MLflow on SQLite."""

import json

from pipeline.records.tracking import EXPERIMENT_KIND, Tracker, runs_link
from pipeline.vocabulary.outcome import Outcome


def test_the_experiment_lands_on_runs_and_the_link_shows_the_comparison_columns(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "ui", artifact_dir=tmp_path / "artifacts")
    parent = tracker.start_study("ui", "name: ui\n", resume=False)
    tags = tracker.client().get_experiment(tracker.experiment_id()).tags
    assert tags["mlflow.experimentKind"] == EXPERIMENT_KIND == "custom_model_development"
    link = runs_link("http://127.0.0.1:5000/", tracker.experiment_id())
    # MLflow 3.17's UI ignores the kind tag: the link itself selects "Model training" and the shared view.
    assert link == (f"http://127.0.0.1:5000/#/experiments/{tracker.experiment_id()}/runs"
                    "?workflowType=machine_learning&viewStateShareKey=specdec-trials")
    # The UI's saved-view envelope (listed by name under "Views"), its state a JSON string.
    envelope = json.loads(tags["mlflow.sharedViewState.specdec-trials"])
    assert envelope["name"] and isinstance(envelope["createdAt"], int) and isinstance(envelope["state"], str)
    view = json.loads(envelope["state"])
    assert view["selectedColumns"][:4] == ["metrics.`tput_tok_s`", "metrics.`vs_baseline`", "metrics.`accept_len`",
                                           "metrics.`ttft_p50_ms`"] and "tags.`outcome`" in view["selectedColumns"]
    assert view["searchFilter"] == "tags.`specdec.kind` = 'trial'" and view["orderByAsc"] is False
    trial = tracker.log_trial(parent, study_name="ui", run_name="trial-1", kind="trial", config={"spec": {}},
                              outcome=Outcome.COMPLETE, reason="", metrics={"tput_tok_s": 3.0}, requests=None, texts={})
    tracker.log_vs_baseline({trial: 1.5})
    assert tracker.client().get_run(trial).data.metrics["vs_baseline"] == 1.5
