"""`python -m serve.production` stops on a signal that the kernel hands to another thread (serve/production/cli.py
`follow`): Ray's threads can take a process's SIGINT or SIGTERM, and then only the main thread's next Python step acts
on it. One hour-long sleep kept an endpoint serving through its own Ctrl-C (seen in CI: no "stopping" line in 120 s).

A real subprocess: its main thread in `follow` without an alias to poll, a second thread that sends SIGINT to itself
once the main thread is in `follow`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHILD = """
import signal, sys, threading, time
# Python's own Ctrl-C handler, as a shell gives it: a parent that ignores SIGINT (a test worker after some tests,
# a background job of a script) passes the ignoring on, and the signal would never reach the main thread
signal.signal(signal.SIGINT, signal.default_int_handler)
from serve.production.cli import follow
from serve.production.settings import ProductionSettings

main = threading.main_thread().ident

def poke():
    deadline = time.monotonic() + 30
    while sys._current_frames()[main].f_code.co_name != "follow":  # the main thread is waiting in follow
        if time.monotonic() > deadline:
            print("follow never started", flush=True)
            return
        time.sleep(0.01)
    signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # this thread takes the signal, not the main one

threading.Thread(target=poke, daemon=True).start()
try:
    follow(ProductionSettings(registered_model="m", follow_alias_s=0), None)
except KeyboardInterrupt:
    print("stopped", flush=True)
"""


def test_a_signal_taken_by_another_thread_stops_the_endpoint_driver():
    result = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "stopped", result.stdout + result.stderr[-2000:]


SWALLOWED = """
from serve.production import cli
from serve.production.settings import ProductionSettings

try:  # the stop signal's KeyboardInterrupt, caught by code that was running then (inside Ray, at start-up)
    cli._interrupt(2, None)
except KeyboardInterrupt:
    pass
try:
    cli.follow(ProductionSettings(registered_model="m", follow_alias_s=0), None)
except KeyboardInterrupt:
    print("stopped", flush=True)
"""


def test_a_stop_signal_whose_interrupt_was_caught_still_stops_the_endpoint_driver():
    result = subprocess.run([sys.executable, "-c", SWALLOWED], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "stopped", result.stdout + result.stderr[-2000:]
