"""`python -m serve.engines.watchdog -- ARGV...`: run ARGV and kill its whole process group when our parent dies.

Every engine is started through this wrapper, in a new session (so the wrapper leads the process group). When Ray
kills a replica without running its teardown (SIGKILL, a node agent restart), nothing else would stop the engine:
an orphaned SGLang keeps its GPU memory and the next trial on that GPU fails. Re-parenting (getppid() changes) is the
portable sign that the owner died. SIGTERM/SIGINT to the wrapper are passed to the group, so a normal teardown
(`killpg`) behaves as before. Standard library only: it starts in milliseconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

POLL_S = 0.5
GRACE_S = 10.0


def _stop_group(child: subprocess.Popen, grace_s: float = GRACE_S) -> None:
    """SIGTERM to the group (the engine and its children), SIGKILL after `grace_s` (or at once when the engine is
    gone: its children may ignore SIGTERM). The SIGKILL ends this wrapper too."""
    group = os.getpgrp()
    try:
        os.killpg(group, signal.SIGTERM)  # reaches us too: our handler only records it
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:
        return
    try:
        os.killpg(group, signal.SIGKILL)  # ends us as well, which is the point
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("usage: python -m serve.engines.watchdog -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent = os.getppid()
    requested = threading.Event()
    # The handler only records the request; the stop runs below in the main thread, so it always finishes (a stop
    # thread died with the wrapper when the engine exited first). Installed before the engine starts: a SIGTERM in
    # between must not kill the wrapper alone and orphan the engine.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: requested.set())
    signal.signal(signal.SIGINT, lambda _signum, _frame: requested.set())
    child = subprocess.Popen(argv)
    while child.poll() is None:
        if requested.is_set():
            _stop_group(child)
        if os.getppid() != parent:
            print(f"[watchdog] owner process {parent} is gone: stopping the engine", file=sys.stderr, flush=True)
            _stop_group(child)
        try:  # not a sleep: the wrapper exits as soon as the engine does (a teardown waits for the wrapper)
            child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
    if requested.is_set():  # the engine went first (the group got the SIGTERM too): its children must not outlive it
        _stop_group(child)
    return child.returncode if child.returncode >= 0 else 128 - child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
