"""Records a study could not write (pipeline/records/gaps.py): the cause in the OS's own words from a real refused
write (/dev/full answers every write with ENOSPC, as a full disk does), the exit code, the closing block, and the study
run's end on a real MLflow store whose artifact folder refuses writes: what can land lands, the rest is named."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from urllib.parse import urlparse

import pytest

from pipeline.records.gaps import (GAPS, INCOMPLETE_EXIT, Gap, Gaps, cause_line, conclude, exit_code,
                                   incomplete_block)
from pipeline.records.tracking import Tracker
from pipeline.vocabulary.outcome import Outcome

FULL = "/dev/full"
needs_full = pytest.mark.skipif(not os.path.exists(FULL), reason="/dev/full (Linux) answers writes with ENOSPC")


def disk_full_error() -> OSError:
    """What a write to a full disk raises, from the kernel itself."""
    fd = os.open(FULL, os.O_WRONLY)
    try:
        os.write(fd, b"x")
    except OSError as exc:
        return exc
    finally:
        os.close(fd)
    raise AssertionError(f"a write to {FULL} succeeded")


@needs_full
def test_the_cause_is_the_os_line_also_when_a_library_wraps_it():
    error = disk_full_error()
    assert cause_line(error) == "No space left on device"
    try:
        try:
            raise error
        except OSError as inner:
            raise RuntimeError("upload failed\nwith a long second line") from inner
    except RuntimeError as wrapped:
        assert cause_line(wrapped) == "No space left on device"


def test_a_message_is_its_first_line_only():
    error = RuntimeError("the store refused\n[SQL: INSERT INTO metrics ...]")
    assert cause_line(error) == "RuntimeError: the store refused"


def test_a_store_error_is_the_database_s_own_line():
    import sqlite3

    import sqlalchemy.exc

    store = sqlalchemy.exc.OperationalError("UPDATE runs SET status=?", ("FINISHED",),
                                            sqlite3.OperationalError("database or disk is full"))
    try:
        try:
            raise store
        except sqlalchemy.exc.OperationalError as inner:
            raise RuntimeError(f"(raised as a result of Query-invoked autoflush)\n{inner}") from inner
    except RuntimeError as wrapped:
        assert cause_line(wrapped) == "RuntimeError: (sqlite3.OperationalError) database or disk is full"


def test_only_a_study_that_would_exit_0_turns_to_3():
    gap = (Gap("the study report", "No space left on device"),)
    assert exit_code(0, gap) == INCOMPLETE_EXIT == 3
    assert exit_code(0, ()) == 0
    assert exit_code(1, gap) == 1 and exit_code(130, gap) == 130  # a failure or an interrupt says more


@needs_full
def test_keeping_records_the_failure_and_goes_on(capsys):
    gaps = Gaps()
    with gaps.keeping("the study report"):
        raise disk_full_error()
    with gaps.keeping("the study run's metric engine_launches"):
        pass  # written: nothing kept
    assert gaps.items() == (Gap("the study report", "No space left on device"),)
    out = capsys.readouterr().out
    assert "the study report could not be written: No space left on device" in out and "Traceback" not in out
    assert gaps.drain() and gaps.items() == ()


def test_the_block_names_each_missing_record_and_what_is_intact():
    block = incomplete_block([Gap("the study report (r/report.html)", "No space left on device"),
                              Gap("the study run's metrics (bar)", "RuntimeError: database or disk is full")],
                             ["2 measured trial and finalist run(s) in MLflow", "registered m version 1"], 3)
    assert "INCOMPLETE: 2 record(s)" in block
    assert "  - the study report (r/report.html): No space left on device" in block
    assert "intact" in block and "  - registered m version 1" in block and "exit code 3" in block


def test_finish_study_lands_what_it_can_and_names_what_it_cannot(tmp_path, capsys):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "gaps", artifact_dir=tmp_path / "artifacts")
    parent = tracker.start_study("gaps", "name: gaps\n", resume=False)
    trial = tracker.log_trial(parent, study_name="gaps", run_name="baseline", kind="trial", trial_id="t0",
                              config={"spec": {"algorithm": "none"}}, outcome=Outcome.COMPLETE, reason="",
                              metrics={"tput_tok_s": 10.0}, requests=None, texts={})
    # the study run's artifact folder becomes a file: the OS refuses every artifact the run would still write
    artifacts = Path(urlparse(tracker.client().get_run(parent).info.artifact_uri).path)
    assert artifacts.is_relative_to(tmp_path)
    shutil.rmtree(artifacts)
    artifacts.write_text("not a folder")
    GAPS.clear()
    tracker.finish_study(parent, tags={"decision": "keep_baseline"}, metrics={"bar": 1.0},
                         texts={"decision.txt": "keep"}, description="**Decision**")
    run = tracker.client().get_run(parent)
    assert run.data.tags["decision"] == "keep_baseline" and run.data.metrics["bar"] == 1.0
    assert run.info.status == "FINISHED"
    (gap,) = GAPS.items()
    assert gap.what == "the study run's artifact decision.txt" and gap.cause
    code = conclude(0, tmp_path, tracker, parent)
    assert code == 3 and GAPS.items() == ()
    out = capsys.readouterr().out
    assert "the study run's artifact decision.txt: " in out and "1 measured trial and finalist run(s)" in out
    assert [r.info.run_id for r in tracker.trial_runs(parent)] == [trial]
