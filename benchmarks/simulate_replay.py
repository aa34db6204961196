"""simulate-first on a recorded grid (`search_efficiency.py record`, which keeps every request of every trial): the
pipeline's simulator (`pipeline.simulate`) built on the grid's recorded baseline run, exactly as a study builds it
on its baseline trial, against what every point measured.

- `accuracy`: accept lengths request by request (the measured `spec_verify_ct` / `completion_tokens` of every
  run of every NGRAM point against the replay: exact or not), and throughput: the median relative error of the
  prediction against the point's mean over its runs, and the rank correlation (Spearman) over the points, with the
  cost model fitted to the baseline alone (what the study knows before its first launch) and after one launch.
- `simulate_first`: the pipeline's launch order (`pipeline.search.simulated.rank` / `pick` after every refit, the cost
  model refitted on each launched point's recorded run), a seed choosing which recorded run a launch observes. It
  reports when the incumbent first is truly within 2% of the grid's best, and what the default budget (1 launch,
  widened while the median error exceeds the threshold) hands the promotion rule.
Engine-seconds are measured: a launch costs its point's mean `time_total_s` (engine start, warm-up, measurement) over
the recorded runs, for every method alike. Deterministic for a seed.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.search_replay import Point, Run, Surface, key, read_grid
from pipeline.config import StudyConfig, TrialConfig, load_study
from pipeline.measure.load import LoadRequest
from pipeline.measure.summary import RequestRecord
from pipeline.search.simulated import Predicted, misses, pick, rank
from pipeline.search.space import SearchSpace, resolve
from pipeline.simulate.cost import CostModel
from pipeline.simulate.simulator import Simulator, base_cost, relative_error
from pipeline.simulate.workload import answers_of
from pipeline.vocabulary.outcome import Outcome

__all__ = ["Recorded", "accuracy", "load_recorded", "simulate_first", "spearman"]


@dataclass
class Recorded:
    space: SearchSpace
    study: StudyConfig
    meta: dict[str, str]
    params: dict[Point, dict[str, Any]]
    records: dict[tuple[Point, int], list[RequestRecord]]  # (point, run) -> every request of that trial
    measured: dict[tuple[Point, int], float]  # (point, run) -> tput, completed runs only
    cost_s: dict[Point, float]  # mean engine-seconds of a launch of the point
    runs: int
    sim: Simulator | None = None

    def config(self, point: Point) -> TrialConfig:
        config = resolve(self.space, self.params[point], self.study).config
        if config is None:
            raise ValueError(f"point {self.params[point]} does not resolve")
        return config


def load_recorded(grid: Path, requests: Path) -> Recorded:
    import pyarrow.parquet as pq

    table, meta, space = read_grid(grid)
    study = load_study(None, {"seed": int(meta.get("seed", 0))})
    params: dict[Point, dict[str, Any]] = {}
    measured: dict[tuple[Point, int], float] = {}
    costs: dict[Point, list[float]] = {}
    index_of: dict[int, Point] = {}
    for row in table.to_pylist():
        p = json.loads(row["params"])
        point = key(p)
        params[point], index_of[row["point"]] = p, point
        if row["outcome"] == Outcome.COMPLETE.value and row["tput_tok_s"]:
            measured[point, row["run"]] = row["tput_tok_s"]
        if row.get("time_total_s"):
            costs.setdefault(point, []).append(row["time_total_s"])
    records: dict[tuple[Point, int], list[RequestRecord]] = {}
    for i, r in enumerate(pq.read_table(requests).to_pylist()):
        records.setdefault((index_of[r["point"]], r["run"]), []).append(RequestRecord(
            request_id=f"{r['phase']}-{i}", phase=r["phase"], prompt_index=r["prompt_index"], concurrency=1,
            start_s=r["start_s"], ttft_s=r["ttft_s"], e2e_s=r["e2e_s"], prompt_tokens=r["prompt_tokens"],
            completion_tokens=r["completion_tokens"], spec_verify_ct=r["spec_verify_ct"],
            spec_num_correct_drafts=r["spec_num_correct_drafts"], finish_reason="length",
            error=None if r["ok"] else "failed", output_ids=tuple(r["output_ids"]) if r["ok"] else (),
            prompt_ids=tuple(r["prompt_ids"]) or None))
    return Recorded(space, study, meta, params, records, measured,
                    {p: statistics.fmean(c) for p, c in costs.items()}, int(meta.get("runs", 1)))


def simulator_of(rec: Recorded, baseline: Point, run: int = 0) -> tuple[Simulator, CostModel]:
    """The simulator and the cost model a study builds on its baseline trial (the recorded baseline's `run`)."""
    records = rec.records[baseline, run]
    tokens = json.loads(rec.meta["max_new_tokens"])
    warmup = [LoadRequest(i, "", tokens[str(i)]) for i in json.loads(rec.meta["warmup_indexes"])]
    measure = [LoadRequest(i, "", tokens[str(i)]) for i in json.loads(rec.meta["measure_indexes"])]
    sim = Simulator(answers_of(records), warmup, measure, seed=rec.study.seed)
    base = base_cost(records, json.loads(rec.meta.get("verify_cost") or "{}"), 1)
    return sim, sim.fitted(base, [(rec.config(baseline), records)])


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(values: Sequence[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else float("nan")


def accuracy(rec: Recorded, surface: Surface, run: int = 0) -> dict[str, Any]:
    """Simulated vs measured on every point (module docstring), the simulator built on the baseline's recorded `run`
    (and refitted on the top point's same run)."""
    base = surface.baseline
    sim, cost = simulator_of(rec, base, run)
    started = time.monotonic()
    spec_points = [p for p in surface.mean if p != base and surface.complete[p]]
    exact = total = 0
    accept_pred, accept_meas = [], []
    for point in spec_points:
        replayed = sim.replay(rec.config(point)).phase("measure")
        # verify steps and output tokens define the accept length; correct-draft counts differ by convention in the
        # last, length-capped step (grids recorded before the engine counted those drafts as SGLang does)
        want = [(r.spec_verify_ct, r.completion_tokens) for r in replayed]
        for other in range(rec.runs):
            got = [(r.spec_verify_ct, r.completion_tokens) for r in rec.records.get((point, other), [])
                   if r.phase == "measure"]
            if got:
                exact += sum(a == b for a, b in zip(got, want))
                total += len(got)
        accept_pred.append(sum(r.completion_tokens for r in replayed) / max(1, sum(r.spec_verify_ct
                                                                                    for r in replayed)))
        accept_meas.append(surface.accept_len.get(point, float("nan")))
    simulate_s = time.monotonic() - started
    predicted = {p: sim.predict(rec.config(p), cost)["tput_tok_s"] for p in spec_points}
    errors = [relative_error(predicted[p], surface.mean[p]) or 0.0 for p in spec_points]
    # after one launch: the cost model refitted on the top predicted point's recorded run, as a study does
    top = max(spec_points, key=predicted.__getitem__)
    refit = sim.fitted(cost, [(rec.config(base), rec.records[base, run]),
                              (rec.config(top), rec.records[top, run])])
    after = {p: sim.predict(rec.config(p), refit)["tput_tok_s"] for p in spec_points if p != top}
    after_errors = [relative_error(after[p], surface.mean[p]) or 0.0 for p in after]
    return {
        "points": len(spec_points), "requests_exact": exact, "requests": total,
        "accept_max_abs_diff": max((abs(a - b) for a, b in zip(accept_pred, accept_meas)), default=0.0),
        "tput_median_error": statistics.median(errors), "tput_p90_error": sorted(errors)[int(0.9 * len(errors))],
        "tput_spearman": spearman([predicted[p] for p in spec_points], [surface.mean[p] for p in spec_points]),
        "after_one_median_error": statistics.median(after_errors) if after_errors else float("nan"),
        "after_one_spearman": spearman([after[p] for p in after], [surface.mean[p] for p in after])
        if len(after) > 2 else float("nan"),
        "cost": cost, "simulate_s": simulate_s, "predicted": predicted,
    }


@dataclass(frozen=True)
class SimulatedSearch:
    launched: tuple[tuple[Point, float], ...]  # baseline first, (point, observed tput)
    reached_after: int | None  # launches (baseline included) until the incumbent is truly within 2%
    reached_s: float | None  # their engine-seconds
    default_launches: int  # launches the default settings make (1 + widening)
    explore_s: float


def simulate_first(rec: Recorded, surface: Surface, seed: int, *, launches: int = 1, min_distance: int = 2,
                   threshold: float = 0.10, widen_by: int = 1, max_trials: int = 8) -> SimulatedSearch:
    """One replayed simulate-first study (module docstring): launches continue past the default budget until the
    incumbent is within 2% (or the grid is exhausted), so both figures come from one sequence."""
    base = surface.baseline
    run_of = lambda k: (seed + k) % rec.runs  # noqa: E731 - the recorded run launch k observes
    sim, cost = simulator_of(rec, base, run_of(0))
    started = time.monotonic()
    spec_points = [p for p in rec.params if p != base]
    configs = {p: rec.config(p) for p in spec_points}
    launched_records = [(rec.config(base), rec.records[base, run_of(0)])]
    seq: list[tuple[Point, float]] = [(base, rec.measured.get((base, run_of(0)), 0.0))]
    base_cost_model = cost
    budget, errors, default_launches = min(launches + 1, max_trials), [], None
    explore_s = 0.0
    target = 0.98 * surface.best
    reached_after = reached_s = None
    if surface.mean[base] >= target:  # the baseline is already within 2% (no config beats it)
        reached_after, reached_s = 1, rec.cost_s[base]
    while len(seq) < len(rec.params):
        t0 = time.monotonic()
        predicted = [Predicted(rec.params[p], configs[p], sim.predict(configs[p], cost)) for p in spec_points]
        explore_s += time.monotonic() - t0
        chosen = pick(rank(predicted, rec.study), 1, min_distance, [rec.params[p] for p, _ in seq[1:]])
        if not chosen:
            break
        point = key(chosen[0].params)
        run = run_of(len(seq))
        observed = rec.measured.get((point, run), 0.0)
        seq.append((point, observed))
        if observed and (point, run) in rec.records:
            errors.append(relative_error(chosen[0].figures.get("tput_tok_s"), observed))
            launched_records.append((configs[point], rec.records[point, run]))
            cost = sim.fitted(base_cost_model, launched_records)
        if default_launches is None:
            if len(seq) >= budget:
                missed = misses(errors, threshold)[1]
                if missed and budget < max_trials and widen_by:
                    budget = min(budget + widen_by, max_trials)
                else:
                    default_launches = len(seq)
        # the best observed so far, the baseline included (as search_replay.trials_to_reach counts it)
        incumbent = max((t for t in seq if t[1] > 0), key=lambda t: t[1], default=None)
        if reached_after is None and incumbent is not None and surface.mean[incumbent[0]] >= target:
            reached_after = len(seq)
            reached_s = sum(rec.cost_s[p] for p, _ in seq)
        if reached_after is not None and default_launches is not None:
            break
    return SimulatedSearch(tuple(seq), reached_after, reached_s, default_launches or len(seq), explore_s)


def as_run(search: SimulatedSearch, seed: int, launches: int) -> Run:
    """The first `launches` launches as a replay Run (for `search_replay.promote`)."""
    return Run("simulate-first", seed, search.launched[:launches])


def print_tables(rec: Recorded, surface: Surface, seeds: int, policy: Any) -> None:
    """The two markdown tables of docs/benchmarks.md's "Predict" section."""
    from benchmarks.search_replay import promote, run_method, trials_to_reach

    acc = accuracy(rec, surface)
    cost: CostModel = acc["cost"]
    print(f"\n- simulator: built on the recorded baseline run 0 ({len(rec.records[surface.baseline, 0])} requests, "
          f"warm-up split answered); step cost: {cost.shape} shape, k={cost.k:.3g}, o={cost.o_ms:.2f} ms, prefill "
          f"{cost.p0_ms:.1f} + {cost.p1_ms:.3f}/token ms, client gap {cost.gap_s * 1000:.1f} ms; replaying the "
          f"{acc['points']} NGRAM points took {acc['simulate_s']:.1f} s\n")
    print("| figure | simulated vs measured |\n|---|---|")
    print(f"| accept length, request by request (verify steps and output tokens of every measured request, every "
          f"run) | {acc['requests_exact']}/{acc['requests']} identical |")
    print(f"| accept length per point, largest difference | {acc['accept_max_abs_diff']:.3f} |")
    print(f"| throughput, median abs. error (cost fitted to the baseline only) | {acc['tput_median_error']:.1%} "
          f"(p90 {acc['tput_p90_error']:.1%}) |")
    print(f"| throughput, rank correlation (Spearman) | {acc['tput_spearman']:.2f} |")
    print(f"| throughput after one launch refits the cost: median abs. error, Spearman (other points) | "
          f"{acc['after_one_median_error']:.1%}, {acc['after_one_spearman']:.2f} |")
    # One baseline run carries its run-to-run noise into every prediction: what a study sees is one of them.
    runs = [acc, *(accuracy(rec, surface, r) for r in range(1, rec.runs))]
    for label, field in (("before a launch", "tput_median_error"), ("after one launch", "after_one_median_error")):
        errors = [a[field] for a in runs]
        listed = ", ".join(f"{e:.1%}" for e in errors)
        print(f"| throughput, median abs. error {label}, each recorded baseline run as the study's (runs 0-"
              f"{rec.runs - 1}) | {listed} (median {statistics.median(errors):.1%}) |")
    print()
    n = len(surface.mean)
    grid_s = sum(rec.cost_s[p] for p in surface.mean)
    base = surface.mean[surface.baseline]
    rows: dict[str, dict[str, list[float]]] = {m: {"reach": [], "reach_s": [], "launches": [], "spent_s": [],
                                                   "speedup": [], "near": []} for m in ("grid", "optuna",
                                                                                        "simulate-first")}
    today: dict[int, float] = {}
    for seed in range(seeds):
        for method in ("grid", "optuna"):
            run = run_method(surface, method, seed, n, max_trials=8)
            needed = trials_to_reach(surface, run)
            r = rows[method]
            r["reach"].append(needed or math.inf)
            r["reach_s"].append(sum(rec.cost_s[p] for p, _ in run.trials[:needed]) if needed else math.inf)
            budget = n if method == "grid" else 8
            chosen = promote(surface, run, budget, seed, finalists=policy.finalists, runs=policy.runs, policy=policy)
            r["launches"].append(budget)
            r["spent_s"].append(sum(rec.cost_s[p] for p, _ in run.trials[:budget]))
            r["speedup"].append(surface.mean[chosen.noise_aware] / base)
            r["near"].append(surface.mean[chosen.noise_aware] >= 0.98 * surface.best)
            if method == "optuna":
                today[seed] = surface.mean[chosen.noise_aware]
        search = simulate_first(rec, surface, seed)
        r = rows["simulate-first"]
        r["reach"].append(search.reached_after or math.inf)
        r["reach_s"].append(search.reached_s or math.inf)
        chosen = promote(surface, as_run(search, seed, search.default_launches), search.default_launches, seed,
                         finalists=policy.finalists, runs=policy.runs, policy=policy)
        r["launches"].append(search.default_launches)
        r["spent_s"].append(sum(rec.cost_s[p] for p, _ in search.launched[:search.default_launches]))
        r["speedup"].append(surface.mean[chosen.noise_aware] / base)
        r["near"].append(surface.mean[chosen.noise_aware] >= 0.98 * surface.best)
        r.setdefault("vs_today", []).append(surface.mean[chosen.noise_aware] >= 0.98 * today[seed])
    fmt = lambda x: "never" if x == math.inf else f"{x:.0f}"  # noqa: E731
    print(f"- engine-seconds: a launch costs its point's mean measured `time_total_s`; every point once (the grid): "
          f"{grid_s:.0f} engine-s; {seeds} seeds (which recorded run a launch observes; TPE's noise for optuna)\n")
    print("| method | launches to within 2% of best: median | engine-s to within 2%: median | share of the grid's "
          "engine-s | launches at its budget | engine-s at its budget | promoted speed-up, median | promoted within 2% "
          "of the best | promoted within 2% of today's search's or better |\n|---|---|---|---|---|---|---|---|---|")
    for method, label in (("grid", "grid (every point, file order)"), ("optuna", "today's search (TPE, 8 trials)"),
                          ("simulate-first", "simulate-first (default: 1 launch + widening)")):
        r = rows[method]
        med_s = statistics.median(r["reach_s"])
        vs = r.get("vs_today")
        print(f"| {label} | {fmt(statistics.median(r['reach']))} | {fmt(med_s)} | "
              f"{'-' if med_s == math.inf else f'{med_s / grid_s:.1%}'} | {statistics.median(r['launches']):.0f} | "
              f"{statistics.median(r['spent_s']):.0f} | {statistics.median(r['speedup']):.2f}x | "
              f"{sum(r['near'])}/{seeds} | {f'{sum(vs)}/{seeds}' if vs else '-'} |", flush=True)
