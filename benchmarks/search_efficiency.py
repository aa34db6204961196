"""Benchmark: how fast our search finds a near-best config, and whether it ever deploys a slower one.

Two steps. `record` measures every point of an enumerable search space (default `search_spaces/grid-small.yaml`)
on the CPU engine with the normal trial protocol (`pipeline.trial.lifecycle.run_trial`: Serve replica, flush, warm-up,
measure, equivalence against the baseline, MLflow), every point `--runs` times (run after run, for the run-to-run
noise), with simulate-first's context (prompt ids recorded, the baseline answering the whole warm-up split), and
writes one Parquet row per measurement to `benchmarks/data/<grid>.parquet` and every request of every trial to
`<grid>-requests.parquet`. `replay` then treats that grid as a response surface with the measured noise
(`benchmarks/search_replay.py`) and compares, over many seeds: our Optuna configuration, random search, the full grid
and a one-knob-at-a-time tier search; with the requests file, also the simulator's predictions against every point
and simulate-first's launches (`benchmarks/simulate_replay.py`). The replay is a replay of measured data, not new
measurements, and is deterministic for a seed.

    python benchmarks/search_efficiency.py record --quick   # 31 points x 3 runs on 2 cores
    python benchmarks/search_efficiency.py record           # twice the measured prompts and tokens
    python benchmarks/search_efficiency.py record --quick --workload code-edit   # the same grid, a second workload
    python benchmarks/search_efficiency.py replay --quick   # 20 seeds, ~1 min

`replay` prints a second table: trials and engine-seconds to within 2% of the best, early stopping
(`pipeline.decide.stopping`) off and on, and the rule's stop rates on the grid (false stops: points within 2% of the best).
    python benchmarks/search_efficiency.py replay           # 100 seeds
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.search_replay import (METHODS, EarlyStop, Surface, engine_seconds, key, promote,  # noqa: E402
                                      read_grid, run_method, stop_rates, trials_to_reach, warmup_requests)
from pipeline.decide.stopping import StoppingPolicy, VerifyCost  # noqa: E402
from pipeline.vocabulary.outcome import Outcome  # noqa: E402

DATA = ROOT / "benchmarks" / "data"
# --quick measures with the default study's workload (templated, 4 prompts x 24 tokens); the full record doubles the
# measured prompts and tokens, so each point's number is steadier.
FULL_WORKLOAD = {"workload.warmup_prompts": 8, "workload.measure_prompts": 8, "workload.max_new_tokens": 48}
# The CPU engine's verify-cost curve for the early-stopping replay of a grid recorded without one (a recording keeps its
# engine's own curve in its metadata): the verify-cost curve `benchmarks/cpu_engine_ab.py --only verify` at commit 04695d1 measured (2
# threads) for the forward the first grid was recorded with; the cheaper (more lenient) of the two measured curves.
GRID_VERIFY_COST = VerifyCost(sizes=tuple(range(1, 17)), relative=(1.00, 0.99, 1.19, 1.45, 1.38, 1.75, 1.78, 1.78,
                                                                   1.88, 2.05, 2.17, 2.17, 2.31, 2.39, 2.47, 2.07))


def record(space_name: str, out: Path, quick: bool, runs: int, workload: str | None = None,
           settings: dict | None = None) -> None:
    """Every point of the space measured `runs` times, run after run (all points once, then again: drift spreads
    over every point alike), after one unrecorded launch of the baseline (the machine's one-time first-launch cost),
    on fresh trials through `run_trial` with simulate-first's context (requests record
    their prompt ids; the baseline answers the whole warm-up split), so the simulator can replay the baseline.
    Writes `out` (one row per measurement) and `<out stem>-requests.parquet` (every request of every trial)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from pipeline.config import load_study
    from pipeline.measure.summary import to_records
    from pipeline.records.tracking import Tracker, default_tracking_uri
    from pipeline.search.space import grid_points, load_space, resolve
    from pipeline.study.driver import build_context, connect_ray
    from pipeline.trial.lifecycle import run_trial
    from serve.spec import draft_token_count

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per downloaded file otherwise
    overrides = {"name": "grid", "search_space": space_name, **({} if quick else FULL_WORKLOAD),
                 **({"workload.source": workload} if workload else {}), **(settings or {})}
    study = load_study(None, overrides)
    space_path = study.search_space_path()
    space = load_space(space_path)
    points = grid_points(space)
    folder = Path(tempfile.mkdtemp(prefix="specdec-grid-"))
    tracker = Tracker(default_tracking_uri(folder), "grid", artifact_dir=folder / "mlartifacts")
    parent = tracker.start_study("grid", "", resume=False)
    ctx = build_context(study, folder, connect_ray(study.name, "local"), tracker, parent, simulated=True)
    print(f"recording {len(points)} points of {space_path.name} x {runs} runs into {out}; MLflow: {folder}",
          flush=True)
    rows: list[dict] = []
    requests: list[dict] = []
    verify_cost: dict = {}
    started = time.monotonic()

    def measure(index: int, params: dict, run: int) -> None:
        resolution = resolve(space, params, study)
        result = run_trial(ctx, f"p{index}-r{run}", resolution)
        s = result.summary
        client = tracker.client()
        metrics = client.get_run(result.run_id).data.metrics if result.run_id else {}
        rows.append({"point": index, "run": run, "params": json.dumps(params, sort_keys=True),
                     "algorithm": params["algorithm"], "outcome": result.outcome.value, "reason": result.reason[:500],
                     "tput_tok_s": s.tput_tok_s if s else None, "accept_len": s.accept_len if s else None,
                     "draft_tokens": draft_token_count(resolution.config.spec) if resolution.config else 0,
                     "time_total_s": metrics.get("time_total_s"), "time_measure_s": metrics.get("time_measure_s")})
        if result.run_id:
            with tempfile.TemporaryDirectory() as tmp:
                table = pq.read_table(client.download_artifacts(result.run_id, "requests.parquet", tmp))
                if index == 0 and not verify_cost:
                    info = json.loads(Path(client.download_artifacts(result.run_id, "server_info.json",
                                                                     tmp)).read_text())
                    verify_cost.update(info.get("verify_cost") or {})
            for r in to_records(table):
                requests.append({"point": index, "run": run, "phase": r.phase, "prompt_index": r.prompt_index,
                                 "ok": r.ok, "start_s": r.start_s, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
                                 "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                                 "spec_verify_ct": r.spec_verify_ct,
                                 "spec_num_correct_drafts": r.spec_num_correct_drafts,
                                 "prompt_ids": list(r.prompt_ids or ()), "output_ids": list(r.output_ids)})
        print(f"  point {index} run {run}: {result.outcome.value} {rows[-1]['tput_tok_s'] or 0:.2f} tok/s  {params}",
              flush=True)

    # A machine's first launch pays once what no later launch pays (the engine's verify-cost probe, whose curve is
    # then cached; Serve's first deployment). Every method's first launch is the same baseline, so that cost is one
    # constant per study, not a property of a point: one unrecorded launch takes it before the grid.
    warm = run_trial(ctx, "warm", resolve(space, points[0], study))
    print(f"  unrecorded first launch (baseline): {warm.outcome.value}", flush=True)
    for run in range(runs):
        for i, params in enumerate(points):
            measure(i, params, run)
    meta = {"space_file": space_path.name, "space_yaml": space_path.read_text(), "model": study.model.target,
            "workload": study.workload.model_dump_json(), "engine": study.engine.kind, "runs": runs,
            "warmup_indexes": json.dumps([w.index for w in ctx.warmup]),
            "measure_indexes": json.dumps([m.index for m in ctx.measure]),
            "max_new_tokens": json.dumps({str(r.index): r.max_new_tokens for r in (*ctx.warmup, *ctx.measure)}),
            "verify_cost": json.dumps(verify_cost), "seed": study.seed,
            "machine": _machine(), "threads": str(torch.get_num_threads()),
            "torch": torch.__version__, "recorded": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "seconds": f"{time.monotonic() - started:.0f}",
            "command": "python benchmarks/search_efficiency.py record" + (" --quick" if quick else "")
            + (f" --workload {workload}" if workload else "") + (f" --space {space_name}"
                                                                 if space_name != "grid-small" else "")
            + "".join(f" --set {k}={json.dumps(v)}" for k, v in (settings or {}).items())}
    table = pa.Table.from_pylist(rows).replace_schema_metadata({k: str(v) for k, v in meta.items()})
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out)
    pq.write_table(pa.Table.from_pylist(requests), requests_path(out))
    print(f"wrote {len(rows)} measurements to {out} and {len(requests)} requests to {requests_path(out)} "
          f"in {time.monotonic() - started:.0f} s")


def requests_path(grid: Path) -> Path:
    return grid.with_name(f"{grid.stem}-requests.parquet")


def _machine() -> str:
    """CPU model and the ISA flags that decide the kernels, from /proc/cpuinfo."""
    model = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    return f"{platform.machine()} {model}, {os.cpu_count()} CPUs, flags {' '.join(isa) or '-'}"


def load_surface(path: Path) -> tuple[Surface, dict[str, str]]:
    table, meta, space = read_grid(path)
    by_point: dict = {}
    for row in table.to_pylist():
        by_point.setdefault(key(json.loads(row["params"])), []).append(row)
    mean, complete, drafts, accepts, log_devs = {}, {}, {}, {}, []
    for point, rows in by_point.items():
        ok = [r["tput_tok_s"] for r in rows if r["outcome"] == Outcome.COMPLETE.value and r["tput_tok_s"]]
        complete[point] = len(ok) == len(rows)  # one failed equivalence check disqualifies the point
        mean[point] = statistics.fmean(ok) if ok else 0.0
        drafts[point] = rows[0]["draft_tokens"]
        accept = [r["accept_len"] for r in rows if r["outcome"] == Outcome.COMPLETE.value and r.get("accept_len")]
        if accept:
            accepts[point] = statistics.fmean(accept)
        if len(ok) >= 2:
            logs = [math.log(x) for x in ok]
            centre = statistics.fmean(logs)
            log_devs.append((sum((x - centre) ** 2 for x in logs), len(logs) - 1))
    sigma = math.sqrt(sum(s for s, _ in log_devs) / sum(d for _, d in log_devs)) if log_devs else 0.0
    return Surface(space, mean, complete, drafts, sigma, accepts), meta


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def replay(path: Path, seeds: int, budget: int | None, startup: int | None) -> None:
    from pipeline.config import load_study
    from pipeline.search.space import startup_trials

    policy = load_study(None, {}).promotion  # the default study's promotion policy
    surface, meta = load_surface(path)
    n = len(surface.mean)
    budget = budget or math.ceil(0.25 * n)
    base = surface.mean[surface.baseline]
    best_point = max((p for p in surface.mean if surface.complete[p]), key=surface.mean.__getitem__)
    near = sum(1 for p, v in surface.mean.items() if surface.complete[p] and v >= 0.98 * surface.best)
    slower = sum(1 for p, v in surface.mean.items() if p != surface.baseline and surface.complete[p] and v < base)
    print(f"- data: `{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}` ({meta.get('command')}, "
          f"{meta.get('recorded', '?')[:10]}; {meta.get('machine')}, model {meta.get('model')}, workload "
          f"{meta.get('workload')})\n- grid: {n} points of {meta.get('space_file')}; baseline {base:.2f} tok/s; best "
          f"{surface.best:.2f} tok/s ({surface.best / base:.2f}x) at {dict(best_point)}; {near} point(s) within 2% "
          f"of it; {slower} completed point(s) slower than the baseline; "
          f"{sum(1 for c in surface.complete.values() if not c)} failed\n"
          f"- noise: sigma of log throughput = {surface.sigma:.3f} (pooled over the repeated points)\n"
          f"- replay: {seeds} seeds per method, each run over the whole grid's length; the sampler configured for a "
          f"{budget}-trial study ({startup or startup_trials(budget)} random start-up trials"
          f"{', forced by --startup-trials' if startup else ', the pipeline rule'}); "
          f"promotion after {budget} trials with the default study's rule ({policy.finalists}"
          f" finalist(s), {policy.runs} fresh re-runs each and of the baseline, margin {policy.margin:.0%})\n")
    print("| method | trials to within 2% of best: median | p90 | never (of seeds) | median as share of grid | "
          "within 5%: median | promoted slower than baseline | naive pick slower than baseline | "
          "deployed speed-up, median |\n|---|---|---|---|---|---|---|---|---|")
    for method in METHODS:
        reached, reached5, never, slow, naive_slow, speedups = [], [], 0, 0, 0, []
        for seed in range(seeds):
            run = run_method(surface, method, seed, n, max_trials=budget, startup=startup)
            needed = trials_to_reach(surface, run)
            if needed is None:
                never += 1
            reached.append(needed if needed is not None else math.inf)
            reached5.append(trials_to_reach(surface, run, within=0.05) or math.inf)
            chosen = promote(surface, run, budget, seed, finalists=policy.finalists, runs=policy.runs,
                             policy=policy)
            deployed = surface.mean[chosen.noise_aware]
            slow += deployed < base
            naive_slow += surface.mean[chosen.naive] < base or not surface.complete[chosen.naive]
            speedups.append(deployed / base)
        med, p90 = statistics.median(reached), _pct(reached, 0.9)
        fmt = lambda x: "never" if x == math.inf else f"{x:g}"  # noqa: E731
        print(f"| {method} | {fmt(med)} | {fmt(p90)} | {never}/{seeds} | "
              f"{'-' if med == math.inf else f'{med / n:.0%}'} | {fmt(statistics.median(reached5))} | "
              f"{slow}/{seeds} | {naive_slow}/{seeds} | "
              f"{statistics.median(speedups):.2f}x |", flush=True)


def replay_early_stopping(path: Path, seeds: int, budget: int | None, startup: int | None, request_sigma: float,
                          start_s: float, verify_cost: bool, repeats: int, requests: int | None = None,
                          alpha: float | None = None) -> None:
    """Trials and engine-seconds to within 2% of the grid's best, per method, early stopping off and on, and the
    rule's stop rates on the recorded grid (the model of the per-request measurement: search_replay's docstring)."""
    from pipeline.config import load_study

    policy = load_study(None, {}).promotion
    surface, meta = load_surface(path)
    workload = json.loads(meta.get("workload", "{}"))
    n = len(surface.mean)
    budget = budget or math.ceil(0.25 * n)
    recorded = json.loads(meta.get("verify_cost") or "{}")  # the recording engine's own curve, when it kept one
    curve = (VerifyCost(sizes=tuple(recorded["sizes"]), relative=tuple(recorded["relative"]))
             if recorded.get("sizes") else GRID_VERIFY_COST)
    curve_name = ("the recording engine's own curve (its /server_info)" if recorded.get("sizes")
                  else "the CPU engine curve (GRID_VERIFY_COST)")
    on = EarlyStop(enabled=True, requests=requests or int(workload.get("measure_prompts", 4)),
                   tokens=int(workload.get("max_new_tokens", 24)), request_sigma=request_sigma, start_s=start_s,
                   verify_cost=curve if verify_cost else None,
                   policy=StoppingPolicy(alpha=alpha) if alpha else StoppingPolicy())
    off = dataclasses.replace(on, enabled=False)
    base_mean = surface.mean[surface.baseline]
    grid_total = sum(start_s + (warmup_requests(p) + on.requests) * on.tokens / (v or base_mean)
                     for p, v in surface.mean.items())
    print(f"\n- early stopping: `pipeline.decide.stopping` (alpha {on.policy.alpha}, >= {on.policy.min_requests} requests, "
          f"per-request spread floor {on.policy.request_spread_floor}), checked after each of the first "
          f"{on.requests - 1} of {on.requests} measured requests x {on.tokens} tokens; per-request spread "
          f"{request_sigma} (assumed: the grid has no per-request traces); verify cost "
          f"{curve_name if verify_cost else 'off (cost 1, as for SGLang)'}; "
          f"baseline step time = 1 / the run's baseline throughput\n- engine-seconds per trial: {start_s} s start "
          f"+ warm-up and measured requests at the point's modelled speed; every point once without stopping "
          f"(the grid): {grid_total:.0f} engine-s\n")
    print("| method | early stopping | trials to within 2%: median | p90 | never | engine-s to within 2%: median | "
          "p90 | median as share of the grid's engine-s | trials stopped | promoted slower than baseline | "
          "deployed speed-up, median |\n|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda x: "never" if x == math.inf else f"{x:.0f}"  # noqa: E731
    for method in METHODS:
        for label, early in (("off", off), ("on", on)):
            trials, seconds, never, stopped, ran, slow, speedups = [], [], 0, 0, 0, 0, []
            for seed in range(seeds):
                run = run_method(surface, method, seed, n, max_trials=budget, startup=startup, early=early)
                needed = trials_to_reach(surface, run)
                never += needed is None
                trials.append(math.inf if needed is None else needed)
                cost = engine_seconds(run, needed)
                seconds.append(math.inf if cost is None else cost)
                stopped += sum(1 for k in run.stopped if k)
                ran += len(run.trials)
                chosen = promote(surface, run, budget, seed, finalists=policy.finalists, runs=policy.runs,
                                 policy=policy)
                slow += surface.mean[chosen.noise_aware] < base_mean
                speedups.append(surface.mean[chosen.noise_aware] / base_mean)
            med_s = statistics.median(seconds)
            print(f"| {method} | {label} | {fmt(statistics.median(trials))} | {fmt(_pct(trials, 0.9))} | "
                  f"{never}/{seeds} | {fmt(med_s)} | {fmt(_pct(seconds, 0.9))} | "
                  f"{'-' if med_s == math.inf else f'{med_s / grid_total:.0%}'} | {stopped / ran:.0%} | "
                  f"{slow}/{seeds} | {statistics.median(speedups):.2f}x |", flush=True)
    rates = stop_rates(surface, on, repeats, seed=0)
    share = lambda c: f"{c[0]}/{c[1]} ({c[0] / c[1]:.2%})" if c[1] else "-"  # noqa: E731
    print(f"\nStop rates, every completed point measured {repeats} times with fresh noise against a fresh baseline "
          f"run: points within 2% of the best stopped {share(rates.near_best)}; points faster than the baseline "
          f"{share(rates.faster)}; points slower than the baseline {share(rates.slower)}, saving "
          f"{rates.requests_saved:.0%} of their measured requests.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    sub = parser.add_subparsers(dest="step", required=True)
    rec = sub.add_parser("record", help="measure every grid point on the CPU engine (slow)")
    rec.add_argument("--quick", action="store_true",
                     help="the default study's workload (4 measured prompts x 24 tokens) instead of 8 x 48")
    rec.add_argument("--space", default="grid-small", help="an enumerable search space (name or path)")
    rec.add_argument("--runs", type=int, default=3, help="measurements of every point (>= 2: the noise)")
    rec.add_argument("--workload", help="another workload than the default study's (bundled name or file)")
    rec.add_argument("--out", type=Path, help="Parquet file (default benchmarks/data/<space>[-quick].parquet)")
    rec.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                     help="a study key for every trial, as `pipeline.tune --set` "
                     "(e.g. model.target=qwen2.5-coder-1.5b)")
    rep = sub.add_parser("replay", help="compare search methods on a recorded grid (fast, deterministic)")
    rep.add_argument("--quick", action="store_true", help="20 seeds instead of 100")
    rep.add_argument("--data", type=Path, help="recorded grid (default: benchmarks/data/grid-small-quick.parquet)")
    rep.add_argument("--seeds", type=int, help="seeds per method")
    rep.add_argument("--budget", type=int, help="the study's trial budget: the sampler's configuration and the "
                     "trials before promotion (default: 25%% of the grid)")
    rep.add_argument("--startup-trials", type=int, help="random trials before TPE models (default: the pipeline's "
                     "rule, pipeline.search.space.startup_trials; Optuna's own default is 10)")
    rep.add_argument("--request-sigma", type=float, default=0.15, help="early-stopping table: sd of per-request log "
                     "throughput within a run (the grid has none; default 0.15)")
    rep.add_argument("--engine-start-s", type=float, default=12.1, help="early-stopping table: engine start per "
                     "trial in seconds (default 12.1, the overhead table's median)")
    rep.add_argument("--no-verify-cost", action="store_true", help="early-stopping table: no verify-cost curve "
                     "(cost 1, as for SGLang), so the analytic bound is looser")
    rep.add_argument("--measure-requests", type=int, help="early-stopping table: measured requests per trial "
                     "(default: the recorded workload's measure_prompts); more requests give the rule more looks")
    rep.add_argument("--alpha", type=float, help="early-stopping table: the rule's one-sided miss probability per "
                     "bound and look (default: pipeline.decide.stopping.StoppingPolicy's)")
    rep.add_argument("--stop-repeats", type=int, default=200, help="fresh trials per point for the stop rates")
    args = parser.parse_args()
    if args.step == "record":
        if args.runs < 2:
            parser.error(f"--runs {args.runs}: the noise needs at least 2 measurements of a point")
        stem = Path(args.space).stem + (f"-{Path(args.workload).stem}" if args.workload else "") \
            + ("-quick" if args.quick else "")
        settings = {}
        for item in args.settings:
            name, sep, raw = item.partition("=")
            if not sep or not name:
                parser.error(f"--set {item!r}: expected KEY=VALUE, e.g. --set model.target=qwen2.5-coder-1.5b")
            settings[name.strip()] = yaml.safe_load(raw)
        record(args.space, args.out or DATA / f"{stem}.parquet", args.quick, args.runs, args.workload, settings)
    else:
        data = args.data or DATA / "grid-small-quick.parquet"
        if not data.exists():
            parser.error(f"--data {data}: no such file; record it first (python benchmarks/search_efficiency.py "
                         f"record --quick)")
        if args.startup_trials is not None and args.startup_trials < 1:
            parser.error(f"--startup-trials {args.startup_trials}: give a number >= 1")
        for name in ("request_sigma", "engine_start_s"):
            if getattr(args, name) < 0:
                parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: give a number >= 0")
        if args.measure_requests is not None and args.measure_requests < 2:
            parser.error(f"--measure-requests {args.measure_requests}: give a number >= 2")
        if args.alpha is not None and not 0 < args.alpha < 0.5:
            parser.error(f"--alpha {args.alpha}: give a probability in (0, 0.5)")
        if args.stop_repeats < 1:
            parser.error(f"--stop-repeats {args.stop_repeats}: give a number >= 1")
        seeds = args.seeds or (20 if args.quick else 100)
        replay(data, seeds, args.budget, args.startup_trials)
        replay_early_stopping(data, seeds, args.budget, args.startup_trials, args.request_sigma,
                              args.engine_start_s, not args.no_verify_cost, args.stop_repeats,
                              args.measure_requests, args.alpha)
        if requests_path(data).exists():  # recorded with every request: the simulator's tables too
            from benchmarks.simulate_replay import load_recorded, print_tables
            from pipeline.config import load_study

            surface, _ = load_surface(data)
            print_tables(load_recorded(data, requests_path(data)), surface, seeds, load_study(None, {}).promotion)


if __name__ == "__main__":
    main()
