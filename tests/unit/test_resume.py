"""Resume never mixes two studies and never waits forever on a trial no one runs (issue #15 item 13)."""

import optuna
import pytest
from optuna.trial import TrialState

from pipeline.config import SEARCH_SPACES_DIR, load_study
from pipeline.errors import PipelineError
from pipeline.vocabulary.outcome import MEASURING
from pipeline.study.resume import (
    SavedTrial, budget_note, check_resume, finished_trials, identity_changes, read_identity, recorded_reports,
    settle_running, study_identity, tune_unfinished, workload_digest, write_identity,
)
from pipeline.search.space import load_space

SPACE = load_space(SEARCH_SPACES_DIR / "default.yaml").model_dump(mode="json")
PROMPTS = [(0, "Write a haiku", 24), (1, "Fix this code", 24)]


def identity(**overrides):
    return study_identity(load_study(None, overrides), SPACE, workload_digest(PROMPTS, 0.0))


def test_the_same_study_has_the_same_identity():
    assert identity() == identity()
    # Budget and promotion policy may change on resume: they do not change what a measurement means.
    assert identity() == identity(**{"budget.max_trials": 20, "promotion.margin": 0.1})


@pytest.mark.parametrize("override, key", [
    ({"model.target": "gemma3-270m"}, "model"),
    ({"model.dtype": "bfloat16"}, "model"),
    ({"engine.kind": "sglang"}, "engine"),
    ({"engine.extra_flags": ["--mem-fraction-static", "0.8"]}, "engine"),
    ({"engine.weights": "fp32"}, "engine"),  # fp32 decode is half the gguf kernel's speed on the cpu engine
    ({"search_space": "ngram.yaml"}, "search space"),
    ({"workload.source": "code-edit"}, "workload"),
    ({"concurrency": [4]}, "concurrency"),
])
def test_each_change_that_alters_a_measurement_is_named(override, key):
    changes = identity_changes(identity(), identity(**override))
    assert [c.split(":")[0] for c in changes] == [key]


def test_a_changed_workload_or_space_content_changes_the_digest():
    other_prompts = study_identity(load_study(None), SPACE, workload_digest(PROMPTS[:1], 0.0))
    assert [c.split(":")[0] for c in identity_changes(identity(), other_prompts)] == ["workload"]
    greedy_vs_sampled = study_identity(load_study(None), SPACE, workload_digest(PROMPTS, 0.7))
    assert identity_changes(identity(), greedy_vs_sampled)
    other_space = study_identity(load_study(None), {**SPACE, "algorithms": ["none"]}, workload_digest(PROMPTS, 0.0))
    assert [c.split(":")[0] for c in identity_changes(identity(), other_space)] == ["search space"]


def test_resume_of_a_changed_study_is_refused_naming_old_and_new(tmp_path):
    write_identity(tmp_path, identity(), max_trials=8)
    recorded = read_identity(tmp_path)
    check_resume(recorded, identity(), tmp_path)  # unchanged: accepted
    with pytest.raises(PipelineError) as err:
        check_resume(recorded, identity(**{"model.target": "gemma3-270m"}), tmp_path)
    message = str(err.value)
    assert "--resume refused" in message and "smollm2-135m" in message and "gemma3-270m" in message
    assert "another --name or --output" in message


def test_a_study_from_before_identity_files_resumes():
    check_resume(None, identity(), "somewhere")


def test_a_changed_budget_is_reported_and_an_unchanged_one_is_not():
    assert budget_note({"max_trials": 8}, 8) is None
    assert budget_note({"max_trials": 8}, 12) == ("budget changed on resume: 8 -> 12 trials (trials already "
                                                  "finished count towards it)")
    assert budget_note(None, 12) is None


def test_running_trials_are_settled_as_failed_and_counted():
    study = optuna.create_study()
    done = study.ask()
    study.tell(done, 1.0)
    orphan = study.ask()  # handed out, never reported: what a dead driver or a pre-checkpoint ask leaves
    assert settle_running(study) == [orphan.number]
    assert study.trials[orphan.number].state is TrialState.FAIL
    assert finished_trials(study) == 2
    assert settle_running(study) == []  # idempotent


# Tune's checkpoint after Ctrl-C right after the baseline reported: the baseline RUNNING with its final report.
REPORT = {"outcome": "COMPLETE", "mlflow_run_id": "abc", "tput_tok_s": 10.4, "accept_len": 1.0}
INTERRUPTED = [SavedTrial("t0", "TERMINATED", {**REPORT, "tput_tok_s": 9.0}), SavedTrial("t1", "RUNNING", REPORT),
               SavedTrial("t2", "RUNNING", {"outcome": MEASURING, "tput_tok_s": 3.0}), SavedTrial("t3", "PENDING", {}),
               SavedTrial("t4", "ERROR", {})]


def test_an_interrupt_is_read_from_the_checkpoint_statuses():
    assert tune_unfinished(INTERRUPTED) == ["t1", "t2", "t3"]
    assert tune_unfinished([t for t in INTERRUPTED if t.status in ("TERMINATED", "ERROR")]) == []


def test_only_an_unfinished_trials_final_report_is_replayed():
    # t1 reported its result before Optuna was told: it counts; t2 was still measuring and t3 never reported: both
    # run again; t0 is finished (Optuna already has it)
    assert recorded_reports(INTERRUPTED) == {"t1": REPORT}
    replay = recorded_reports(INTERRUPTED)["t1"]
    replay["tput_tok_s"] = 0.0
    assert INTERRUPTED[1].report["tput_tok_s"] == 10.4  # a copy: the saved record is not changed
