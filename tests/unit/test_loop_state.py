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
from pipeline.loop.state import LoopLock, LoopState, load_state, pending_commands, save_state, send_command
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
    state = LoopState(phase="canary", cycle=3, candidate_version="7", step=1, live_after=1234)
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
    save_state(tmp_path, LoopState(phase="canary", cycle=2, candidate_version="5", production_version="4",
                                   trigger="drift"))
    assert promote_main(["--canary", "pause", "--state-dir", str(tmp_path)]) == 0
    assert promote_main(["--canary", "status", "--state-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "pause: queued" in out
    assert "phase canary, cycle 2" in out and "candidate 5" in out and "queued commands: ['pause']" in out
    assert promote_main(["--canary", "abort", "--state-dir", str(tmp_path / "nowhere")]) == 2
    assert "no loop state in" in capsys.readouterr().err
