"""The finalist stage's speed-up measured again and again, its fresh engines started in the sequential order (every
baseline run, then every finalist run) and in the interleaved one (B F | F B | B F ..., pipeline/decide/spread.py):
how far apart do repeated stages put the speed-up, and how wide is one stage's spread of paired ratios? Not a test.

    python benchmarks/finalist_order.py --stages 6                 # 6 stages per order, the default study's configs
    python benchmarks/finalist_order.py --stages 4 --drift 0.1     # with a forced drift: each engine 0.1x slower
    python benchmarks/finalist_order.py --quick                    # a smoke run: the smallest model, 1 stage per order

Each stage is `pipeline.study.finalists.measure_levels` as a study runs it (Serve replicas of the engine, a fresh
engine per run, flush, warm-up, window checks; `workload.remeasure` and the spread rule as the study's defaults say),
under its own study run in one MLflow store, at the study's search level. The configs are the default study's
baseline and the NGRAM config its studies promote (`benchmarks/repeatability.py`). Stages alternate between the two
orders, so whatever drifts over the benchmark's own hour falls on both. Per stage: the speed-up from the paired runs
(median of run k over baseline run k), the ratio of the medians, the pairs' range, and how far the baseline's last
run moved from its first. The table: per order, the stages' speed-ups (median, min-max, max/min and the standard
deviation over stages) and the median within-stage range of the pairs.
"""

from __future__ import annotations

import argparse
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

from benchmarks.repeatability import NGRAM, cpu_line  # noqa: E402

QUICK = {"model.target": "smollm2-135m", "engine.threads": 1, "workload.source": "free-text",
         "workload.warmup_prompts": 1, "workload.measure_prompts": 2, "workload.max_new_tokens": 8,
         "workload.remeasure": 0, "promotion.spread_reruns": 0, "engine.extra_flags": ["--verify-probe-seconds", "0"]}


def stage_figures(baseline: list[float], finalist: list[float]) -> dict[str, float]:
    """One stage's figures from its runs (run k of each paired); empty when no pair was measured."""
    from pipeline.decide.spread import paired_ratios

    pairs = paired_ratios(baseline, finalist)
    base = [t for t in baseline if t > 0]
    fin = [t for t in finalist if t > 0]
    if not pairs or not base or not fin:
        return {}
    return {"paired": statistics.median(pairs), "medians": statistics.median(fin) / statistics.median(base),
            "pair_min": min(pairs), "pair_max": max(pairs), "base_drift": base[-1] / base[0]}


def table(results: dict[str, list[dict[str, float]]]) -> str:
    lines = ["| order | stages | speed-up (median of stages) | min-max over stages | max/min | stdev | "
             "ratio of medians, min-max | pairs' range in a stage (median) |", "|---|---|---|---|---|---|---|---|"]
    for order, stages in results.items():
        got = [s for s in stages if s]
        if not got:
            lines.append(f"| {order} | 0 | - | - | - | - | - | - |")
            continue
        paired = [s["paired"] for s in got]
        medians = [s["medians"] for s in got]
        within = statistics.median(s["pair_max"] / s["pair_min"] for s in got)
        stdev = statistics.stdev(paired) if len(paired) > 1 else 0.0
        lines.append(f"| {order} | {len(got)} | {statistics.median(paired):.3f}x | {min(paired):.3f}-"
                     f"{max(paired):.3f}x | {max(paired) / min(paired):.3f} | {stdev:.3f} | {min(medians):.3f}-"
                     f"{max(medians):.3f}x | {within:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", type=int, default=6, help="finalist stages per order (default 6)")
    parser.add_argument("--runs", type=int, default=None, help="runs per config and stage (default: the study's "
                        "promotion.runs)")
    parser.add_argument("--drift", type=float, default=None, metavar="STEP",
                        help="force a drift: the n-th engine of a stage runs every round 1 + STEP x n times as long "
                             "(the CPU engine's `--test-fault drift-steps=STEP`)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: the smallest model, a tiny workload, one "
                        "stage per order, 2 runs each")
    parser.add_argument("--output", type=Path, default=None, help="where the stages' MLflow store and logs go "
                        "(default: a new temporary folder)")
    args = parser.parse_args()
    if args.stages < 1:
        parser.error(f"--stages must be >= 1, got {args.stages}")
    if args.drift is not None and args.drift <= 0:
        parser.error(f"--drift must be > 0, got {args.drift}")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("RAY_AUTH_MODE", "token")

    from pipeline.config import load_study
    from pipeline.decide.spread import ORDERS
    from pipeline.records.tracking import Tracker, default_tracking_uri
    from pipeline.search.space import baseline_point, load_space, resolve
    from pipeline.study.driver import build_context, connect_ray
    from pipeline.study.finalists import measure_levels
    from pipeline.trial.replicas import delete_study_apps

    stages = 1 if args.quick else args.stages
    folder = args.output or Path(tempfile.mkdtemp(prefix="specdec-finalist-order-"))
    folder.mkdir(parents=True, exist_ok=True)
    overrides: dict[str, Any] = {"name": "finalist-order", "output_dir": str(folder), **(QUICK if args.quick else {})}
    if args.drift is not None:
        flags = [*overrides.get("engine.extra_flags", []), "--test-fault", f"drift-steps={args.drift:g}"]
        overrides.update({"engine.extra_flags": flags})
    study = load_study(None, overrides)
    runs = 2 if args.quick else (args.runs or study.promotion.runs)
    space = load_space(study.search_space_path())
    configs = []
    for point in ({"algorithm": "none", **baseline_point(space)}, NGRAM):
        resolution = resolve(space, point, study)
        if resolution.config is None:
            raise SystemExit(f"the benchmark's config {point} does not resolve in {study.search_space_path()}: "
                             f"{resolution.violations}")
        configs.append(resolution.config)
    tracker = Tracker(default_tracking_uri(folder), study.name, artifact_dir=folder / "mlartifacts")
    serve_url = connect_ray(study.name, "local")
    level = study.search_concurrency
    print(f"machine: {cpu_line()}; model {study.model.target}; workload {study.workload.source} "
          f"({study.workload.warmup_prompts} warm-up, {study.workload.measure_prompts} measured x "
          f"{study.workload.max_new_tokens} tokens), concurrency {level}; {stages} stage(s) per order, {runs} runs "
          f"per config; drift {args.drift if args.drift is not None else 'none forced'}; output {folder}", flush=True)
    results: dict[str, list[dict[str, float]]] = {order: [] for order in ORDERS}
    started = time.monotonic()
    try:
        for i in range(stages * len(ORDERS)):
            order = ORDERS[i % len(ORDERS)]
            stage_study = study
            if args.drift is not None:  # every stage drifts from full speed: its own count of engine starts
                env = {**study.engine.env, "SPECDEC_TEST_FAULT_STATE": str(folder / f"fault-state-{i}")}
                stage_study = load_study(None, {**overrides, "engine.env": env})
            parent = tracker.start_study(f"{study.name}-{i}-{order}", "", resume=False)
            ctx = build_context(stage_study, folder / f"stage-{i}", serve_url, tracker, parent)
            (got,) = measure_levels(ctx, configs[0], [("ngram", configs[1])], [level], runs, order)
            base = [r.tput_tok_s for r in got.baseline]
            fin = [r.tput_tok_s for r in got.candidates[0].runs]
            figures = stage_figures(base, fin)
            results[order].append(figures)
            shown = (f"speed-up {figures['paired']:.3f}x (pairs {figures['pair_min']:.3f}-{figures['pair_max']:.3f}"
                     f"x), medians {figures['medians']:.3f}x, baseline last/first {figures['base_drift']:.3f}"
                     if figures else "no pair measured")
            print(f"stage {i} {order:11}: baseline {[round(t, 2) for t in base]}, ngram {[round(t, 2) for t in fin]}"
                  f" tok/s; {shown}", flush=True)
    finally:
        delete_study_apps(study.name)
    print(f"\n{time.monotonic() - started:.0f} s\n\n{table(results)}")


if __name__ == "__main__":
    main()
