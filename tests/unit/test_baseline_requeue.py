"""Issue 40 item 4 and the "Also" paragraph: a baseline that did not complete (a cold node's first launch timing out)
is queued again, in the running study and on `--resume`; and the baseline runs alone. The study's own searcher
(`constrained_search_class`, Ray Tune's OptunaSearch) on a real Optuna SQLite study, driven the way Tune drives it
(suggest, then the trial's final report); no Ray runtime is needed for the searcher itself. The same through a
real study with the CPU engine: tests/end_to_end/test_baseline_requeue.py."""

from __future__ import annotations

import optuna
import pytest

from pipeline.search.space import SearchSpace, define_by_run, enqueue_baseline
from pipeline.search.space.define import BASELINE_ATTEMPTS, BASELINE_ATTR, OUTCOME_ATTR
from pipeline.search.space.sampler import constrained_search_class, tpe_sampler

SPACE = SearchSpace.model_validate({
    "name": "s", "algorithms": ["none", "ngram"],
    "branches": {"ngram": {"num_draft_tokens": {"type": "int", "low": 2, "high": 8}}}})


def study_at(tmp_path, name="s"):
    storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'optuna.db'}")
    return storage, optuna.create_study(study_name=name, storage=storage, direction="maximize",
                                        load_if_exists=True)


def searcher_for(tmp_path):
    """As the driver builds it: the baseline enqueued in the study, then the searcher on the same storage."""
    storage, study = study_at(tmp_path)
    enqueue_baseline(study, SPACE)
    return constrained_search_class()(define_by_run(SPACE), metric="tput_tok_s", mode="max",
                                      sampler=tpe_sampler(0, 8), storage=storage, study_name="s", seed=0)


def report(outcome: str, value: float) -> dict:
    return {"outcome": outcome, "tput_tok_s": value}


def is_baseline(config) -> bool:
    return config == {"algorithm": "none"}


def test_a_baseline_that_timed_out_is_queued_again_and_runs_alone(tmp_path):
    searcher = searcher_for(tmp_path)
    first = searcher.suggest("t0")
    assert is_baseline(first)
    assert searcher.suggest("t1") is None  # nothing starts beside the baseline
    searcher.on_trial_complete("t0", report("TIMEOUT", 0.0))  # TIMEOUT reports the worst value: Optuna COMPLETE
    again = searcher.suggest("t1")
    assert is_baseline(again)  # queued again, asked next
    assert searcher.suggest("t2") is None
    searcher.on_trial_complete("t1", report("COMPLETE", 100.0))
    trial = searcher.suggest("t2")
    assert trial is not None and trial["algorithm"] == "ngram"
    baselines = [t for t in searcher._ot_study.get_trials() if t.user_attrs.get(BASELINE_ATTR)]
    assert [t.user_attrs.get(OUTCOME_ATTR) for t in baselines] == ["TIMEOUT", "COMPLETE"]


def test_a_queued_baseline_waits_for_running_trials_to_end(tmp_path):
    searcher = searcher_for(tmp_path)
    assert is_baseline(searcher.suggest("t0"))
    searcher.on_trial_complete("t0", report("COMPLETE", 100.0))
    assert searcher.suggest("t1")["algorithm"] == "ngram"
    enqueue_baseline(searcher._ot_study, SPACE)  # nothing to queue: the baseline completed
    assert searcher.suggest("t2")["algorithm"] == "ngram"  # trials run side by side as before
    # A baseline queued while trials run (a resumed study's) starts only once they ended.
    searcher._ot_study.enqueue_trial({"algorithm": "none"}, user_attrs={BASELINE_ATTR: True})
    assert searcher.suggest("t3") is None
    searcher.on_trial_complete("t1", report("COMPLETE", 110.0))
    assert searcher.suggest("t3") is None
    searcher.on_trial_complete("t2", report("COMPLETE", 120.0))
    assert is_baseline(searcher.suggest("t3"))


@pytest.mark.parametrize("outcome, queued", [("TIMEOUT", True), ("LAUNCH_FAILED", True), ("UNHEALTHY", True),
                                             ("COMPLETE", False), ("INVALID", False)])
def test_resume_queues_a_baseline_that_did_not_complete(tmp_path, outcome, queued):
    # A driver ran the baseline and stopped (its budget spent, or interrupted); the next one resumes the study.
    _, study = study_at(tmp_path)
    enqueue_baseline(study, SPACE)
    trial = study.ask()
    trial.set_user_attr(OUTCOME_ATTR, outcome)
    study.tell(trial, 0.0 if outcome != "COMPLETE" else 100.0)
    _, resumed = study_at(tmp_path)
    assert enqueue_baseline(resumed, SPACE) is queued
    waiting = resumed.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert [t.user_attrs.get(BASELINE_ATTR) for t in waiting] == ([True] if queued else [])


def test_a_baseline_that_keeps_failing_is_not_queued_forever(tmp_path):
    _, study = study_at(tmp_path)
    for _ in range(BASELINE_ATTEMPTS):
        assert enqueue_baseline(study, SPACE)
        trial = study.ask()
        trial.set_user_attr(OUTCOME_ATTR, "LAUNCH_FAILED")
        study.tell(trial, 0.0)
    assert enqueue_baseline(study, SPACE) is False  # the study ends with "no baseline" and its reason
