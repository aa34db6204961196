"""Issue 59: a baseline whose engine's load failed in a way a retry would repeat (out of memory at load, a missing
file, an unsupported architecture) is recorded with its cause and not queued again, in the running study and on
`--resume`; any other failed start still is. The classification (`serve.engines.load_failures`) reads the reports
`EngineProcess.wait_ready` writes: the engine's exit and its log tail (a real CPU engine's in
tests/integration/test_engine_load_failures.py). The study's own searcher on a real Optuna SQLite study, driven the
way Tune drives it (tests/unit/test_baseline_requeue.py)."""

from __future__ import annotations

import optuna
import pytest

from pipeline.search.space import enqueue_baseline
from pipeline.search.space.define import LOAD_FAILURE_ATTR, OUTCOME_ATTR, baseline_retried
from serve.engines.load_failures import cause_in_reason, repeating_cause, with_cause
from tests.unit.test_baseline_requeue import SPACE, is_baseline, searcher_for, study_at


def exited(log: str, code: int = 1) -> str:
    """As `EngineProcess.wait_ready` reports an engine that exited before it was ready."""
    return (f"engine exited with code {code} before it was ready; command: sglang serve --model-path /m\n"
            f"--- engine log tail ---\n$ sglang serve --model-path /m\n{log}")


# SGLang 0.5.23's, torch's and transformers' own last lines for each cause.
LOGS = {
    "out of memory at load": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.75 GiB. GPU 3 has a "
                             "total capacity of 79.11 GiB of which 1.02 GiB is free.",
    "a missing file": "RuntimeError: Cannot find any model weights with `/models/deepseek-v3`",
    "an unsupported architecture": "ValueError: Model architectures ['FooForCausalLM'] are not supported for now.",
}


@pytest.mark.parametrize("cause", sorted(LOGS))
def test_each_cause_is_read_from_the_engines_own_last_words(cause):
    report = exited("[2026-01-01] Load weight begin.\n" + LOGS[cause] + "\n[2026-01-01] Received sigquit")
    assert repeating_cause(report) == cause
    assert cause_in_reason(with_cause(report, cause)) == cause


@pytest.mark.parametrize("report", [
    "engine not ready after 1800 s (start_timeout_s); --- engine log tail ---\nCUDA out of memory",  # a timeout
    "nvcc not found; CUDA_HOME is unset (SGLang's own parser accepted the flags: preflight ok)",  # a node check
    exited("TEST FAULT exit-at-start: exiting with code 3 before loading the model", 3),  # no cause named
    exited("Segmentation fault (core dumped)", 139),
])
def test_other_failed_starts_name_no_cause(report):
    assert repeating_cause(report) is None
    assert cause_in_reason(report) is None


def test_the_pure_rule():
    assert baseline_retried("LAUNCH_FAILED") is True
    assert baseline_retried("LAUNCH_FAILED", load_failure="out of memory at load") is False
    assert baseline_retried("TIMEOUT", load_failure=None) is True


def report(outcome: str, value: float, load_failure: str | None = None) -> dict:
    return {"outcome": outcome, "tput_tok_s": value, **({LOAD_FAILURE_ATTR: load_failure} if load_failure else {})}


def test_a_baseline_whose_load_failed_for_good_is_not_queued_again(tmp_path, capsys):
    searcher = searcher_for(tmp_path)
    assert is_baseline(searcher.suggest("t0"))
    searcher.on_trial_complete("t0", report("LAUNCH_FAILED", 0.0, "out of memory at load"))
    assert "not queued again" in capsys.readouterr().out
    nxt = searcher.suggest("t1")
    assert nxt is not None and not is_baseline(nxt)  # the search goes on; no second attempt of the baseline
    (baseline,) = [t for t in searcher._ot_study.get_trials() if t.user_attrs.get("baseline")]
    assert baseline.user_attrs[LOAD_FAILURE_ATTR] == "out of memory at load"  # recorded with its cause


def test_a_baseline_whose_start_failed_otherwise_is_still_queued_again(tmp_path):
    searcher = searcher_for(tmp_path)
    assert is_baseline(searcher.suggest("t0"))
    searcher.on_trial_complete("t0", report("LAUNCH_FAILED", 0.0))
    assert is_baseline(searcher.suggest("t1"))


def test_resume_does_not_queue_a_baseline_whose_load_failed_for_good(tmp_path):
    _, study = study_at(tmp_path)
    enqueue_baseline(study, SPACE)
    trial = study.ask()
    trial.set_user_attr(OUTCOME_ATTR, "LAUNCH_FAILED")
    trial.set_user_attr(LOAD_FAILURE_ATTR, "a missing file")
    study.tell(trial, 0.0)
    _, resumed = study_at(tmp_path)
    assert enqueue_baseline(resumed, SPACE) is False
    assert not resumed.get_trials(states=(optuna.trial.TrialState.WAITING,))
