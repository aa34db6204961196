"""`python -m serve.engines.watchdog [--cpus N,M] -- ARGV...`: run ARGV and make it die with its owner, however the owner
ends; with `--cpus`, on those CPUs only (Linux affinity, inherited by the engine's own children).

Every engine is started through this wrapper, in a new session (so the wrapper leads the process group). The
owner is the wrapper's parent (a Serve replica, a test, a benchmark). Two links, so that neither end can be lost:
- owner -> wrapper: the wrapper watches its owner through a pidfd (Linux >= 5.3; else it polls `getppid()`), and
  stops the engine's whole process group the moment the owner is gone: SIGKILL of a replica, of the driver that
  started Ray, a node agent restart. SIGTERM/SIGINT to the wrapper are passed to the group, so a normal teardown
  (`killpg`) behaves as before.
- wrapper -> engine: the engine is started with `PR_SET_PDEATHSIG(SIGKILL)`, so if the wrapper itself is killed
  (Ray kills a dying worker's child processes with SIGKILL, which is what used to leave engines with PPID 1) the
  kernel kills the engine too.
- wrapper -> the engine's own children: the death signal is not inherited, so a SIGKILLed wrapper took the engine
  but left what the engine had started (SGLang's detokenizer, a multiprocessing resource tracker) running under
  init. A reaper, forked off before the engine starts and detached from the wrapper (so a kill of the wrapper's
  children does not reach it), waits for the wrapper to end, however it ends, then SIGKILLs the whole process group,
  itself included. Only where the wrapper leads its own group (started in a new session, as every owner does).
Standard library only: it starts in milliseconds.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys

POLL_S = 0.5  # the getppid() fallback's period, and the longest a missed wake-up can delay a stop
GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1
# loaded here, not in the forked child (no dlopen between fork and exec)
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


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


def _start_reaper() -> None:
    """Fork the reaper (module docstring) when this wrapper leads its own process group; return at once."""
    group = os.getpid()
    if os.getpgrp() != group:  # not our own group: killing it would reach the owner's processes
        return
    first = os.fork()
    if first:
        os.waitpid(first, 0)  # the middle process exits at once: the reaper is nobody's child here
        return
    try:
        if os.fork() == 0:
            _reap(group)
    finally:
        os._exit(0)


def _reap(group: int) -> None:
    """In the reaper: wait for the wrapper (pid `group`) to end, then SIGKILL its group. Signals to the group other
    than SIGKILL are ignored: the wrapper's own stop sends SIGTERM first, and the reaper must outlive it."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # holding the owner's pipes would delay its end-of-file until the group is gone
        os.dup2(null, fd)
    wrapper = _pidfd(group)  # None as well when the wrapper is gone already: the loop below then ends at once
    if wrapper is not None:
        select.select([wrapper], [], [])  # readable once the wrapper has exited
    else:
        while True:  # no pidfds (Linux < 5.3): ask for the wrapper every POLL_S
            try:
                os.kill(group, 0)
            except ProcessLookupError:
                break
            select.select([], [], [], POLL_S)
    try:
        os.killpg(group, signal.SIGKILL)  # the engine's orphans and this reaper
    except ProcessLookupError:
        pass


def _die_with(parent: int) -> None:
    """In the engine's process, before it runs: SIGKILL when `parent` (this wrapper) dies, and exit now if it is
    gone already (it may have died between the fork and the prctl)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(70)


def _pidfd(pid: int) -> int | None:
    """A file descriptor that becomes readable when process `pid` exits; None where the OS has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def main(argv: list[str]) -> int:
    cpus = None
    if argv[:1] == ["--cpus"] and len(argv) > 1:
        try:
            cpus = {int(c) for c in argv[1].split(",")}
        except ValueError:
            cpus = set()
        argv = argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or cpus == set():
        print("usage: python -m serve.engines.watchdog [--cpus N,M,...] -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    if cpus is not None:  # the engine and every process it starts run on these CPUs only (they inherit it)
        try:
            os.sched_setaffinity(0, cpus)
        except (AttributeError, OSError) as exc:
            print(f"[watchdog] cannot run the engine on CPUs {sorted(cpus)}: {exc} (this machine has CPUs "
                  f"{sorted(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else '?'})",
                  file=sys.stderr, flush=True)
            return 2
    parent = os.getppid()
    _start_reaper()
    owner = _pidfd(parent)
    if owner is not None and os.getppid() != parent:  # the owner died before we could watch it
        return 1
    # Signal handlers only record the request (the wake-up pipe interrupts the wait below); the stop runs in the main
    # loop, so it always finishes (a stop thread died with the wrapper when the engine exited first). Installed
    # before the engine starts: a SIGTERM in between must not kill the wrapper alone and orphan the engine.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    requested = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: requested.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _frame: requested.append(signum))
    me = os.getpid()
    child = subprocess.Popen(argv, preexec_fn=lambda: _die_with(me))
    engine = _pidfd(child.pid)
    watched = [fd for fd in (owner, engine, wake_r) if fd is not None]
    while child.poll() is None:
        if requested:
            _stop_group(child)
        if os.getppid() != parent or (owner is not None and select.select([owner], [], [], 0)[0]):
            print(f"[watchdog] owner process {parent} is gone: stopping the engine", file=sys.stderr, flush=True)
            _stop_group(child)
        # Not a sleep: wakes when the owner or the engine exits or a signal arrives (the timeout only bounds the
        # getppid() fallback where there are no pidfds).
        ready = select.select(watched, [], [], POLL_S)[0]
        if wake_r in ready:
            os.read(wake_r, 512)
    if requested:  # the engine went first (the group got the SIGTERM too): its children must not outlive it
        _stop_group(child)
    return child.returncode if child.returncode >= 0 else 128 - child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
