"""Fresh engines of one config, one after another, with what each process was given: is a slow run the engine
process as a whole, and what about it differs? Not a test.

Each run starts the CPU engine as a replica starts it (`--config`: the default study's baseline, or the NGRAM
config its studies promote), sends the config's warm-up requests, then the study's measured requests (concurrency
1), and stops it. Beside the throughput, each run records the engine process's own view of itself: CPU seconds and
context switches over the measured window (`/proc/<pid>/stat`, `status`), page faults, resident memory by kind
(`smaps_rollup`), and how often its two compute threads sat on one CPU (each thread's CPU read every 20 ms).
Conditions alternate run by run (A B A B ...), so whatever moves the machine over the minutes moves both:

- `default`: as the study starts it;
- `norandom`: the engine started with address-space randomization off (`personality(ADDR_NO_RANDOMIZE)`, inherited
  by the process): every run lays its memory out the same way, so a layout effect would show as a narrower spread;
- `dropcache`: the page cache dropped before the start (`/proc/sys/vm/drop_caches`, root): the weights read from
  disk as after a reclaim;
- `bind`: the engine's OpenMP threads bound one to a core (`OMP_PROC_BIND=true`, `OMP_PLACES=cores`), so the
  scheduler cannot put both on one CPU;
- `spin`: OpenMP's threads spin between parallel regions instead of sleeping (`OMP_WAIT_POLICY=ACTIVE`; the engine
  sets PASSIVE by default, serve/engines/cpu/__main__.py);
- `spinshort`: they spin for ~0.3 ms before they sleep (`GOMP_SPINCOUNT=30000`, over the engine's PASSIVE): a
  decode step's parallel regions follow each other within microseconds, a request's gaps do not.

    python benchmarks/fresh_engine.py --runs 6 --conditions default,norandom
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.repeatability import cpu_line  # noqa: E402

ADDR_NO_RANDOMIZE = 0x0040000
TICK = os.sysconf("SC_CLK_TCK")


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(c) for t in os.listdir(f"/proc/{p}/task")
                    for c in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
        except OSError:
            continue
        out.extend(kids)
        todo.extend(kids)
    return out


def engine_pid(watchdog: int) -> int | None:
    for pid in descendants(watchdog):
        try:
            if "serve.engines.cpu" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                return pid
        except OSError:
            pass
    return None


def process_view(pid: int) -> dict[str, float]:
    """CPU seconds, faults and context switches of every thread of `pid` so far; resident memory by kind."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    view: dict[str, float] = {"cpu_s": (int(stat[11]) + int(stat[12])) / TICK, "minflt": float(stat[7]),
                              "majflt": float(stat[9])}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches", "Threads"):
            view[key] = float(value.split()[0])
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        if key in ("Rss", "Anonymous", "AnonHugePages", "FilePmdMapped", "Shared_Clean", "Private_Clean"):
            view[key + "_mb"] = int(value.split()[0]) / 1024
    return view


class ThreadSampler:
    """Every thread's last CPU and CPU time, read every `every_s` while the window runs: afterwards, the share of
    readings in which the engine's two busiest threads (its compute threads) sat on the same CPU."""

    def __init__(self, pid: int, every_s: float = 0.02) -> None:
        import threading

        self.pid, self.every_s = pid, every_s
        self.samples: list[dict[int, tuple[int, int]]] = []
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def read(self) -> dict[int, tuple[int, int]]:
        out = {}
        for tid in os.listdir(f"/proc/{self.pid}/task"):
            try:
                fields = Path(f"/proc/{self.pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(tid)] = (int(fields[11]) + int(fields[12]), int(fields[36]))
        return out

    def run(self) -> None:
        while not self.stop_event.wait(self.every_s):
            self.samples.append(self.read())

    def __enter__(self) -> ThreadSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.thread.join()

    def same_cpu_share(self) -> float | None:
        if len(self.samples) < 2:
            return None
        first, last = self.samples[0], self.samples[-1]
        busiest = sorted((last[t][0] - first.get(t, (0, 0))[0], t) for t in last)[-2:]
        if len(busiest) < 2:
            return None
        a, b = busiest[0][1], busiest[1][1]
        both = [s for s in self.samples if a in s and b in s]
        return sum(s[a][1] == s[b][1] for s in both) / len(both) if both else None


def start(condition: str, config: Any) -> Any:
    from serve.replica.deployment import EngineProcess

    env = {"bind": {"OMP_PROC_BIND": "true", "OMP_PLACES": "cores"},
           "spin": {"OMP_WAIT_POLICY": "ACTIVE"}, "spinshort": {"GOMP_SPINCOUNT": "30000"}}.get(condition)
    if env:
        config = config.model_copy(update={"env": {**config.env, **env}})
    if condition == "dropcache":
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    libc = ctypes.CDLL(None, use_errno=True)
    before = libc.personality(0xFFFFFFFF)
    if condition == "norandom":
        libc.personality(before | ADDR_NO_RANDOMIZE)
    try:
        return EngineProcess(config)
    finally:
        libc.personality(before)


def one_run(condition: str, config: Any, warmup: Any, measure: Any) -> dict[str, Any]:
    from pipeline.measure.load import run_phase

    process = start(condition, config)
    try:
        process.wait_ready()
        pid = engine_pid(process.process.pid)
        started = time.monotonic()
        run_phase(process.url, warmup, concurrency=1, phase="warmup")
        warm_s = time.monotonic() - started
        before = process_view(pid) if pid else {}
        started = time.monotonic()
        if pid:
            with ThreadSampler(pid) as sampler:
                records = run_phase(process.url, measure, concurrency=1, phase="measure")
            same_cpu = sampler.same_cpu_share()
        else:
            records, same_cpu = run_phase(process.url, measure, concurrency=1, phase="measure"), None
        wall = time.monotonic() - started
        after = process_view(pid) if pid else {}
    finally:
        process.stop()
    tokens = sum(r.completion_tokens or 0 for r in records)
    row: dict[str, Any] = {"condition": condition, "tok_s": tokens / wall, "start_s": process.startup_s,
                           "warmup_s": warm_s, "measure_s": wall,
                           "ttft_ms": statistics.median(1000 * (r.ttft_s or 0) for r in records),
                           "compute_threads_same_cpu": same_cpu}
    if before and after:
        row["cores"] = (after["cpu_s"] - before["cpu_s"]) / wall
        for key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches", "minflt", "majflt"):
            row[key] = after[key] - before[key]
        row.update({k: v for k, v in after.items() if k.endswith("_mb") or k == "Threads"})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=6, help="fresh engines per condition")
    parser.add_argument("--conditions", default="default,norandom",
                        help="comma-separated of default, norandom, dropcache, bind, spin, spinshort (alternated run by run)")
    parser.add_argument("--config", choices=("baseline", "ngram"), default="baseline",
                        help="the default study's baseline, or the NGRAM config its studies promote")
    parser.add_argument("--output", default="runs/fresh-engine.jsonl")
    parser.add_argument("--beside", type=float, default=0.0,
                        help="a neighbour process using this share of one core in bursts (busy 15 ms, then idle), as "
                             "a study's driver, Ray and Serve do beside its engine (0.1-0.2 cores); 0: none")
    args = parser.parse_args()

    from pipeline.config import load_study
    from pipeline.study.driver import workload_requests
    from benchmarks.repeatability import NGRAM
    from pipeline.config.study import resolve_space_path
    from pipeline.search.space import baseline_point, load_space, resolve
    from pipeline.trial.replica_config import replica_config

    study = load_study(None, {})
    space = load_space(resolve_space_path(study.search_space))
    point = NGRAM if args.config == "ngram" else {"algorithm": "none", **baseline_point(space)}
    resolved = resolve(space, point, study)
    if resolved.config is None:
        raise SystemExit(f"the {args.config} point does not resolve on this study: {resolved}")
    trial = resolved.config
    warmup, measure = workload_requests(study)
    warmup = warmup[:trial.warmup_requests]
    # the config's replica, exactly as a trial builds it
    config = replica_config(study, trial, Path(tempfile.mkdtemp(prefix="fresh-engine-")))
    conditions = args.conditions.split(",")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"machine: {cpu_line()}; {args.config}; model {study.model.target}; {len(warmup)} warm-up, {len(measure)} measured x "
          f"{study.workload.max_new_tokens} tokens; concurrency 1", flush=True)
    rows = []
    neighbour = None
    if args.beside > 0:
        import subprocess

        idle_s = 0.015 * (1 - args.beside) / args.beside
        neighbour = subprocess.Popen([sys.executable, "-c", (
            "import time\nwhile True:\n    t = time.perf_counter() + 0.015\n    while time.perf_counter() < t: pass\n"
            f"    time.sleep({idle_s})")])
    with out.open("a") as fh:
        for i in range(args.runs):
            for condition in conditions:
                row = {"run": i, **one_run(condition, config, warmup, measure)}
                rows.append(row)
                fh.write(json.dumps(row) + "\n")
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                      flush=True)
    if neighbour is not None:
        neighbour.kill()
    for condition in conditions:
        speeds = [r["tok_s"] for r in rows if r["condition"] == condition]
        print(f"{condition}: tok/s median {statistics.median(speeds):.2f}, range {min(speeds):.2f}-{max(speeds):.2f}"
              f" (max/min {max(speeds) / min(speeds):.2f}), n={len(speeds)}")


if __name__ == "__main__":
    main()
