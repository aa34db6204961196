"""The first speculative launch of a simulate-first study (NGRAM; on llama-server its ngram-simple), predicted from
the baseline launch alone, against what it measured: with the verify-cost shape measured on the engine (its own round
table, or the one measured over its HTTP API after the baseline's measurement, pipeline/measure/shape.py) and the
prefill charged for the prompt tokens the engine's prefix cache did not hold (SGLang's radix cache,
pipeline/simulate/prefix.py): the prediction the study logged. From the same baseline, two references: the prefill
charged by prompt length (the model without the prefix cache), and the prior shape (`pipeline.simulate.cost.ALPHA`).
Not a test.

    python benchmarks/first_launch.py study --engine sglang --runs 3        # SGLang 0.5.23's own server on the CPU
    python benchmarks/first_launch.py study --engine cpu --runs 3           # the CPU engine (its own round table)
    python benchmarks/first_launch.py study --engine llama_cpp --runs 3     # llama-server, ngram-simple
    python benchmarks/first_launch.py study --engine vllm --runs 3          # vLLM's CPU server, its ngram lookup
    python benchmarks/first_launch.py probe --engine llama_cpp --levels 1,4  # the probe alone, on a fresh engine

`study`: each run is a whole study (`search_spaces/default.yaml`; on llama-server
`search_spaces/llama-cpp-ngram-simple.yaml`, the llama.cpp n-gram type the simulator replays; on vLLM
`search_spaces/vllm-ngram.yaml`, its prompt lookup, replayed by pipeline/simulate/vllm_ngram.py; the templated workload
-- answers repeat across requests, so the trie copies -- with its defaults, `budget.max_trials: 2`: the baseline and
the best predicted config, no finalists) under `--output`/run-<i>; then its MLflow records are read back. `probe`:
one engine started as a replica starts it (the baseline, no speculation), the probe run against it, the table
printed; the probe's own time against the engine's.
"""

from __future__ import annotations

import argparse
import json
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


def study_overrides(engine: str, name: str, output: Path, threads: int | None) -> dict[str, Any]:
    over: dict[str, Any] = {"name": name, "output_dir": str(output), "search_space": "default.yaml",
                            "search.strategy": "simulate-first", "budget.max_trials": 2, "promotion.finalists": 0,
                            "engine.threads": threads}
    if engine == "sglang":
        over.update({"engine.kind": "sglang", "engine.device": "cpu", "engine.start_timeout_s": 600})
    elif engine == "llama_cpp":
        over.update({"engine.kind": "llama_cpp", "search_space": "llama-cpp-ngram-simple.yaml"})
    elif engine == "vllm":
        # vLLM sizes its own OpenMP pool (serve/engines/vllm/flags.py): its default thread count is the study's too
        over.update({"engine.kind": "vllm", "search_space": "vllm-ngram.yaml", "engine.start_timeout_s": 900,
                     "engine.threads": None})
    return over


def read_back(output: Path, name: str) -> dict[str, Any]:
    """The baseline's probe and times, and the first speculative launch's measured throughput against its predictions
    from the baseline alone: the one the study logged (re-derived here, with its prefill and decode parts), the same with
    every prompt token's prefill charged, and with the prior shape."""
    import pyarrow.parquet as pq

    from pipeline.config import load_study
    from pipeline.config.study import resolve_space_path
    from pipeline.measure.server_info import ServerInfo
    from pipeline.measure.summary import to_records
    from pipeline.records.tracking import Tracker
    from pipeline.search.space import baseline_point, load_space, resolve
    from pipeline.simulate.predict import decode_rounds
    from pipeline.simulate.prefix import prefix_cache_of
    from pipeline.simulate.simulator import Simulator, base_cost
    from pipeline.simulate.workload import answers_of
    from pipeline.study.driver import workload_requests

    study = load_study(output / "study.yaml", {})
    space = load_space(resolve_space_path(study.search_space))
    tracker = Tracker(f"sqlite:///{output / 'mlflow.db'}", name)
    client = tracker.client()
    runs = sorted((r for r in client.search_runs([tracker.experiment_id()], max_results=100)
                   if r.data.tags.get("specdec.kind") == "trial"), key=lambda r: r.info.start_time)
    baseline = next(r for r in runs if r.data.params.get("spec.algorithm") == "none")
    launch = next(r for r in runs if r.data.params.get("spec.algorithm") not in (None, "none"))
    with tempfile.TemporaryDirectory() as tmp:
        records = to_records(pq.read_table(client.download_artifacts(baseline.info.run_id, "requests.parquet", tmp)))
        info = ServerInfo.from_text(
            Path(client.download_artifacts(baseline.info.run_id, "server_info.json", tmp)).read_text())
    warmup, measure = workload_requests(study, prompt_ids=True)
    baseline_config = resolve(space, {"algorithm": "none", **baseline_point(space)}, study).config
    config = resolve(space, json.loads(launch.data.tags["optuna.params"]), study).config
    prefix = prefix_cache_of(info)
    predicted: dict[str, Any] = {}
    # "online": what the study predicted and logged (prefills charged for what the engine's prefix cache did not
    # hold, when it has one), re-derived as a check; "prompt": the same with every prompt token charged (the model
    # before the prefix cache); "prior": the online prediction with the prior shape
    for name, verify_cost, held in (("online", info.verify_cost, prefix),
                                    ("prompt", info.verify_cost, None), ("prior", None, prefix)):
        simulator = Simulator(answers_of(records), warmup, measure, arrival=study.workload.arrival, seed=study.seed,
                              lag=study.search.simulate.lag_rounds, prefix=held)
        base = base_cost(records, verify_cost, study.search_concurrency, prefix=held,
                         flushed_after_warmup=simulator.flushed_after_warmup)
        cost = simulator.fitted(base, [(baseline_config, records)])
        rounds = decode_rounds(simulator.replay(config))
        decode_s = sum(cost.seconds(r) for rr in rounds for r in rr)  # what the shape governs
        predicted[name] = (simulator.predict(config, cost).get("tput_tok_s"), cost.shape, cost.o_ms, decode_s,
                           cost.p0_ms, cost.p1_ms)
    with tempfile.TemporaryDirectory() as tmp:
        launched = to_records(pq.read_table(client.download_artifacts(launch.info.run_id, "requests.parquet", tmp)))
    decode_measured = sum(r.e2e_s - (r.ttft_s or 0.0) for r in launched if r.phase == "measure")
    ttft_measured = [r.ttft_s for r in launched if r.phase == "measure"]
    vc = info.verify_cost or {}
    m, bm = launch.data.metrics, baseline.data.metrics
    return {"config": launch.data.tags.get("mlflow.runName", ""), "measured": m.get("tput_tok_s"),
            "logged_prediction": m.get("predicted_tput_tok_s"), "online": predicted["online"],
            "prompt": predicted["prompt"], "prior": predicted["prior"],
            "prefix_cache": prefix.model_dump() if prefix is not None else None,
            "disable_radix_cache": info.raw.get("disable_radix_cache"), "page_size": info.raw.get("page_size"),
            "predicted_ttft_p50_ms": m.get("predicted_ttft_p50_ms"), "measured_ttft_s": ttft_measured,
            "decode_measured_s": decode_measured, "spread": m.get("tput_spread"),
            "flag": launch.data.tags.get("measurement_flag"), "baseline": bm.get("tput_tok_s"),
            "baseline_flag": baseline.data.tags.get("measurement_flag"),
            "windows": [run.data.tags.get("measurement_window") for run in (baseline, launch)],
            "baseline_measure_s": bm.get("time_measure_s"), "baseline_total_s": bm.get("time_total_s"),
            "probe_s": bm.get("time_shape_probe_s"),
            "probe": {k: vc.get(k) for k in ("source", "flag", "attempts", "repeated", "seconds", "window", "error")},
            "table": vc.get("round_cost")}


def err(predicted: float | None, measured: float | None) -> float | None:
    return None if predicted is None or not measured else (predicted - measured) / measured


def study_command(args: argparse.Namespace) -> None:
    from pipeline.config import load_study
    from pipeline.config.study import resolve_space_path
    from pipeline.search.space import load_space
    from pipeline.study.driver import run_study

    rows = []
    for i in range(args.runs):
        name = f"first-launch-{args.engine}-{i}"
        output = Path(args.output).resolve() / f"run-{i}"
        if not (output / "study.yaml").exists():
            study = load_study(None, study_overrides(args.engine, name, output, args.threads))
            started = time.monotonic()
            code = run_study(study, load_space(resolve_space_path(study.search_space)))
            print(f"run {i}: study exit {code} in {time.monotonic() - started:.0f} s", flush=True)
        row = read_back(output, name)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "table"}, default=str), flush=True)
    print(f"\nmachine: {cpu_line()}; engine {args.engine}, engine.threads {args.threads}")
    print("| run | launched config | measured tok/s (spread) | predicted (logged) | error | re-derived | prefill "
          "charged by prompt length | error | prior shape | error | probe s / baseline measure s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        logged, online, prompt, prior = r["logged_prediction"], r["online"][0], r["prompt"][0], r["prior"][0]
        probe = f"{r['probe_s']:.1f} / {r['baseline_measure_s']:.1f}" if r["probe_s"] else "- (engine's own table)"
        logged_cells = f"{logged:.2f} | {err(logged, r['measured']):+.1%}" if logged else "- | -"
        print(f"| {i} | {r['config']} | {r['measured']:.2f} (±{r['spread'] or 0:.0%}) | {logged_cells} | "
              f"{online:.2f} | {prompt:.2f} | {err(prompt, r['measured']):+.1%} | {prior:.2f} | "
              f"{err(prior, r['measured']):+.1%} | {probe} |")
    print("\nprefix cache: " + "; ".join(f"run {i} {r['prefix_cache'] or 'none'} (disable_radix_cache="
                                        f"{r['disable_radix_cache']})" for i, r in enumerate(rows)))
    print("prefill line fitted on the baseline (ms): " + "; ".join(
        f"run {i} {r['online'][4]:.1f} + {r['online'][5]:.3f} x uncached tokens (by prompt length: "
        f"{r['prompt'][4]:.1f} + {r['prompt'][5]:.3f} x tokens)" for i, r in enumerate(rows)))
    print("\ndecode time of the launch's measured requests (sum of e2e - TTFT), predicted against measured:")
    for i, r in enumerate(rows):
        d = r["decode_measured_s"]
        print(f"  run {i}: measured {d:.3f} s; measured shape {r['online'][3]:.3f} s "
              f"({err(r['online'][3], d):+.1%}); prior {r['prior'][3]:.3f} s ({err(r['prior'][3], d):+.1%})")
    print("TTFT of the launch's measured requests (ms): " + "; ".join(
        f"run {i} predicted p50 {r['predicted_ttft_p50_ms'] or 0:.0f}, measured "
        + ", ".join(f"{t * 1000:.0f}" for t in r["measured_ttft_s"] if t) for i, r in enumerate(rows)))
    for name, key in (("logged prediction", "logged_prediction"), ("prefill by prompt length", "prompt"),
                      ("prior", "prior")):
        errors = [abs(err(r[key] if key == "logged_prediction" else r[key][0], r["measured"]) or 0.0) for r in rows
                  if r.get(key)]
        if errors:
            print(f"|error| {name}: median {statistics.median(errors):.1%} (max {max(errors):.1%}, n={len(errors)})")
    Path(args.output).mkdir(parents=True, exist_ok=True)
    (Path(args.output) / "first_launch.json").write_text(json.dumps(rows, indent=2, default=str))


def probe_command(args: argparse.Namespace) -> None:
    from pipeline.measure.shape import probe_shape
    from serve.engines.base import ReplicaConfig
    from serve.replica.deployment import EngineProcess
    from serve.spec import NoSpec

    levels = [int(x) for x in args.levels.split(",")]
    model = args.model or ("smollm2-135m" if args.engine != "llama_cpp" else "smollm2-135m")
    config = ReplicaConfig(engine=args.engine, device="cpu", model=model, spec=NoSpec(), threads=args.threads,
                           start_timeout_s=600, log_dir=tempfile.mkdtemp(prefix="first-launch-probe-"))
    process = EngineProcess(config)
    try:
        process.wait_ready()
        print(f"machine: {cpu_line()}; {args.engine} started in {process.startup_s:.1f} s", flush=True)
        for run in range(args.runs):
            record = probe_shape(process.url, args.engine, levels, attempts=1)
            table = record.pop("round_cost", None)
            print(json.dumps(record, default=str))
            if table:
                print(f"run {run}: {table['seconds']:.1f} s; step at {table['context_tokens']} tokens "
                      f"{table['short_context_ms']:.1f} ms, at {table['long_context_tokens']} "
                      f"{table['long_context_ms']:.1f} ms; logits: {table['logit_rows']}")
                print("| requests | " + " | ".join(f"w={w}" for w in table["widths"]) + " |")
                print("|---" * (len(table["widths"]) + 1) + "|")
                for b, row in zip(table["batches"], table["ms"]):
                    print(f"| {b} | " + " | ".join(f"{x:.1f}" for x in row) + " |")
    finally:
        process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    study = sub.add_parser("study", help="simulate-first studies; the first launch's predictions against it")
    study.add_argument("--engine", choices=("sglang", "cpu", "llama_cpp", "vllm"), default="sglang")
    study.add_argument("--runs", type=int, default=3)
    study.add_argument("--threads", type=int, default=1, help="engine.threads (the engines' own tests use 1 here)")
    study.add_argument("--output", default="runs/first-launch")
    probe = sub.add_parser("probe", help="the HTTP probe alone on a freshly started baseline engine")
    probe.add_argument("--engine", choices=("sglang", "llama_cpp", "cpu", "vllm"), default="sglang")
    probe.add_argument("--levels", default="1", help="concurrency levels the plan covers (comma-separated)")
    probe.add_argument("--runs", type=int, default=2)
    probe.add_argument("--threads", type=int, default=1)
    probe.add_argument("--model", default=None)
    args = parser.parse_args()
    if args.command == "study":
        study_command(args)
    else:
        probe_command(args)


if __name__ == "__main__":
    main()
