"""A finished study against a recorded grid of the same space: did its search reach the grid's best, with how many
launches and engine-seconds, and how far were its predictions from what the grid measured?

The grid (`benchmarks/search_efficiency.py record --space S --set ...`) measured every point of the space `runs`
times; the study (`python -m pipeline.tune --search-space S ...`, same model, workload and engine) ran in its output
folder. Reads the grid's Parquet and the study's MLflow (its trial runs, and `simulate/space_predictions.jsonl`:
every point's prediction under the study's last cost model), and prints:
- the grid: every point's mean tok/s, its runs' range, the grid's best point;
- the study: its launches (the search's trials, the baseline included), their engine-seconds (`time_total_s`: start,
  warm-up, measurement) against one pass over the grid, and the best launched point's grid mean against the grid's
  best (the "within 2%" question, judged on the grid's means, not on the study's own single measurements);
- every point's prediction against the grid's mean: the error per point, its median and maximum.

    python benchmarks/study_vs_grid.py --grid benchmarks/data/standalone-small-quick.parquet --study runs/NAME
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.search_replay import key, read_grid  # noqa: E402
from pipeline.records.tracking import Tracker  # noqa: E402
from pipeline.search.simulate_first import SPACE_PREDICTIONS  # noqa: E402
from pipeline.vocabulary.outcome import Outcome  # noqa: E402


def describe(params: dict) -> str:
    if params.get("algorithm") == "none":
        return "baseline"
    algorithm = params["algorithm"]
    return algorithm + " " + " ".join(f"{k.split('.', 1)[1]}={v}" for k, v in sorted(params.items())
                                      if k.startswith(algorithm + "."))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", type=Path, required=True, help="recorded grid (Parquet)")
    parser.add_argument("--study", type=Path, required=True, help="the study's output folder (runs/<name>)")
    parser.add_argument("--name", help="the study's name (default: the folder's name)")
    args = parser.parse_args()
    table, meta, _ = read_grid(args.grid)
    measured: dict = {}
    seconds: dict = {}
    for row in table.to_pylist():
        if row["outcome"] == Outcome.COMPLETE.value and row["tput_tok_s"]:
            point = key(json.loads(row["params"]))
            measured.setdefault(point, []).append(row["tput_tok_s"])
            seconds.setdefault(point, []).append(row["time_total_s"] or 0.0)
    mean = {p: statistics.mean(v) for p, v in measured.items()}
    best = max(mean, key=lambda p: mean[p])

    tracker = Tracker(f"sqlite:///{args.study / 'mlflow.db'}", args.name or args.study.name)
    client = tracker.client()
    runs = client.search_runs([tracker.experiment_id()], max_results=1000, order_by=["attributes.start_time ASC"])
    parent = next(r for r in runs if r.data.tags.get("specdec.kind") == "study")
    trials = [r for r in runs if r.data.tags.get("specdec.kind") == "trial" and "optuna.params" in r.data.tags]
    with tempfile.TemporaryDirectory() as tmp:
        lines = Path(client.download_artifacts(parent.info.run_id, SPACE_PREDICTIONS, tmp)).read_text().splitlines()
    predicted = {key(e["params"]): e["predicted"]["tput_tok_s"] for e in map(json.loads, lines)}

    print(f"grid {args.grid.name}: {meta.get('model')}, {meta.get('runs')} runs a point, recorded "
          f"{meta.get('recorded', '?')[:10]} on {meta.get('machine')}; command: {meta.get('command')}")
    print(f"study {args.study}: {len(trials)} launches in the search (the baseline included)\n")
    print("| point | grid tok/s, mean (runs) | predicted | error vs grid | launched: measured |")
    print("|---|---|---|---|---|")
    launched = {key(json.loads(r.data.tags["optuna.params"])): r for r in trials}
    errors = []
    for point in sorted(mean, key=lambda p: -mean[p]):
        runs_text = ", ".join(f"{v:.2f}" for v in measured[point])
        guess = predicted.get(point)
        error = abs(guess - mean[point]) / mean[point] if guess is not None else None
        if error is not None:
            errors.append(error)
        run = launched.get(point)
        got = "-" if run is None else f"{run.data.metrics.get('tput_tok_s', float('nan')):.2f}"
        print(f"| {describe(dict(point))}{' (best)' if point == best else ''} | {mean[point]:.2f} ({runs_text}) | "
              f"{'-' if guess is None else f'{guess:.2f}'} | {'-' if error is None else f'{error:.1%}'} | {got} |")
    reached = max((p for p in launched if p in mean), key=lambda p: mean[p])
    gap = (mean[best] - mean[reached]) / mean[best]
    study_s = sum(r.data.metrics.get("time_total_s", 0.0) for r in trials)
    grid_s = sum(statistics.mean(v) for v in seconds.values())
    print(f"\nbest launched point by the grid's means: {describe(dict(reached))}, {mean[reached]:.2f} tok/s, "
          f"{gap:.1%} below the grid's best ({describe(dict(best))}, {mean[best]:.2f})")
    print(f"engine-seconds: the study's {len(trials)} launches {study_s:.0f} s; one pass over the grid's "
          f"{len(mean)} points {grid_s:.0f} s")
    if errors:
        print(f"predictions against the grid's means, {len(errors)} points: median error "
              f"{statistics.median(errors):.1%}, max {max(errors):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
