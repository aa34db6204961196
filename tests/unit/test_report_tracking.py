"""Trial runs named by their config labels keep their identity in the `trial_id` tag (real MLflow on SQLite): a
repeat of a config is named apart by its trial id, a resumed trial replaces its own record, never another trial's of
the same config; the study run carries the headline as its MLflow description."""

import pytest

from pipeline.records.trial_runs import rows_from_runs
from pipeline.records.tracking import DESCRIPTION_TAG, TRIAL_ID_TAG, Tracker
from pipeline.vocabulary.outcome import Outcome

LABEL = "ngram BFS d4 b1 depth18 warm1"


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlflow")
    return Tracker(f"sqlite:///{folder / 'mlflow.db'}", "names", artifact_dir=folder / "artifacts")


def log(tracker, parent, trial_id, tput, run_name=LABEL):
    return tracker.log_trial(parent, study_name="names", run_name=run_name, kind="trial", trial_id=trial_id,
                             config={"spec": {"algorithm": "ngram"}}, outcome=Outcome.COMPLETE, reason="",
                             metrics={"tput_tok_s": tput}, requests=None, texts={})


def test_two_trials_of_one_config_are_both_kept_and_a_resumed_one_replaces_only_itself(tracker):
    parent = tracker.start_study("names", "name: names\n", resume=False)
    first = log(tracker, parent, "aaa111", 30.0)
    second = log(tracker, parent, "bbb222", 32.0)
    again = log(tracker, parent, "aaa111", 31.0)  # trial aaa111 logged again after a resume
    runs = tracker.trial_runs(parent)
    assert sorted(r.info.run_id for r in runs) == sorted([second, again]) and first not in {r.info.run_id for r in runs}
    # The second trial of the config reads apart in the MLflow UI itself; the resumed first one keeps its name.
    assert {(r.data.tags[TRIAL_ID_TAG], r.info.run_name) for r in runs} == {("aaa111", LABEL),
                                                                           ("bbb222", f"{LABEL} #bbb222")}
    assert sorted(r.name for r in rows_from_runs(runs)) == [LABEL, f"{LABEL} #bbb222"]


def test_a_record_from_before_labels_is_replaced_by_the_same_trial(tracker):
    parent = tracker.start_study("legacy", "name: legacy\n", resume=False)
    old = tracker.log_trial(parent, study_name="legacy", run_name="trial-ccc333", kind="trial",
                            config={"spec": {"algorithm": "ngram"}}, outcome=Outcome.COMPLETE, reason="",
                            metrics={"tput_tok_s": 1.0}, requests=None, texts={})
    new = log(tracker, parent, "ccc333", 2.0)
    assert [r.info.run_id for r in tracker.trial_runs(parent)] == [new] and new != old


def test_the_study_run_carries_the_headline_as_its_description(tracker):
    parent = tracker.start_study("described", "name: described\n", resume=False)
    tracker.finish_study(parent, tags={"decision": "promote"}, metrics={}, texts={},
                         description="**Decision (PROMOTE):** serve 'x'")
    run = tracker.client().get_run(parent)
    assert run.data.tags[DESCRIPTION_TAG] == "**Decision (PROMOTE):** serve 'x'"
    assert run.data.tags["decision"] == "promote"
