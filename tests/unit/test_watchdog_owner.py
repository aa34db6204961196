"""The engine dies with its watchdog, however the watchdog ends (issue #31 item 5): Ray kills a dying worker's child
processes with SIGKILL, which took the watchdog and left the engine running with PPID 1. Real processes."""

import os
import signal
import subprocess
import sys
import time

import psutil

from serve.engines.base import child_env


def _engine_of(watchdog: subprocess.Popen, deadline_s: float = 30.0) -> psutil.Process:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        children = psutil.Process(watchdog.pid).children()
        if children:
            return children[0]
        time.sleep(0.05)  # polling a condition under a deadline
    raise AssertionError("the engine did not start")


def _gone(proc: psutil.Process, deadline_s: float) -> bool:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)  # polling a condition under a deadline
    return False


def test_a_sigkilled_watchdog_takes_its_engine_with_it():
    watchdog = subprocess.Popen([sys.executable, "-m", "serve.engines.watchdog", "--", sys.executable, "-c",
                                 "import time; time.sleep(600)"], start_new_session=True, env=child_env())
    engine = _engine_of(watchdog)
    try:
        os.kill(watchdog.pid, signal.SIGKILL)  # no handler runs: only the kernel can stop the engine now
        watchdog.wait(timeout=30)
        assert _gone(engine, 10.0), "the engine outlived its watchdog"
    finally:
        if not _gone(engine, 0):
            engine.kill()
