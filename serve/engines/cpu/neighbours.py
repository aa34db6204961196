"""The busy neighbours of the `busy-neighbours` test fault (serve/engines/cpu/faults.py): processes that keep every CPU
the engine may run on busy, so its threads wait for their cores as beside another program's work."""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("serve.engines.cpu")


class BusyNeighbours:
    """One busy-looping process per CPU this process may run on, each pinned to those CPUs, until `stop` (and at the
    latest when this process exits: the kernel kills them with it)."""

    def __init__(self) -> None:
        import ctypes
        import signal
        import subprocess

        self.cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
        code = ("import os\nif hasattr(os, 'sched_setaffinity'): os.sched_setaffinity(0, %r)\nwhile True: pass"
                % (set(self.cpus),))
        libc = ctypes.CDLL(None) if sys.platform.startswith("linux") else None  # loaded here, not after the fork

        def die_with_engine() -> None:
            if libc is not None:
                libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG

        self.processes = [subprocess.Popen([sys.executable, "-c", code], preexec_fn=die_with_engine)
                          for _ in self.cpus]

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        if self.processes:
            log.warning("TEST FAULT busy-neighbours: stopped at /flush_cache")
        self.processes = []
