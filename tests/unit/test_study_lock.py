"""Issue #63 items 3 and 4: one driver per output folder, and `--resume` only of a study that can go on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.errors import PipelineError
from pipeline.study.lock import LOCK_FILE, StudyLocked, acquire, holder_pid
from pipeline.study.resume import IDENTITY_FILE, PROMOTED_FILE, check_start, finished_evidence, start_problem

TRY_LOCK = ("import sys; from pathlib import Path; from pipeline.study.lock import acquire, StudyLocked\n"
            "try:\n    lock = acquire(Path(sys.argv[1]))\nexcept StudyLocked as exc:\n    print(exc); sys.exit(3)\n"
            "print(lock.note); lock.release()\n")


def try_lock(out: Path) -> subprocess.CompletedProcess[str]:
    """Another process (another driver) asks for the folder's lock."""
    return subprocess.run([sys.executable, "-c", TRY_LOCK, str(out)], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])


def test_a_second_process_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "study"
    with acquire(out) as lock:
        assert lock.note is None and holder_pid((out / LOCK_FILE).read_text()) == os.getpid()
        second = try_lock(out)
        assert second.returncode == 3, second.stderr
        line = second.stdout.strip()
        assert "\n" not in line and f"PID {os.getpid()}" in line and str(out) in line
    # released: the next driver gets it, with nothing to take over
    after = try_lock(out)
    assert after.returncode == 0 and after.stdout.strip() == "None", after.stderr


def test_a_lock_left_by_a_killed_driver_is_taken_over_and_said_so(tmp_path):
    out = tmp_path / "study"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=60).stdout.strip()
    (out / LOCK_FILE).write_text(f"{dead}\n")  # what a SIGKILLed driver leaves: its PID, the flock gone with it
    with acquire(out) as lock:
        assert lock.note is not None and f"PID {dead} ended without releasing" in lock.note
    assert (out / LOCK_FILE).read_text() == ""


def test_the_same_process_cannot_take_the_lock_twice(tmp_path):
    # flock is per open file: a second driver in one process (a library caller) is refused too
    with acquire(tmp_path / "s"):
        with pytest.raises(StudyLocked):
            acquire(tmp_path / "s")


def test_a_folder_the_lock_created_is_removed_when_nothing_else_was_written(tmp_path):
    with acquire(tmp_path / "new"):
        pass
    assert not (tmp_path / "new").exists()
    with acquire(tmp_path / "kept") as lock:
        (lock.path.parent / "study.yaml").write_text("name: x\n")
    assert (tmp_path / "kept" / "study.yaml").exists()


def finished_folder(tmp_path: Path, max_trials: int = 3) -> Path:
    out = tmp_path / "done"
    out.mkdir()
    (out / "study.yaml").write_text("name: done\n")
    (out / IDENTITY_FILE).write_text(json.dumps({"identity": {}, "max_trials": max_trials}))
    (out / PROMOTED_FILE).write_text(yaml.safe_dump({"provenance": {"decision": "promote", "source": "ngram-1"}}))
    return out


def test_resume_of_a_finished_study_is_refused_naming_what_was_found(tmp_path):
    out = finished_folder(tmp_path)
    with pytest.raises(PipelineError) as caught:
        check_start(out, True, "done", 3, None)
    message = str(caught.value)
    assert message.startswith("--resume refused") and "\n" not in message
    assert f"{out / PROMOTED_FILE} (decision promote, serving ngram-1)" in message and "3 trials" in message
    with pytest.raises(PipelineError, match="holds a finished study"):
        check_start(out, False, "done", 3, None)
    check_start(out, True, "done", 5, None)  # a larger budget searches more: allowed


def test_the_report_alone_marks_a_study_that_decided_without_promoting(tmp_path):
    out = tmp_path / "s"
    (out / "report").mkdir(parents=True)
    assert finished_evidence(out) is None
    (out / "report" / "report.html").write_text("<html>")
    assert "report.html" in (finished_evidence(out) or "")


def test_resume_of_a_missing_study_is_refused(tmp_path):
    with pytest.raises(PipelineError) as caught:
        check_start(tmp_path / "nothing", True, "nothing", 3, None)
    assert "nothing to resume" in str(caught.value) and "does not exist" in str(caught.value)
    assert not (tmp_path / "nothing").exists()
    empty_db = f"sqlite:///{tmp_path / 'absent.db'}"
    with pytest.raises(PipelineError, match="shared storage.url holds no study"):
        check_start(tmp_path / "nothing", True, "nothing", 3, empty_db)
    assert not (tmp_path / "absent.db").exists()


def test_a_study_in_the_shared_storage_resumes_from_a_new_folder(tmp_path):
    import optuna

    url = f"sqlite:///{tmp_path / 'shared.db'}"
    optuna.create_study(study_name="shared", storage=url)
    check_start(tmp_path / "driver2", True, "shared", 3, url)


def test_start_problem_allows_a_new_study_and_an_unfinished_resume(tmp_path):
    assert start_problem(tmp_path / "new", False, None, None, 3, None) is None
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "study.yaml").write_text("name: s\n")
    assert start_problem(tmp_path / "s", True, None, None, 3, None) is None
