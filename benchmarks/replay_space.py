"""How long simulate-first's one-off prediction of a whole space takes after the baseline: every config of a finished
study's space replayed from its baseline's recorded tokens and priced (`Simulator.prepare` + `predict`, as
pipeline/search/simulate_first.py runs them), with the n-gram trie in Python, compiled in this process, and compiled
in worker processes. Each run is a fresh process (nothing cached), the modes alternate run by run, and every run's
signatures (what the cost model sees of each replay) must be identical across modes: the same predictions.

    python benchmarks/replay_space.py --from runs/default --runs 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODES = {"python": ("python", 1), "python-workers": ("python", 0), "compiled": ("compiled", 1),
         "compiled-workers": ("compiled", 0)}


def one(study_dir: Path, mode: str) -> dict:
    """One timed prediction of the whole space in this process."""
    import pyarrow.parquet as pq

    from pipeline.config import load_study
    from pipeline.config.study import resolve_space_path
    from pipeline.measure.summary import to_records
    from pipeline.records.tracking import Tracker
    from pipeline.search.space import baseline_point, grid_points, load_space, resolve
    from pipeline.simulate.prefix import prefix_cache_of
    from pipeline.simulate.simulator import Simulator, base_cost
    from pipeline.simulate.workload import answers_of
    from pipeline.study.driver import workload_requests

    study = load_study(study_dir / "study.yaml", {})
    space = load_space(resolve_space_path(study.search_space))
    tracker = Tracker(f"sqlite:///{study_dir / 'mlflow.db'}", study.name)
    client = tracker.client()
    runs = [r for r in client.search_runs([tracker.experiment_id()], max_results=500)
            if r.data.tags.get("specdec.kind") == "trial" and r.data.params.get("spec.algorithm") == "none"]
    if not runs:
        raise SystemExit(f"{study_dir}: no baseline trial run in its MLflow records")
    with tempfile.TemporaryDirectory() as tmp:
        records = to_records(pq.read_table(client.download_artifacts(runs[0].info.run_id, "requests.parquet", tmp)))
        info = json.loads(Path(client.download_artifacts(runs[0].info.run_id, "server_info.json", tmp)).read_text())
    warmup, measure = workload_requests(study, prompt_ids=True)
    configs = []
    for params in grid_points(space, limit=study.search.simulate.points):
        if params.get("algorithm") != "none":
            resolution = resolve(space, params, study)
            if resolution.valid and resolution.config is not None:
                configs.append(resolution.config)
    prefix = prefix_cache_of(info)
    started = time.perf_counter()
    simulator = Simulator(answers_of(records), warmup, measure, arrival=study.workload.arrival, seed=study.seed,
                          lag=study.search.simulate.lag_rounds, prefix=prefix)
    base = base_cost(records, info.get("verify_cost"), study.search_concurrency, prefix=prefix,
                     flushed_after_warmup=simulator.flushed_after_warmup)
    baseline = resolve(space, {"algorithm": "none", **baseline_point(space)}, study).config
    cost = simulator.fitted(base, [(baseline, records)])
    workers = MODES[mode][1]
    in_workers = simulator.prepare(configs, workers=workers or None, spread_ngram=not workers)
    figures = [simulator.predict(config, cost) for config in configs]
    seconds = time.perf_counter() - started
    digest = hashlib.sha256(json.dumps([simulator.signature(c) for c in configs]).encode()).hexdigest()[:16]
    return {"mode": mode, "seconds": seconds, "configs": len(configs), "in_workers": in_workers,
            "distinct": len({simulator.signature(c) for c in configs}), "signatures": digest,
            "best": max(f.get("tput_tok_s", 0.0) for f in figures)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="study_dir", required=True, help="a finished study's folder (runs/<name>)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    study_dir = Path(args.study_dir).resolve()
    if args.one:
        print(json.dumps(one(study_dir, args.one)))
        return
    modes = args.modes.split(",")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for run in range(args.runs):
        for mode in modes:  # alternate: run k of every mode before run k+1 of any
            env = {**os.environ, "SPECDEC_NGRAM_TRIE": MODES[mode][0]}
            done = subprocess.run([sys.executable, __file__, "--from", str(study_dir), "--one", mode], env=env,
                                  capture_output=True, text=True, check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            results[mode].append(row)
            print(f"run {run} {mode}: {row['seconds']:.2f} s ({row['configs']} configs, {row['in_workers']} replayed "
                  f"in workers, {row['distinct']} distinct, signatures {row['signatures']})", flush=True)
    digests = {r["signatures"] for rows in results.values() for r in rows}
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    print(f"\n- machine: {cpu}, {os.cpu_count()} CPUs; study {study_dir}; {args.runs} runs per mode, alternating")
    print(f"- signatures identical across every run and mode: {'yes' if len(digests) == 1 else 'NO: ' + str(digests)}")
    print("\n| mode | median s | min s | max s |\n|---|---|---|---|")
    for mode, rows in results.items():
        s = [r["seconds"] for r in rows]
        print(f"| {mode} | {statistics.median(s):.2f} | {min(s):.2f} | {max(s):.2f} |")


if __name__ == "__main__":
    main()
