"""Benchmark: where a command's CPU time goes, by kind of process (engines, Serve replicas, Ray's daemons, drivers).

Runs the command and reads every process's CPU time from /proc every 0.3 s until it ends; a process is counted from
its start (or, if it was already running, from the first reading) to its last reading, and grouped by its command
line (read again when a Ray worker renames itself `ray::...`). A process that lives less than one interval is
missed, so the total is a floor. Linux only. Run it with the machine to itself: other processes are counted too.

    python benchmarks/cpu_by_process.py -- python -m pytest -q -p no:cacheprovider tests/end_to_end/test_levels_study.py
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")
KINDS = (  # (text in the command line, kind), first match wins
    ("serve.engines.cpu", "CPU engine"), ("launch_server", "SGLang server"), ("llama-server", "llama-server"),
    ("ray::ServeReplica", "Serve replica"), ("ray::ServeController", "Serve controller + proxy"),
    ("ray::ProxyActor", "Serve controller + proxy"), ("ray::", "other Ray actor"), ("gcs_server", "Ray daemons"),
    ("raylet", "Ray daemons"), ("dashboard", "Ray daemons"), ("log_monitor", "Ray daemons"),
    ("monitor.py", "Ray daemons"), ("default_worker.py", "Ray worker (unnamed)"), ("pipeline.", "pipeline CLI"),
    ("serve.production", "serve.production"), ("pytest", "pytest"), ("chrom", "Chromium"), ("postgres", "PostgreSQL"),
)


def kind_of(cmdline: str) -> str:
    if not cmdline:
        return "kernel threads"
    return next((kind for text, kind in KINDS if text in cmdline), "other")


def read(pid: str) -> tuple[str, float, str] | None:
    """(start time, CPU seconds, command line) of one process, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline") as fh:
            cmdline = fh.read().replace("\0", " ").strip()
    except OSError:
        return None
    return fields[19], (int(fields[11]) + int(fields[12])) / TICK, cmdline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    seen: dict[tuple[str, str], list] = {}  # (pid, start) -> [kind, first CPU s, last CPU s]
    first, me, started = True, str(os.getpid()), time.monotonic()
    child = subprocess.Popen(command)
    while child.poll() is None:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            got = None if pid == me else read(pid)
            if got is None:
                continue
            start, cpu, cmdline = got
            entry = seen.get((pid, start))
            if entry is None:
                seen[(pid, start)] = [kind_of(cmdline), cpu if first else 0.0, cpu]
            else:
                entry[2] = cpu
                if cmdline.startswith("ray::"):
                    entry[0] = kind_of(cmdline)
        first = False
        time.sleep(0.3)
    wall = time.monotonic() - started
    totals: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    for kind, cpu0, cpu in seen.values():
        totals[kind] += cpu - cpu0
        counts[kind] += 1
    total = sum(totals.values())
    print(f"\nwall {wall:.1f} s, CPU {total:.1f} s ({os.cpu_count()} cores), exit {child.returncode}")
    print("| kind | processes | CPU s | share |\n|---|---|---|---|")
    for kind, cpu in totals.most_common():
        print(f"| {kind} | {counts[kind]} | {cpu:.1f} | {cpu / total:.0%} |")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
