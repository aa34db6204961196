"""Side by side, one invocation: the default study on our CPU engine and the example study on llama.cpp's
llama-server (examples/study-llama-cpp.yaml), same workload and seed, one after another (never together).

Each study is the real `python -m pipeline.tune` (local Ray, MLflow on SQLite, its own output folder). Afterwards the
trials are read back from MLflow and one markdown table is printed per the docs/benchmarks.md layout: plain decode
(the baseline trial), the best equivalent speculative trial, its speed-up in the trial, its accept length, and the
study's decision with the finalist's re-measured speed-up. Needs llama-server (bash infra/install-llama-cpp.sh).

    python benchmarks/llama_cpp_side_by_side.py                 # both studies as configured (about an hour)
    python benchmarks/llama_cpp_side_by_side.py --quick         # 3 trials, 2+2 prompts x 12 tokens (minutes)

Our plain decode vs llama.cpp F32 and Q4_1 in one run: benchmarks/llama_cpp_plain_decode.py.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pipeline.vocabulary.outcome import Outcome
from pipeline.vocabulary.row import TrialRow

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STUDIES = {
    # label -> pipeline.tune arguments (the CPU engine's default study is `pipeline.tune` with no study file)
    "our CPU engine, default study": [],
    "llama-server, llama-cpp-ngram": ["--study", str(ROOT / "examples" / "study-llama-cpp.yaml")],
}
QUICK = ["--trials", "3", "--set", "workload.warmup_prompts=2", "--set", "workload.measure_prompts=2",
         "--set", "workload.max_new_tokens=12"]


def run_study(label: str, extra: list[str], output: Path, seed: int) -> float:
    """Runs one study to its decision; returns its wall seconds. Its output is streamed to this terminal."""
    argv = [sys.executable, "-m", "pipeline.tune", *extra, "--name", output.name, "--output", str(output),
            "--seed", str(seed), "--ray-address", "local"]
    print(f"\n=== {label}: {' '.join(argv[1:])}", flush=True)
    started = time.monotonic()
    code = subprocess.call(argv, cwd=ROOT)
    if code != 0:
        raise SystemExit(f"{label}: pipeline.tune exited with {code}; its output is above")
    return time.monotonic() - started


def summary(output: Path) -> dict[str, Any]:
    """Baseline, best COMPLETE speculative trial, and the decision, read back from the study's MLflow."""
    import yaml

    from pipeline.records.tracking import Tracker
    from pipeline.records.trial_runs import rows_from_runs

    tracker = Tracker(f"sqlite:///{output / 'mlflow.db'}", output.name)
    rows = rows_from_runs(tracker.all_runs())
    base = next((r for r in rows if r.baseline and r.complete), None)
    best = next((r for r in rows if not r.baseline and r.complete), None)
    provenance = yaml.safe_load((output / "promoted.yaml").read_text())["provenance"]
    # the finalists' fresh re-runs (`final-<id>-run<k>`, baseline `final-baseline-run<k>`): median per config
    runs: dict[str, list[float]] = {}
    for r in rows_from_runs(tracker.all_runs(), "finalist"):
        runs.setdefault(r.name.rsplit("-run", 1)[0], []).append(r.tput_tok_s or 0.0)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    return {"base": base, "best": best, "decision": provenance["decision"], "source": provenance["source"],
            "remeasured": medians, "trials": len(rows)}


def settings(row: TrialRow) -> str:
    shown = {k.split(".", 1)[1]: v for k, v in row.params.items()
             if k.startswith("spec.") or k == "trial.warmup_requests"}
    return f"{row.algorithm} " + ", ".join(f"{k}={v}" for k, v in shown.items())


def cell(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else "-"


def table(results: dict[str, dict[str, Any]], walls: dict[str, float]) -> str:
    labels = list(results)
    lines = ["| | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]

    def row(name: str, values: list[str]) -> None:
        lines.append(f"| {name} | " + " | ".join(values) + " |")

    got = [results[k] for k in labels]
    row("plain decode (baseline trial)", [f"{cell(r['base'] and r['base'].tput_tok_s, '.2f')} tok/s" for r in got])
    row("best trial", [f"{r['best'].tput_tok_s:.2f} tok/s ({settings(r['best'])})" if r["best"]
                       else f"none {Outcome.COMPLETE.value}" for r in got])
    row("speed-up of the best trial", [f"{cell(r['best'] and r['best'].vs_baseline, '.2f')}x" for r in got])
    row("accept length of the best trial", [cell(r["best"] and r["best"].accept_len, ".2f") for r in got])
    decisions = []
    for r in got:
        medians = dict(r["remeasured"])
        base = medians.pop("final-baseline", None)
        ratio = ""
        if base and medians:
            name, best = max(medians.items(), key=lambda item: item[1])
            ratio = f"; re-measured {name}: {best:.2f} vs baseline {base:.2f} tok/s = {best / base:.2f}x"
        decisions.append(f"{r['decision']} ({r['source']}){ratio}")
    row("decision", decisions)
    row("trials / wall time", [f"{r['trials']} / {walls[k] / 60:.1f} min" for k, r in zip(labels, got)])
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 trials, 2 warm-up + 2 measured prompts x 12 tokens")
    parser.add_argument("--output", help="folder for both studies (default: a new temp folder)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from serve.engines.llama_cpp import models

    try:
        models.require_server()  # before an hour of CPU-engine study, not after it
    except models.LlamaCppMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.output).resolve() if args.output else Path(tempfile.mkdtemp(prefix="llama-side-by-side-"))
    print(f"machine: {platform.processor() or platform.machine()}, outputs under {out}", flush=True)
    results, walls = {}, {}
    for i, (label, extra) in enumerate(STUDIES.items()):
        folder = out / f"side-by-side-{i}"
        walls[label] = run_study(label, extra + (QUICK if args.quick else []), folder, args.seed)
        results[label] = summary(folder)
    print("\n" + table(results, walls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
