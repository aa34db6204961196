"""The engine watchdog (serve/engines/watchdog.py) with real processes: when the engine's owner dies without running
teardown (as when Ray SIGKILLs a replica), the engine and its children die too; a normal teardown still works."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from serve.engines.base import child_env

# The owner starts the watchdog as the replica does (new session), prints the engine's pid, then waits forever.
OWNER = """
import subprocess, sys, time
p = subprocess.Popen([sys.executable, "-m", "serve.engines.watchdog", "--", sys.executable, "-c",
                      "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"],
                     start_new_session=True)
print(p.pid, flush=True)
time.sleep(600)
"""


def wait_gone(pids, deadline_s=30.0):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def group_of(watchdog_pid, deadline_s=30.0):
    """The watchdog, the engine and the engine's child, once all three exist."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        procs = [psutil.Process(watchdog_pid)] + psutil.Process(watchdog_pid).children(recursive=True)
        if len(procs) >= 3:
            return [p.pid for p in procs]
        time.sleep(0.1)
    raise AssertionError("the engine and its child did not start")


def test_engine_group_dies_with_its_owner():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, env=child_env())
    assert owner.stdout is not None
    try:
        watchdog = int(owner.stdout.readline())
        pids = group_of(watchdog)
        owner.kill()  # SIGKILL: no teardown runs, as when Ray kills a replica's worker
        owner.wait()
        assert wait_gone(pids) == []
    finally:
        owner.kill()


def test_sigterm_to_the_group_stops_engine_and_watchdog():
    watchdog = subprocess.Popen([sys.executable, "-m", "serve.engines.watchdog", "--", sys.executable, "-c",
                                 "import time; time.sleep(600)"], start_new_session=True, env=child_env())
    pids = [watchdog.pid]
    deadline = time.monotonic() + 30
    while len(pids) < 2 and time.monotonic() < deadline:
        pids = [watchdog.pid] + [c.pid for c in psutil.Process(watchdog.pid).children()]
        time.sleep(0.1)
    os.killpg(watchdog.pid, signal.SIGTERM)
    watchdog.wait(timeout=30)
    assert wait_gone(pids) == []


def test_the_engines_exit_code_is_passed_on():
    done = subprocess.run([sys.executable, "-m", "serve.engines.watchdog", "--", sys.executable, "-c",
                           "raise SystemExit(3)"], env=child_env(), timeout=60)
    assert done.returncode == 3


# The engine exits on SIGTERM; its child ignores SIGTERM, so only the wrapper's final SIGKILL to the group ends it.
STUBBORN = ("import signal, subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); time.sleep(600)")


def test_sigterm_to_the_wrapper_alone_ends_a_child_that_ignores_it_without_a_traceback():
    # SIGTERM handled in the wrapper's signal handler stops the group from a thread: signal.signal raised there, so
    # the group's SIGKILL never came and a SIGTERM-proof child survived.
    watchdog = subprocess.Popen([sys.executable, "-m", "serve.engines.watchdog", "--", sys.executable, "-c", STUBBORN],
                                start_new_session=True, env=child_env(), stderr=subprocess.PIPE, text=True)
    try:
        pids = group_of(watchdog.pid)
        os.kill(watchdog.pid, signal.SIGTERM)
        _, stderr = watchdog.communicate(timeout=60)  # EOF only once every holder of the pipe is gone
        assert wait_gone(pids) == [] and "Traceback" not in stderr, stderr
    finally:
        try:
            os.killpg(watchdog.pid, signal.SIGKILL)  # the group this test started, if anything of it is left
        except ProcessLookupError:
            pass


def test_stop_group_without_grace_kills_a_group_that_ignores_sigterm():
    """A replica stops an engine that holds no GPU this way between trials: no SIGTERM round, the group is gone."""
    from serve.replica.deployment import stop_group

    stubborn = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); time.sleep(600)")
    leader = subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True, env=child_env())
    deadline = time.monotonic() + 30
    while len(psutil.Process(leader.pid).children()) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    members = [leader.pid] + [c.pid for c in psutil.Process(leader.pid).children(recursive=True)]
    assert len(members) == 2
    stop_group(leader, 0.0)
    assert leader.returncode == -signal.SIGKILL  # killed, not asked: SIGTERM would have been ignored
    assert wait_gone(members) == []


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux-only")
def test_the_engine_runs_on_the_cpus_it_was_given_and_its_children_inherit_them():
    code = ("import os, subprocess, sys; print(sorted(os.sched_getaffinity(0))); "
            "print(subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))'], "
            "capture_output=True, text=True).stdout.strip())")
    last = max(os.sched_getaffinity(0))
    result = subprocess.run([sys.executable, "-m", "serve.engines.watchdog", "--cpus", str(last), "--",
                             sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [f"[{last}]", f"[{last}]"]
    refused = subprocess.run([sys.executable, "-m", "serve.engines.watchdog", "--cpus", "4096", "--", "true"],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "cannot run the engine on CPUs [4096]" in refused.stderr
