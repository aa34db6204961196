"""Issue 63 item 6: the engine's own children die with the watchdog, however it ends. The kernel's death signal
(`PR_SET_PDEATHSIG`) takes the engine when Ray SIGKILLs the watchdog, but not what the engine started (SGLang's
detokenizer, a multiprocessing resource tracker): those were left running under init. Real processes: an engine that
starts a child which ignores SIGTERM, its pid printed where the test reads it."""

import os
import signal
import subprocess
import sys
import time

import psutil

from serve.engines.base import child_env

# The engine starts a SIGTERM-proof child (as SGLang's detokenizer outlives a SIGTERM-less end of its parent), prints
# the child's pid, and sleeps.
ENGINE = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
          "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); print(c.pid, flush=True); "
          "time.sleep(600)")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def gone_within(pids: list[int], deadline_s: float) -> list[int]:
    deadline = time.monotonic() + deadline_s
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)  # polling a condition under a deadline
        left = [p for p in left if alive(p)]
    return left


def start_watchdog() -> tuple[subprocess.Popen, int, int]:
    """The watchdog as an owner starts it (its own session); the engine's pid and its child's."""
    watchdog = subprocess.Popen([sys.executable, "-m", "serve.engines.watchdog", "--", sys.executable, "-c", ENGINE],
                                start_new_session=True, env=child_env(), stdout=subprocess.PIPE, text=True)
    assert watchdog.stdout is not None
    grandchild = int(watchdog.stdout.readline())
    engine = psutil.Process(grandchild).ppid()
    return watchdog, engine, grandchild


def group_members(group: int) -> list[int]:
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == group and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return out


def test_a_sigkilled_watchdog_takes_the_engines_children_too():
    watchdog, engine, grandchild = start_watchdog()
    try:
        assert alive(engine) and alive(grandchild)
        os.kill(watchdog.pid, signal.SIGKILL)  # as Ray kills a dying worker's children: no handler runs
        watchdog.wait(timeout=30)
        assert gone_within([engine, grandchild], 30.0) == []
        assert gone_within(group_members(watchdog.pid), 30.0) == []  # the reaper ended with the group
    finally:
        for pid in (engine, grandchild):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_an_engine_that_exits_by_itself_leaves_no_child_behind():
    # The engine ends on its own (a load that failed): the watchdog returns its code, and what it started goes too.
    exits = ENGINE.rsplit("; time.sleep(600)", 1)[0] + "; raise SystemExit(3)"
    watchdog = subprocess.Popen([sys.executable, "-m", "serve.engines.watchdog", "--", sys.executable, "-c", exits],
                                start_new_session=True, env=child_env(), stdout=subprocess.PIPE, text=True)
    assert watchdog.stdout is not None
    grandchild = int(watchdog.stdout.readline())
    try:
        assert watchdog.wait(timeout=60) == 3
        assert gone_within([grandchild], 30.0) == []
    finally:
        if alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
