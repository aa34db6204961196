"""`log_trial` replaces a trial's record only once the new one exists (issue #15 item 13). Real MLflow on SQLite."""

import pytest

from pipeline.records.tracking import Tracker
from pipeline.vocabulary.outcome import Outcome


def log(tracker, parent, texts, reason=""):
    return tracker.log_trial(parent, study_name="s", run_name="trial-1", kind="trial",
                             config={"spec": {"algorithm": "none"}}, outcome=Outcome.COMPLETE, reason=reason,
                             metrics={"tput_tok_s": 1.0}, requests=None, texts=texts)


@pytest.fixture(scope="module")
def tracker(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mlflow")
    return Tracker(f"sqlite:///{folder / 'mlflow.db'}", "s", artifact_dir=folder / "artifacts")


def active_trial_runs(tracker, parent):
    return [r for r in tracker.trial_runs(parent) if r.info.run_name == "trial-1"]


def test_a_crash_while_logging_the_new_record_keeps_the_old_one(tracker):
    parent = tracker.start_study("s", "name: s\n", resume=False)
    first = log(tracker, parent, {"engine.log": "first"}, reason="first")
    # An artifact path that cannot be written (absolute, under /proc) fails the upload half-way, as a crash would.
    with pytest.raises(OSError):
        log(tracker, parent, {"/proc/specdec-cannot-write/engine.log": "second"})
    ids = [r.info.run_id for r in active_trial_runs(tracker, parent)]
    assert first in ids  # the old record survived; the half-written one may sit beside it


def test_a_completed_new_record_replaces_the_old_one(tracker):
    parent = tracker.start_study("s2", "name: s2\n", resume=False)
    log(tracker, parent, {"engine.log": "first"})
    second = log(tracker, parent, {"engine.log": "second"})
    assert [r.info.run_id for r in active_trial_runs(tracker, parent)] == [second]


def test_warm_up_opens_the_store_and_never_raises(tmp_path):
    good = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "warm", artifact_dir=tmp_path / "artifacts")
    good.warm_up()
    assert good._experiment_id is not None  # the experiment exists now: the trial's first MLflow call finds it
    (tmp_path / "a-file").write_text("")
    bad = Tracker(f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}", "warm")
    bad.warm_up()  # the store's folder is a file: it cannot open, and the warm-up leaves that to the real call
    assert bad._experiment_id is None
    with pytest.raises(Exception):
        bad.experiment_id()


def test_mlflow_use_waits_for_a_warm_up_still_under_way(tmp_path, monkeypatch):
    """While a warm-up thread is under way (in a fresh Tune worker: importing MLflow), every MLflow use of the
    tracker waits for it: two concurrent first imports of MLflow break its protobuf registry ("Depends on file
    'databricks.proto', but it has not been loaded", seen in a study). The stand-in warm-up finishes only when a
    timer lets it, so a use that did not wait would see it unfinished."""
    import threading

    import pipeline.records.tracking as record

    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "s", artifact_dir=tmp_path)
    tracker.warm_up()  # the store exists and is open: a use that does not wait returns at once
    finished = threading.Event()
    go = threading.Timer(0.5, finished.set)
    warm_up = threading.Thread(target=finished.wait)
    monkeypatch.setattr(record, "_WARM_UP", warm_up)
    warm_up.start()
    go.start()
    tracker.client()
    assert finished.is_set() and not warm_up.is_alive()
