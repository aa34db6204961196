"""One config measured again and again through the normal trial path (Serve replica, a fresh engine each run, flush,
warm-up, measure), under a study's own background (local Ray, Serve, MLflow on SQLite), quiet and beside one busy
core, for each engine placement: how far apart do fresh runs of identical work measure, and which placement holds?
Not a test.

    python benchmarks/repeatability.py --runs 5                          # every placement, quiet and busy
    python benchmarks/repeatability.py --runs 8 --placements default     # the study's default placement only

Placements (n = the CPUs this process may use):
- `all`: engine threads unset (every core), nothing pinned.
- `one`: engine on 1 thread, nothing pinned.
- `pinned`: the engine on the last n-1 CPUs with n-1 threads; this process (the driver and the load generator), Ray's
  daemons and Serve's actors on the first CPU.
- `default`: what a study does with `engine.threads` and `engine.cpus` unset (the same as one of the above).
Conditions: `quiet`, and `busy`: one busy-looping process beside the study (not pinned: the kernel places it), from
before the engine starts until the measurement ended.
Configs: the default study's baseline and the NGRAM config it promotes (templated workload, its defaults).
Re-measuring is off (`workload.remeasure: 0`): the raw spread is the question; each window's check is reported
(`pipeline/measure/window.py`). Runs alternate: run k of every (condition, placement, config) before run k+1 of any.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.measure.window import Window

REPO = Path(__file__).resolve().parents[1]
NGRAM = {"algorithm": "ngram", "ngram.num_draft_tokens": 12, "ngram.max_bfs_breadth": 1,
         "ngram.max_trie_depth": 12, "ngram.match_type": "BFS", "warmup_requests": 8}
PLACEMENTS = ("all", "one", "pinned", "default")


def cpu_line() -> str:
    model = platform.processor()
    flags: list[str] = []
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags") and not flags:
            flags = [f for f in line.split(":", 1)[1].split() if f.startswith(("avx512f", "amx", "avx2"))]
    return f"{model} ({', '.join(sorted(set(flags)))}), {len(os.sched_getaffinity(0))} CPUs"


def pin_background(cpus: set[int], engines: set[int]) -> None:
    """This process and every descendant (Ray's daemons, Serve's actors) onto `cpus`, except engine process groups
    (`engines`: their pgids), which keep the CPUs they were started with."""
    import psutil

    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            if os.getpgid(proc.pid) in engines:
                continue
            proc.cpu_affinity(sorted(cpus))
        except (psutil.Error, ProcessLookupError, OSError):
            continue


def placement_overrides(name: str, cpus: list[int]) -> dict[str, Any]:
    if name == "all":
        return {"engine.threads": None, "engine.cpus": None}
    if name == "one":
        return {"engine.threads": 1, "engine.cpus": None}
    if name == "pinned":
        return {"engine.threads": max(1, len(cpus) - 1), "engine.cpus": cpus[1:] or cpus}
    return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh runs of each (condition, placement, config)")
    parser.add_argument("--placements", default="all,one,pinned", help=f"comma-separated of {PLACEMENTS}")
    parser.add_argument("--conditions", default="quiet,busy", help="comma-separated of quiet, busy")
    parser.add_argument("--configs", default="baseline,ngram", help="comma-separated of baseline, ngram")
    args = parser.parse_args()
    placements = args.placements.split(",")
    conditions = args.conditions.split(",")
    configs = args.configs.split(",")
    if any(p not in PLACEMENTS for p in placements):
        parser.error(f"--placements: each of {PLACEMENTS}")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("RAY_AUTH_MODE", "token")

    from pipeline.config import load_study
    from pipeline.records.tracking import Tracker, default_tracking_uri
    from pipeline.search.space import baseline_point, load_space, resolve
    from pipeline.study.driver import build_context, connect_ray
    from pipeline.trial.lifecycle import run_trial
    from pipeline.trial.replicas import launch_fresh, live_app
    from pipeline.vocabulary.outcome import Outcome

    cpus = sorted(os.sched_getaffinity(0))
    base = load_study(None, {"name": "repeat", "workload.remeasure": 0})
    space = load_space(base.search_space_path())
    folder = Path(tempfile.mkdtemp(prefix="specdec-repeat-"))
    tracker = Tracker(default_tracking_uri(folder), "repeat", artifact_dir=folder / "mlartifacts")
    parent = tracker.start_study("repeat", "", resume=False)
    serve_url = connect_ray(base.name, "local")
    contexts = {}
    for placement in placements:
        study = load_study(None, {"name": "repeat", "workload.remeasure": 0,
                                  **placement_overrides(placement, cpus)})
        contexts[placement] = build_context(study, folder, serve_url, tracker, parent)
    points = {"baseline": {"algorithm": "none", **baseline_point(space)}, "ngram": NGRAM}
    print(f"machine: {cpu_line()}; model {base.model.target}; workload {base.workload.source} "
          f"({base.workload.warmup_prompts} warm-up, {base.workload.measure_prompts} measured x "
          f"{base.workload.max_new_tokens} tokens); {args.runs} runs each; MLflow {folder}", flush=True)
    results: dict[tuple[str, str, str], list[tuple[float | None, Window | None]]] = {}
    started = time.monotonic()
    for run in range(args.runs):
        for condition in conditions:
            for placement in placements:
                background = set(cpus[:1]) if placement == "pinned" else set(cpus)
                live = live_app(base.name)
                engines = set()
                if live is not None:
                    try:
                        import httpx

                        pid = httpx.get(f"{live.url}/replica/argv", timeout=10).json().get("pid")
                        engines = {os.getpgid(pid)} if pid else set()
                    except Exception:  # noqa: BLE001 - a replica that does not answer holds no engine to spare
                        engines = set()
                pin_background(background, engines)
                for name in configs:
                    hog = (subprocess.Popen([sys.executable, "-c", "while True: pass"])
                           if condition == "busy" else None)
                    try:
                        ctx = contexts[placement]
                        launch_fresh(base.name)
                        result = run_trial(ctx, f"{name}-{placement}-{condition}-r{run}",
                                           resolve(space, points[name], ctx.study))
                    finally:
                        if hog is not None:
                            hog.kill()
                            hog.wait()
                    value = result.summary.tput_tok_s if result.summary and result.outcome is Outcome.COMPLETE else None
                    window = result.windows[-1] if result.windows else None
                    results.setdefault((condition, placement, name), []).append((value, window))
                    print(f"  run {run} {condition:5} {placement:7} {name:8} {result.outcome.value:9} "
                          f"{value or 0:7.2f} tok/s  {window.line() if window else '-'}", flush=True)
    print(f"\n{time.monotonic() - started:.0f} s\n")
    print("| condition | placement | config | runs | median tok/s | min | max | max/min | engine wait (median) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (condition, placement, name), rows in results.items():
        values = [v for v, _ in rows if v]
        waits = [w.wait_share for _, w in rows if w is not None and w.wait_share is not None]
        if not values:
            print(f"| {condition} | {placement} | {name} | 0 | - | - | - | - | - |")
            continue
        print(f"| {condition} | {placement} | {name} | {len(values)} | {statistics.median(values):.2f} | "
              f"{min(values):.2f} | {max(values):.2f} | {max(values) / min(values):.2f} | "
              f"{statistics.median(waits):.0%} |" if waits else "- |")


if __name__ == "__main__":
    main()
