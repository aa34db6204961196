"""What a node's CPUs did, read from /proc: the engine process group's CPU time and run-queue wait, and the node's
CPU time by kind. Two snapshots around a measurement window tell whether the engine had the CPU it wanted
(`pipeline/measure/window.py` judges them).

- Engine: every process of the engine's process group (the replica starts the engine in a group of its own, so
  SGLang's scheduler and detokenizer children count too): utime + stime from `/proc/<pid>/stat`, and per thread
  the run-queue wait from `/proc/<pid>/task/<tid>/schedstat` (nanoseconds spent runnable but not running: the time
  other work held the core the engine wanted). A thread that exits between two snapshots takes its counts with it;
  an engine's worker threads live as long as the engine.
- Node: `/proc/stat`'s first line (user, nice, system, idle, iowait, irq, softirq, steal), the CPUs the machine
  has, the 1-minute load average and the number of runnable tasks.
Parsing is pure (unit-tested on captured text); `read_usage` does the reading. Linux only: elsewhere every engine
and node figure is None, and a window cannot be judged (it is recorded as unchecked, never as disturbed).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from serve.spec import FrozenModel

__all__ = ["NodeCpu", "Usage", "node_cpu", "pid_stat", "read_usage", "schedstat_wait_ns"]

PROC = Path("/proc")
TICK_S = 1.0 / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


class NodeCpu(FrozenModel):
    """The node's CPU time since boot, in seconds, summed over its CPUs."""

    busy_s: float  # user + nice + system + irq + softirq
    idle_s: float  # idle + iowait
    steal_s: float  # taken by the hypervisor for other guests


class Usage(FrozenModel):
    """One snapshot. `at_s`: the node's monotonic clock (differences only, between snapshots of one node)."""

    at_s: float
    cpus: int
    engine_processes: int
    engine_threads: int
    engine_cpu_s: float | None
    engine_wait_s: float | None  # None where the kernel keeps no schedstat
    node: NodeCpu | None
    load1: float | None
    runnable: int | None


def node_cpu(stat_text: str) -> NodeCpu:
    """`/proc/stat`'s aggregate `cpu` line in seconds. Pure."""
    for line in stat_text.splitlines():
        fields = line.split()
        if line.startswith("cpu "):  # the aggregate line; "cpu0 ", "cpu1 ", ... are the single CPUs
            ticks = [int(x) for x in fields[1:9]] + [0] * max(0, 9 - len(fields))
            user, nice, system, idle, iowait, irq, softirq, steal = ticks[:8]
            return NodeCpu(busy_s=(user + nice + system + irq + softirq) * TICK_S,
                           idle_s=(idle + iowait) * TICK_S, steal_s=steal * TICK_S)
    raise ValueError("/proc/stat has no aggregate 'cpu' line")


def pid_stat(text: str) -> tuple[int, float]:
    """(process group, utime + stime in seconds) from one `/proc/<pid>/stat`. The command name may hold spaces and
    parentheses, so fields are counted from its closing parenthesis. Pure."""
    rest = text[text.rindex(")") + 2:].split()
    # rest[0] is field 3 (state): pgrp is field 5, utime 14, stime 15
    return int(rest[2]), (int(rest[11]) + int(rest[12])) * TICK_S


def schedstat_wait_ns(text: str) -> int:
    """The run-queue wait (second field, ns) of one `/proc/.../schedstat`. Pure."""
    return int(text.split()[1])


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # the process or thread ended meanwhile, or no such file on this kernel
        return None


def read_usage(pgid: int | None) -> Usage:
    """A snapshot of the engine group `pgid` (None: no engine) and of the node."""
    at = time.monotonic()
    cpu = wait = 0.0
    processes = threads = 0
    have_wait = True
    linux = PROC.joinpath("stat").exists()
    if pgid is not None and linux:
        for entry in PROC.iterdir():
            if not entry.name.isdigit():
                continue
            text = _read(entry / "stat")
            if text is None:
                continue
            group, seconds = pid_stat(text)
            if group != pgid:
                continue
            processes += 1
            cpu += seconds
            for task in (entry / "task").iterdir() if (entry / "task").exists() else ():
                sched = _read(task / "schedstat")
                threads += 1
                if sched is None:
                    have_wait = False
                    continue
                wait += schedstat_wait_ns(sched) / 1e9
    stat = _read(PROC / "stat") if linux else None
    load = _read(PROC / "loadavg") if linux else None
    load_fields = load.split() if load else []
    return Usage(at_s=at, cpus=os.cpu_count() or 1, engine_processes=processes, engine_threads=threads,
                 engine_cpu_s=cpu if processes else None,
                 engine_wait_s=wait if processes and have_wait else None,
                 node=node_cpu(stat) if stat else None,
                 load1=float(load_fields[0]) if load_fields else None,
                 runnable=int(load_fields[3].split("/")[0]) if len(load_fields) > 3 else None)
