"""The loop's guards (pipeline/loop/state.py): one loop per state folder, a state file that survives a crash, and
operator commands that are neither lost nor applied twice; and the `--canary` command line that queues them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.loop.cycle import Loop, LoopSettings
from pipeline.loop.state import (LoopLock, LoopState, load_state, pending_commands, save_state, scan_commands,
                                 send_command)
from pipeline.promote import main as promote_main

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_loop_on_the_same_folder_is_refused_naming_the_holder(tmp_path):
    with LoopLock(tmp_path):
        with pytest.raises(PipelineError, match=rf"pid {os.getpid()} holds .*loop.lock"):
            with LoopLock(tmp_path):
                pass
    with LoopLock(tmp_path):  # released on exit
        pass


def test_a_killed_loop_leaves_no_stale_lock(tmp_path):
    # The kernel drops an flock with its process: a loop killed with SIGKILL does not block the next one.
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from pathlib import Path
        from pipeline.loop.state import LoopLock
        lock = LoopLock(Path({str(tmp_path)!r})).__enter__()
        print("held", flush=True)
        os.kill(os.getpid(), 9)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "held" and done.returncode == -9
    with LoopLock(tmp_path):
        pass


def test_the_state_round_trips_and_a_damaged_file_is_named_not_reset(tmp_path):
    assert load_state(tmp_path) == LoopState()
    state = LoopState(phase="canary", cycle=3, cycle_run_id="r3", candidate_version="7", step=1, live_after=1234)
    save_state(tmp_path, state)
    assert load_state(tmp_path) == state
    (tmp_path / "state.json").write_text('{"phase": "canar')
    with pytest.raises(PipelineError, match="state.json is not a loop state file.*move it away"):
        load_state(tmp_path)


def test_commands_queue_in_order_until_the_loop_applies_them(tmp_path):
    for command in ("pause", "resume", "abort"):
        send_command(tmp_path, command)
    queued = pending_commands(tmp_path)
    assert [c.command for _, c in queued] == ["pause", "resume", "abort"]
    queued[0][0].unlink()  # the loop deletes what it applied
    assert [c.command for _, c in pending_commands(tmp_path)] == ["resume", "abort"]


def test_promote_canary_queues_the_command_and_status_shows_it(tmp_path, capsys):
    save_state(tmp_path, LoopState(phase="canary", cycle=2, cycle_run_id="r2", candidate_version="5",
                                   production_version="4", trigger="drift"))
    assert promote_main(["--canary", "pause", "--state-dir", str(tmp_path)]) == 0
    assert promote_main(["--canary", "status", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pause: queued" in out
    assert "phase canary, cycle 2" in out and "candidate 5" in out and "queued commands: ['pause']" in out
    assert promote_main(["--canary", "abort", "--state-dir", str(tmp_path / "nowhere")]) == 2
    assert "no loop state in" in capsys.readouterr().err


@pytest.mark.parametrize("edit, field", [
    ({"phase": "promote", "candidate_version": None}, "candidate_version"),  # issue 42 item 14, as observed
    ({"phase": "canary", "candidate_version": "latest"}, "candidate_version"),
    ({"phase": "retune", "cycle_run_id": None}, "cycle_run_id"),
    ({"phase": "rollback", "cycle": 0}, "cycle"),
])
def test_a_hand_edited_state_whose_phase_lacks_its_fields_is_named_at_load(tmp_path, edit, field):
    # Valid JSON and valid fields, but the phase cannot be carried out: the loop crashed in MLflow on every restart.
    good = LoopState(phase="canary", cycle=2, cycle_run_id="r2", candidate_version="5", production_version="4")
    (tmp_path / "state.json").write_text(good.model_copy(update=edit).model_dump_json())
    with pytest.raises(PipelineError, match=rf"state.json is not a loop state file \(.*phase '{edit['phase']}' "
                                            rf"needs {field}.*move it away"):
        load_state(tmp_path)


def test_fifos_and_folders_named_like_commands_are_skipped_without_blocking(tmp_path):
    # issue 42 item 11: a FIFO named control/*.json hung the loop and `--canary status` (its open waits for a writer)
    send_command(tmp_path, "pause")
    control = tmp_path / "control"
    os.mkfifo(control / "00000000000000000001-fifo.json")
    (control / "00000000000000000002-folder.json").mkdir()
    (control / "00000000000000000003-junk.json").write_text("{not json")
    commands, unreadable = scan_commands(tmp_path)  # returns at once: nothing blocks
    assert [c.command for _, c in commands] == ["pause"]
    assert sorted(p.name.split("-")[1] for p, _ in unreadable) == ["fifo.json", "folder.json", "junk.json"]
    assert "not a regular file" in dict((p.name, why) for p, why in unreadable)["00000000000000000001-fifo.json"]


def test_a_loop_moves_unreadable_commands_aside_once_and_applies_the_rest(tmp_path):
    # issue 42 item 12: unreadable command files were skipped silently, and kept (and skipped) forever
    save_state(tmp_path, LoopState())
    control = tmp_path / "control"
    send_command(tmp_path, "pause")
    os.mkfifo(control / "00000000000000000001-fifo.json")
    (control / "00000000000000000003-junk.json").write_text("{not json")
    loop = Loop(LoopSettings(registered_model="m", state_dir=str(tmp_path)), None, None, None)  # type: ignore[arg-type]
    said: list[str] = []
    loop.log = said.append
    state, action = loop._commands(LoopState())
    assert state.paused and action is None
    assert sorted(p.name for p in control.iterdir()) == ["unreadable"]  # the command applied, the others aside
    assert sorted(p.name for p in (control / "unreadable").iterdir()) == ["00000000000000000001-fifo.json",
                                                                          "00000000000000000003-junk.json"]
    assert sum("is not a command" in line for line in said) == 2
    loop._commands(state)
    assert sum("is not a command" in line for line in said) == 2  # said once, not at every poll
    assert promote_main(["--canary", "status", "--state-dir", str(tmp_path)]) == 0


def test_a_state_file_that_is_a_fifo_is_an_error_not_a_hang(tmp_path):
    os.mkfifo(tmp_path / "state.json")
    with pytest.raises(PipelineError, match="state.json is not a loop state file.*not a regular file"):
        load_state(tmp_path)


def test_a_canary_step_the_settings_do_not_have_is_named_before_the_loop_acts(tmp_path):
    loop = Loop(LoopSettings(registered_model="m", state_dir=str(tmp_path)), None, None, None)  # type: ignore[arg-type]
    state = LoopState(phase="canary", cycle=1, cycle_run_id="r1", candidate_version="2", step=5)
    with pytest.raises(PipelineError, match="canary step 6 of a canary whose settings have 3 steps"):
        loop.check_resumable(state)
    loop.check_resumable(state.model_copy(update={"step": 2}))
