"""What a study prints while it runs: the per-trial line (the baseline with its own figure), slow phases only, the
finalists' re-runs one line each; and the CLI's library settings that keep third-party banners off."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.records.console import (EVERY_S, PHASES_FILE, SLOW_S, PhaseState, PhaseWatcher, ProgressBoard,
                                      duration, note_phase, phase_echo)
from pipeline.vocabulary.outcome import Outcome


def test_the_baseline_line_shows_its_own_figure_and_the_others_their_ratio_and_the_best() -> None:
    board = ProgressBoard(total=4, metric="tput_tok_s")
    lines = [board.line(label="none", algorithm="none", outcome=Outcome.COMPLETE, value=10.0, seconds=41.0),
             board.line(label="ngram BFS d4 b2 depth18 warm1", algorithm="ngram", outcome=Outcome.COMPLETE, value=12.5),
             board.line(label="ngram BFS d2 b1 depth18 warm1", algorithm="ngram", outcome=Outcome.COMPLETE, value=11.0),
             board.line(label="ngram BFS d2 b3 depth18 warm1", algorithm="ngram", outcome=Outcome.INVALID, value=0.0,
                        reason="ngram: min_bfs_breadth <= max_bfs_breadth must hold")]
    assert lines[0].startswith("[trial 1/4] none ") and lines[0].endswith("10.00 tok/s  (the baseline)  (41 s)")
    assert "best=" not in lines[0] and "(-)" not in lines[0]
    assert lines[1].endswith("12.50 tok/s  1.25x baseline  (best so far)")
    assert lines[2].endswith("11.00 tok/s  1.10x baseline  (best: 1.25x, ngram BFS d4 b2 depth18 warm1)")
    assert lines[3].startswith("[trial 4/4] ngram BFS d2 b3 depth18 warm1")
    assert "INVALID" in lines[3] and lines[3].endswith("- tok/s  -- ngram: min_bfs_breadth <= max_bfs_breadth "
                                                      "must hold")


def test_a_minimised_objective_keeps_the_lowest_as_best() -> None:
    board = ProgressBoard(total=3, metric="ttft_p50_ms", mode="min")
    board.line(label="none", algorithm="none", outcome=Outcome.COMPLETE, value=100.0)
    board.line(label="a", algorithm="ngram", outcome=Outcome.COMPLETE, value=80.0)
    assert board.line(label="b", algorithm="ngram", outcome=Outcome.COMPLETE, value=90.0).endswith("(best: 0.80x, a)")


def events(*items: tuple[str, float], **figures) -> list[dict]:
    return [{"phase": phase, "t": t, **figures} for phase, t in items]


def test_a_quick_start_prints_nothing_and_a_slow_one_a_line_then_one_a_minute() -> None:
    quick = PhaseState(who="t1")
    for event in events(("engine", 0.0), ("ready", 2.5), ("warmup", 2.5), ("measure", 4.0)):
        quick.update(event)
    assert quick.due(5.0) == []
    slow = PhaseState(who="t2")
    slow.update({"phase": "engine", "t": 100.0, "config": "ngram BFS d4 b2 depth18 warm1"})
    assert slow.due(100.0 + SLOW_S - 1) == []
    assert slow.due(100.0 + SLOW_S) == [f"ngram BFS d4 b2 depth18 warm1: starting the engine ({duration(SLOW_S)} "
                                        "so far)"]
    assert slow.due(100.0 + SLOW_S + 1) == []  # no repeat until EVERY_S has passed
    assert slow.due(100.0 + SLOW_S + EVERY_S) == [
        f"ngram BFS d4 b2 depth18 warm1: starting the engine ({duration(SLOW_S + EVERY_S)} so far)"]
    slow.update({"phase": "ready", "t": 195.0, "phases": {"preflight": 3.0, "loading": 90.0}})
    assert slow.due(195.0) == ["ngram BFS d4 b2 depth18 warm1: engine ready after 1 min 35 s"]
    # where the start spent its time is for the log file, not the console
    assert slow.details == ["ngram BFS d4 b2 depth18 warm1: engine start (preflight 3 s, loading 1 min 30 s)"]


def test_the_watcher_reads_phase_files_as_they_grow_and_leaves_a_half_written_line(tmp_path: Path) -> None:
    note_phase(tmp_path / "abc123", "engine", config="none")
    path = tmp_path / "abc123" / PHASES_FILE
    start = json.loads(path.read_text().splitlines()[0])["t"]
    watcher = PhaseWatcher(tmp_path)
    assert watcher.poll(start + 1) == []
    with open(path, "a") as handle:
        handle.write('{"phase": "ready", "t": ')  # the trial is still writing this line
    assert watcher.poll(start + SLOW_S + 1) == [f"none: starting the engine ({duration(SLOW_S + 1)} so far)"]
    with open(path, "a") as handle:
        handle.write(f'{start + SLOW_S + 2}}}\n')
    assert watcher.poll(start + SLOW_S + 3) == [f"none: engine ready after {duration(SLOW_S + 2)}"]


def test_phase_echo_prints_one_line_per_measured_re_run_and_not_the_old_ones(tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture[str]) -> None:
    # a resumed study's earlier run: not echoed
    note_phase(tmp_path / "final-baseline-run0", "measured", outcome=Outcome.COMPLETE, tput_tok_s=9.0)
    with phase_echo(tmp_path, interval_s=3600):  # lines come from the final poll, not the timer
        note_phase(tmp_path / "final-baseline-run1", "engine", config="none")
        note_phase(tmp_path / "final-baseline-run1", "measured", outcome=Outcome.COMPLETE, tput_tok_s=10.25,
                   timings={"engine_start_s": 2.6, "warmup_s": 0.8, "measure_s": 3.1})
    out = capsys.readouterr().out.splitlines()
    assert out == ["    final-baseline-run1: 10.25 tok/s, COMPLETE (engine start 3 s, warm-up 1 s, measure 3 s)"]


@pytest.mark.parametrize("window", ["re-measured", "disturbed"])
def test_a_re_run_line_names_a_window_that_was_not_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        window: str) -> None:
    with phase_echo(tmp_path, interval_s=3600):
        note_phase(tmp_path / "final-baseline-run0", "measured", outcome=Outcome.COMPLETE, tput_tok_s=10.25,
                   timings={"measure_s": 3.1}, window=window)
        note_phase(tmp_path / "final-baseline-run1", "measured", outcome=Outcome.COMPLETE, tput_tok_s=10.5,
                   timings={"measure_s": 3.0}, window="clean")
    assert capsys.readouterr().out.splitlines() == [
        f"    final-baseline-run0: 10.25 tok/s, COMPLETE, window {window} (measure 3 s)",
        "    final-baseline-run1: 10.50 tok/s, COMPLETE (measure 3 s)"]


def test_note_phase_never_raises(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    note_phase(tmp_path / "file" / "inside-a-file", "engine")  # cannot be written: ignored


def test_the_cli_turns_third_party_banners_off_at_their_source(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.config import load_study
    from pipeline.tune import quiet_libraries

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AIR_NEW_OUTPUT", "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS",
                                                             "RAY_AUTH_MODE")}
    monkeypatch.setattr(os, "environ", env)
    quiet_libraries(load_study(None, {"ray.address": "ray://head:10001"}))
    assert env["RAY_AIR_NEW_OUTPUT"] == "0" and env["TUNE_DISABLE_AUTO_CALLBACK_LOGGERS"] == "1"
    assert "RAY_AUTH_MODE" not in env  # joining a cluster: the user's mode, whatever it is
    quiet_libraries(load_study(None, {}))
    assert env["RAY_AUTH_MODE"] == "token"  # a new local Ray: Ray's default mode, set, so Ray does not warn
    env["RAY_AUTH_MODE"] = "disabled"
    quiet_libraries(load_study(None, {}))
    assert env["RAY_AUTH_MODE"] == "disabled"  # a choice of the user's is kept
