"""Benchmark: where one trial's wall time goes (engine start, warm-up, measurement, everything else).

Runs a real study (`python -m pipeline.tune`, default settings unless told otherwise) in a temporary folder, or
reads a finished one (`--from runs/default`), and splits each trial's cycle into:

- cycle: from Optuna handing out the trial (`ask`) to handing out the next one (the last trial: to its `tell`);
  it includes Tune scheduling, the trial actor, MLflow logging and Optuna bookkeeping;
- engine start: engine process spawned -> first healthy `/health` (model load, the engine's verify-cost probe);
- warm-up and measurement: the load generator's two phases;
- everything else = cycle - engine start - warm-up - measurement, itself split into Serve deploy (excluding the
  engine start: a fresh app and replica actor, or, when the trial process's live replica is reused (column
  `replica`), the restart request with the previous trial's engine stopped and the node checks), read-back + flush +
  engine-log fetch (+ the app's delete after a failure), simulate-first's one-off prediction (in the baseline's
  cycle: the reference pass, in which the baseline answers the rest of the warm-up split, `time_reference_s`; then
  the baseline read back and the whole space replayed and ranked, the study run's `simulate_build_s`), the trial's
  start (Optuna's `ask` to the trial running in Tune's worker, the MLflow run's start time: the first trial waits for
  Tune to start that process, the next ones reuse it), and logging + Tune + Optuna.

The one-off prediction and the first trial process's start are the study's costs, paid once whatever the budget, so
the share is given three times: of each trial's cycle as it ran; with the prediction counted as the study's instead of
the baseline's ("share less prediction": everything else less the prediction, over the cycle less the prediction);
and with the first trial's process start counted as the study's too ("share less one-offs").

Trials run one at a time on a CPU machine, so Optuna trials and MLflow trial runs are matched by order.

    python benchmarks/overhead.py --quick            # a 3-trial default study, ~5 min on 2 cores
    python benchmarks/overhead.py                    # the default study (8 trials + promotion re-runs)
    python benchmarks/overhead.py --from runs/default
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipeline.vocabulary.outcome import Outcome

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("engine_start_s", "warmup_s", "measure_s")


def run_study(folder: Path, trials: int | None, extra: list[str]) -> Path:
    argv = [sys.executable, "-m", "pipeline.tune", "--name", "overhead", *(["--trials", str(trials)] if trials else []),
            *extra]
    print("$", " ".join(argv), f"(in {folder})", flush=True)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(argv, cwd=folder, env=env, check=True)
    return folder / "runs" / "overhead"


def trial_rows(study_dir: Path) -> list[dict[str, Any]]:
    """One row per trial with its cycle and phase times, in the order the trials ran."""
    import mlflow
    import optuna

    storage = f"sqlite:///{study_dir / 'optuna.db'}"
    names = optuna.get_all_study_names(storage)
    if len(names) != 1:
        raise SystemExit(f"{study_dir}/optuna.db holds studies {names}: expected exactly one")
    # (number, start, complete) of each finished trial
    trials = sorted(((t.number, t.datetime_start, t.datetime_complete)
                     for t in optuna.load_study(study_name=names[0], storage=storage).trials
                     if t.datetime_start and t.datetime_complete), key=lambda t: t[1])
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{study_dir / 'mlflow.db'}")
    runs = sorted((r for e in client.search_experiments() for r in client.search_runs(
        [e.experiment_id], filter_string="tags.`specdec.kind` = 'trial'", max_results=1000)),
        key=lambda r: r.info.start_time)
    if len(runs) != len(trials):
        raise SystemExit(f"{len(trials)} finished Optuna trials but {len(runs)} MLflow trial runs: cannot match them")
    rows = []
    for i, ((number, start, complete), run) in enumerate(zip(trials, runs)):
        end = trials[i + 1][1] if i + 1 < len(trials) else complete
        m = {k[len("time_"):]: v for k, v in run.data.metrics.items() if k.startswith("time_")}
        row: dict[str, Any] = {"trial": number, "algorithm": run.data.params.get("spec.algorithm", "?"),
               "outcome": run.data.tags.get("outcome", "?"), "replica": run.data.tags.get("serve_replica") or "-",
               "cycle_s": (end - start).total_seconds(),
               **{k: m.get(k, float("nan")) for k in ("deploy_s", "total_s", *PHASES)}}
        row["other_s"] = row["cycle_s"] - sum(row[k] for k in PHASES)
        row["serve_deploy_s"] = row["deploy_s"] - row["engine_start_s"]
        row["reference_s"] = m.get("reference_s", 0.0)
        row["readback_teardown_s"] = (row["total_s"] - row["deploy_s"] - row["warmup_s"] - row["measure_s"]
                                      - row["reference_s"])
        # the MLflow run's start time is run_trial's own start (pipeline.records.tracking.Tracker.log_trial)
        row["trial_start_s"] = run.info.start_time / 1000 - start.timestamp()
        row["logging_tune_s"] = row["cycle_s"] - row["total_s"] - row["trial_start_s"]
        row["simulate_s"] = 0.0
        rows.append(row)
    # simulate-first predicts the whole space once, after the baseline, in the baseline's cycle (studies before
    # simulate_build_s logged only the replay and ranking, simulate_explore_s)
    studies = [r for e in client.search_experiments() for r in client.search_runs(
        [e.experiment_id], filter_string="tags.`specdec.kind` = 'study'", max_results=10)]
    build_s = sum(r.data.metrics.get("simulate_build_s", r.data.metrics.get("simulate_explore_s", 0.0))
                  for r in studies)
    if rows and build_s:
        rows[0]["simulate_s"] = build_s
        rows[0]["logging_tune_s"] -= build_s
    for i, row in enumerate(rows):
        row["prediction_s"] = row["reference_s"] + row["simulate_s"]
        row["oneoff_s"] = row["prediction_s"] + (row["trial_start_s"] if i == 0 else 0.0)
    return rows


def report(rows: list[dict[str, Any]]) -> str:
    complete = [r for r in rows
                if r["outcome"] == Outcome.COMPLETE.value and r["engine_start_s"] == r["engine_start_s"]]
    cols = ("cycle_s", "engine_start_s", "warmup_s", "measure_s", "other_s", "serve_deploy_s",
            "readback_teardown_s", "reference_s", "simulate_s", "trial_start_s", "logging_tune_s")
    lines = ["| trial | algorithm | outcome | replica | " + " | ".join(c[:-2].replace("_", " ") + " s" for c in cols)
             + " | other share | share less prediction | share less one-offs |", "|" + "---|" * (len(cols) + 7)]
    for r in rows:
        lines.append(f"| {r['trial']} | {r['algorithm']} | {r['outcome']} | {r['replica']} | "
                     + " | ".join(f"{r[c]:.1f}" for c in cols) + f" | {r['other_s'] / r['cycle_s']:.1%} | "
                     f"{less(r, 'prediction_s'):.1%} | {less(r, 'oneoff_s'):.1%} |")
    if complete:
        med = {c: statistics.median(r[c] for r in complete) for c in cols}
        share = statistics.median(r["other_s"] / r["cycle_s"] for r in complete)
        shares = [statistics.median(less(r, key) for r in complete) for key in ("prediction_s", "oneoff_s")]
        lines.append(f"| **median** ({len(complete)} complete) | | | | "
                     + " | ".join(f"{med[c]:.1f}" for c in cols) + f" | **{share:.1%}** | **{shares[0]:.1%}** | "
                     f"**{shares[1]:.1%}** |")
        total = sum(r["cycle_s"] for r in complete)
        lines.append(f"\nEverything else, summed over the complete trials: {sum(r['other_s'] for r in complete):.0f} "
                     f"of {total:.0f} s = **{sum(r['other_s'] for r in complete) / total:.1%}** (target <= 5%).")
        predicted = sum(r["prediction_s"] for r in complete)
        if predicted:
            rest = sum(r["other_s"] - r["prediction_s"] for r in complete)
            lines.append(f"Of it, simulate-first's one-off prediction (reference pass and whole-space replay, in the "
                         f"baseline's cycle): {predicted:.1f} s; without it {rest:.1f} of {total - predicted:.0f} s = "
                         f"{rest / (total - predicted):.1%}.")
        oneoff = sum(r["oneoff_s"] for r in complete)
        rest = sum(r["other_s"] - r["oneoff_s"] for r in complete)
        lines.append(f"With the first trial process's start too (one-offs {oneoff:.1f} s): {rest:.1f} of "
                     f"{total - oneoff:.0f} s = {rest / (total - oneoff):.1%}.")
    return "\n".join(lines)


def less(row: dict[str, Any], study_s: str) -> float:
    """A trial's share of everything else with `study_s` of it (the one-off prediction; with the first trial
    process's start too) counted as the study's."""
    return (row["other_s"] - row[study_s]) / (row["cycle_s"] - row[study_s])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--quick", action="store_true", help="run a 3-trial default study instead of the full one")
    parser.add_argument("--from", dest="study_dir", type=Path, help="analyse this finished study folder instead")
    parser.add_argument("--trials", type=int, help="trials of the study to run (default: 3 with --quick, else 8)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to pipeline.tune --set (default settings otherwise)")
    args = parser.parse_args()
    if args.study_dir is not None:
        study_dir = args.study_dir
        command = f"python benchmarks/overhead.py --from {study_dir}"
    else:
        folder = Path(tempfile.mkdtemp(prefix="specdec-overhead-"))
        extra = [x for kv in args.set for x in ("--set", kv)]
        study_dir = run_study(folder, args.trials or (3 if args.quick else None), extra)
        command = "python benchmarks/overhead.py" + (" --quick" if args.quick else "")
    import torch

    rows = trial_rows(study_dir)
    print(f"\n- command: `{command}`\n- machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__},"
          f" python {platform.python_version()}\n- study: {study_dir}, {len(rows)} trials; load average at the end: "
          + " / ".join(f"{x:.2f}" for x in os.getloadavg()) + "\n")
    print(report(rows))


if __name__ == "__main__":
    main()
