"""A resumed study's finalist stage leaves no run of the interrupted stage beside its own (pipeline/study/finalists.py,
`drop_stale_runs`), on MLflow over SQLite: the interrupted stage logged the baseline's runs 0-2 before its SIGTERM;
the resumed stage logs its own, its run 1 replaced by the spread rule (so renamed `-replaced`) and a run 3 in its
place. De-duplication by run name alone left the old `final-baseline-run1` active and untagged, counted by every
reader of the counted re-runs."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.records.cycles import counted_reruns
from pipeline.records.tracking import REPLACED_TAG, Tracker
from pipeline.study.finalists import STAGE_TAG, drop_stale_runs
from pipeline.vocabulary.outcome import Outcome

pytestmark = pytest.mark.integration
NAME = "it-finalist-resume"


def log(tracker: Tracker, parent: str, name: str, stage: str | None, kind: str = "finalist", **tags: str) -> None:
    tracker.log_trial(parent, study_name=NAME, run_name=name, kind=kind, config={}, outcome=Outcome.COMPLETE,
                      reason="", metrics={"tput_tok_s": 10.0}, requests=None, texts={},
                      extra_tags={**({STAGE_TAG: stage} if stage else {}), **tags})


def active(tracker: Tracker, parent: str) -> dict[str, dict[str, str]]:
    runs = tracker.client().search_runs([tracker.experiment_id()], f"tags.mlflow.parentRunId = '{parent}'")
    return {r.info.run_name: r.data.tags for r in runs}


def test_a_resumed_stage_deletes_the_interrupted_stages_runs_once_its_own_are_logged(tmp_path: Path):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", NAME, artifact_dir=tmp_path / "mlartifacts")
    parent = tracker.start_study(NAME, f"name: {NAME}\n", resume=False)
    other = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", NAME).start_study("another", "", resume=False)
    log(tracker, parent, "ngram-d4", None, kind="trial")  # the search's record: not the stage's to touch
    log(tracker, other, "final-baseline-run1", "old")  # another study run's stage: not this one's
    for k in range(3):  # the interrupted stage's runs; run 1 as a version that did not tag stages logged it
        log(tracker, parent, f"final-baseline-run{k}", None if k == 1 else "old")
    log(tracker, parent, "final-baseline-run0", "new")
    log(tracker, parent, "final-baseline-run1-replaced", "new", **{REPLACED_TAG: "replaced by final-baseline-run3"})
    log(tracker, parent, "final-baseline-run2", "new")
    log(tracker, parent, "final-baseline-run3", "new")
    before = active(tracker, parent)
    # what a resume left: the old run 1, untagged and counted, among the new set
    assert STAGE_TAG not in before["final-baseline-run1"] and REPLACED_TAG not in before["final-baseline-run1"]

    ctx = SimpleNamespace(tracker=tracker, parent_run_id=parent)
    assert drop_stale_runs(ctx, "new") == ["final-baseline-run1"]  # type: ignore[arg-type]

    after = active(tracker, parent)
    assert sorted(after) == ["final-baseline-run0", "final-baseline-run1-replaced", "final-baseline-run2",
                             "final-baseline-run3", "ngram-d4"]
    assert all(tags.get(STAGE_TAG) == "new" for name, tags in after.items() if name != "ngram-d4")
    runs = tracker.client().search_runs([tracker.experiment_id()], f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(r.info.run_name for r in counted_reruns(runs) if r.data.tags.get("specdec.kind") == "finalist") == [
        "final-baseline-run0", "final-baseline-run2", "final-baseline-run3"]
    assert sorted(active(tracker, other)) == ["final-baseline-run1"]
