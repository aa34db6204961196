"""Replay a measured grid as a response surface and compare search methods on it (pure; no engine, no Ray).

The surface holds, for every point of a search space, the throughput measured with the normal trial protocol and
its outcome. A replayed trial returns the point's mean throughput times exp(sigma * z), z ~ N(0, 1), where sigma is
the run-to-run noise measured on repeated points; a point whose measurement failed (e.g. NOT_EQUIVALENT) returns 0,
as a failed trial reports to Optuna in the pipeline. Everything is seeded: the same seed gives the same numbers.

Methods, each starting with the baseline as trial 0, as the pipeline does:
- `optuna`: the pipeline's searcher (`pipeline.search.space.tpe_sampler`) over `define_by_run(space)`, baseline enqueued;
- `random`: Optuna's RandomSampler over the same define-by-run space;
- `grid`: every point once, in the file's order;
- `tier`: one knob at a time (SGLang auto_benchmark's tier 1, run to convergence): from the space's defaults, sweep
  each knob with the others at the incumbent, move to the best observed, repeat passes until nothing is new.

Early stopping (`EarlyStop`, the rule in `pipeline.decide.stopping`): the recorded grid holds per-point means, the noise and
accept lengths, not per-request traces. So a replayed trial's requests are modelled: the trial's run-level value v
is drawn as above, then each of `requests` requests gets throughput v * exp(request_sigma * e), e ~ N(0, 1), and
the point's recorded accept length (the same for every request: the grid has no per-request figure). The rule is
checked after every request but the last, against the run's own baseline trial (trial 0, one run, the surface's
sigma). A stopped trial reports its partial throughput (to Optuna as PRUNED with that intermediate value) and costs
only the requests it ran. Engine-seconds per trial = `start_s` + warm-up requests * tokens / v + the measured
requests' modelled latencies. The per-request draws come from their own seeded stream, so a run without early
stopping observes exactly the values it did before this model existed.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.config import PromotionPolicy
from pipeline.decide.decision import Finalist, decide
from pipeline.measure.summary import RequestRecord
from pipeline.decide.stopping import BaselineFigures, StoppingPolicy, VerifyCost, check
from pipeline.search.space import (FixedParam, SearchSpace, baseline_point, define_by_run, enqueue_baseline,
                                   grid_points, tpe_sampler)

METHODS = ("optuna", "random", "grid", "tier")
Point = tuple[tuple[str, Any], ...]  # a canonical, hashable point: sorted resolve-params items


def key(params: dict[str, Any]) -> Point:
    return tuple(sorted(params.items()))


def read_grid(path: Any) -> tuple[Any, dict[str, str], SearchSpace]:
    """A recorded grid's Arrow table, its metadata and the search space it was recorded on (kept in the metadata)."""
    import os
    import tempfile

    import pyarrow.parquet as pq

    from pipeline.search.space import load_space

    table = pq.read_table(path)
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(meta["space_yaml"])
    try:
        return table, meta, load_space(f.name)
    finally:
        os.unlink(f.name)


@dataclass(frozen=True)
class Surface:
    """Measured means per point (0 where the point did not complete), the noise, and the draft tokens per point."""

    space: SearchSpace
    mean: dict[Point, float]
    complete: dict[Point, bool]
    draft_tokens: dict[Point, int]
    sigma: float
    accept_len: dict[Point, float] = field(default_factory=dict)  # recorded mean accept length (spec points)

    @property
    def baseline(self) -> Point:
        return key({"algorithm": "none", **baseline_point(self.space)})

    @property
    def best(self) -> float:
        return max(v for p, v in self.mean.items() if self.complete[p])

    def observe(self, point: Point, rng: np.random.Generator) -> float:
        if point not in self.mean:
            raise KeyError(f"point {dict(point)} is not in the measured grid")
        if not self.complete[point]:
            return 0.0
        return self.mean[point] * math.exp(self.sigma * rng.standard_normal())


@dataclass(frozen=True)
class EarlyStop:
    """The per-request model and the engine-seconds model of a replayed trial (see the module docstring);
    `enabled=False` keeps the cost model and turns the rule off."""

    enabled: bool = True
    requests: int = 4  # measured requests per trial: the default study's workload.measure_prompts
    tokens: int = 24  # completion tokens per request: the default study's workload.max_new_tokens
    request_sigma: float = 0.15  # sd of per-request log throughput within a run: not in the grid, assumed
    start_s: float = 12.1  # engine start per trial (docs/benchmarks.md, overhead table, median)
    verify_cost: VerifyCost | None = None
    policy: StoppingPolicy = StoppingPolicy()


@dataclass(frozen=True)
class Seen:
    value: float
    stopped_at: int  # measured requests after which the rule stopped the trial; 0 = ran to the end
    cost_s: float  # engine-seconds


def warmup_requests(point: Point) -> int:
    return int(sum(v for k, v in point if k.endswith("warmup_requests")))


def simulate_trial(surface: Surface, point: Point, value: float, baseline: float | None, early: EarlyStop,
                   rng: np.random.Generator) -> Seen:
    """One replayed trial's requests around its run-level `value`, the rule after each (when `baseline`, the run's
    baseline observation, is known and the point is not the baseline) and its engine-seconds."""
    draws = rng.standard_normal(early.requests)  # drawn whether or not the rule runs: same stream either way
    speed = value if value > 0 else (baseline or surface.mean[surface.baseline])  # a failed point still ran
    warm_s = warmup_requests(point) * early.tokens / speed
    e2e = [early.tokens / (speed * math.exp(early.request_sigma * d)) for d in draws]
    full = Seen(value, 0, early.start_s + warm_s + sum(e2e))
    drafts = surface.draft_tokens.get(point, 0)
    if not early.enabled or baseline is None or point == surface.baseline or value <= 0:
        return full
    accept = surface.accept_len.get(point)
    figures = BaselineFigures(tput_tok_s=baseline, sigma=surface.sigma, runs=1, step_s=1 / baseline)
    records: list[RequestRecord] = []
    for i, seconds in enumerate(e2e[:-1]):  # after the last request the trial is complete: nothing to save
        records.append(RequestRecord(
            request_id=str(i), phase="measure", prompt_index=i, concurrency=1, start_s=sum(e2e[:i]), ttft_s=None,
            e2e_s=seconds, prompt_tokens=1, completion_tokens=early.tokens,
            spec_verify_ct=max(1, round(early.tokens / accept)) if drafts and accept else None,
            finish_reason="length"))
        result = check(figures, records, total_requests=early.requests, draft_tokens=drafts,
                       max_new_tokens=early.tokens, verify_cost=early.verify_cost, policy=early.policy)
        if result.stop:
            return Seen(result.partial_tok_s or 0.0, i + 1, early.start_s + warm_s + sum(e2e[:i + 1]))
    return full


Observe = Callable[[dict[str, Any]], Seen]


def _optuna(surface: Surface, seed: int, budget: int, observe: Observe, sampler_kind: str, max_trials: int,
            startup: int | None) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = (tpe_sampler(seed, max_trials, startup) if sampler_kind == "optuna"
                   else optuna.samplers.RandomSampler(seed=seed))
        study = optuna.create_study(direction="maximize", sampler=sampler)
        enqueue_baseline(study, surface.space)
        sample = define_by_run(surface.space)
        for _ in range(budget):
            trial = study.ask()
            constants = sample(trial)
            seen = observe({**trial.params, **constants})
            if seen.stopped_at:  # as the pipeline does: the partial figure as an intermediate value, then PRUNED
                trial.report(seen.value, seen.stopped_at)
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            else:
                study.tell(trial, seen.value)


def _grid(surface: Surface, budget: int, observe: Observe) -> None:
    for params in grid_points(surface.space)[:budget]:
        observe(params)


def _tier(surface: Surface, budget: int, observe: Observe, seen: dict[Point, float]) -> None:
    observe({"algorithm": "none", **baseline_point(surface.space)})
    points = grid_points(surface.space)
    for algorithm in (a for a in surface.space.algorithms if a != "none"):
        branch = [p for p in points if p["algorithm"] == algorithm]
        # grid points leave fixed parameters out (and conditional ones their first point lacks)
        knobs = [(name, list(dict.fromkeys(p[name] for p in branch)), param)
                 for name, _, param in surface.space.params_for(algorithm)
                 if name in branch[0] and not isinstance(param, FixedParam)]
        incumbent = {"algorithm": algorithm, **{name: param.default if param.default is not None else values[0]
                                                for name, values, param in knobs}}
        changed = True
        while changed and len(seen) < budget:
            changed = False
            for name, values, _ in knobs:
                for value in values:
                    candidate = key({**incumbent, name: value})
                    if candidate in surface.mean and candidate not in seen and len(seen) < budget:
                        observe(dict(candidate))
                        changed = True
                mine = {p: v for p, v in seen.items() if dict(p)["algorithm"] == algorithm}
                if mine:
                    best: Point = max(mine, key=mine.__getitem__)
                    incumbent = dict(best)


@dataclass(frozen=True)
class Run:
    """One method on one seed: every trial in order as (point, observed value), and when replayed with an
    `EarlyStop` model, per trial the requests after which it was stopped (0 = not stopped) and its engine-seconds."""

    method: str
    seed: int
    trials: tuple[tuple[Point, float], ...]
    stopped: tuple[int, ...] = ()
    costs: tuple[float, ...] = ()


def run_method(surface: Surface, method: str, seed: int, budget: int, max_trials: int = 8,
               startup: int | None = None, early: EarlyStop | None = None) -> Run:
    """Run `method` for at most `budget` trials (the tier search may stop earlier) with noise seeded by `seed`.
    `max_trials` is the study budget the pipeline's sampler is configured for (its random start-up length);
    `startup` overrides that length for `optuna`. `early` models requests, costs and (if enabled) early stopping."""
    rng = np.random.default_rng([seed, METHODS.index(method)])
    request_rng = np.random.default_rng([seed, METHODS.index(method), 1])
    trials: list[tuple[Point, float]] = []
    stopped: list[int] = []
    costs: list[float] = []
    seen: dict[Point, float] = {}
    baseline: list[float] = []

    def observe(params: dict[str, Any]) -> Seen:
        point = key(params)
        value = surface.observe(point, rng)
        result = (simulate_trial(surface, point, value, baseline[0] if baseline else None, early, request_rng)
                  if early else Seen(value, 0, 0.0))
        if point == surface.baseline and not baseline:
            baseline.append(value)
        trials.append((point, result.value))
        stopped.append(result.stopped_at)
        costs.append(result.cost_s)
        seen[point] = max(result.value, seen.get(point, result.value))
        return result

    if method in ("optuna", "random"):
        _optuna(surface, seed, budget, observe, method, max_trials, startup)
    elif method == "grid":
        _grid(surface, budget, observe)
    elif method == "tier":
        _tier(surface, budget, observe, seen)
    else:
        raise ValueError(f"method {method!r}: choose one of {METHODS}")
    return Run(method, seed, tuple(trials), tuple(stopped) if early else (), tuple(costs) if early else ())


def trials_to_reach(surface: Surface, run: Run, within: float = 0.02) -> int | None:
    """First trial count at which the incumbent (best observed so far) is truly within `within` of the grid's best;
    None if that never happens in the run."""
    target = (1 - within) * surface.best
    best_seen, incumbent = -1.0, None
    for n, (point, value) in enumerate(run.trials, start=1):
        if run.stopped and run.stopped[n - 1]:
            continue  # a stopped trial is PRUNED: never an incumbent
        if value > best_seen:
            best_seen, incumbent = value, point
        if incumbent is not None and surface.complete[incumbent] and surface.mean[incumbent] >= target:
            return n
    return None


def engine_seconds(run: Run, trials: int | None) -> float | None:
    """Engine-seconds of the first `trials` trials of a run replayed with an `EarlyStop` model (None passes)."""
    if not run.costs:
        raise ValueError(f"run {run.method}/{run.seed} has no costs: replay it with run_method(..., early=EarlyStop())")
    return None if trials is None else sum(run.costs[:trials])


@dataclass(frozen=True)
class StopRates:
    """How often the rule stops a point, by class, over `repeats` fresh trials per point."""

    near_best: tuple[int, int]  # (stopped, trials) for points within 2% of the grid's best
    faster: tuple[int, int]  # points faster than the baseline
    slower: tuple[int, int]  # points slower than the baseline (stopping them is the point)
    requests_saved: float  # share of measured requests not run, over the slower points


def stop_rates(surface: Surface, early: EarlyStop, repeats: int, seed: int) -> StopRates:
    """Every completed non-baseline point measured `repeats` times with fresh noise against a fresh baseline
    observation each time: the false-stop rate on the recorded grid, independent of any search method."""
    rng = np.random.default_rng([seed, 7])
    base_mean = surface.mean[surface.baseline]
    counts = {"near": [0, 0], "faster": [0, 0], "slower": [0, 0]}
    saved = ran = 0
    for point in sorted(p for p in surface.mean if surface.complete[p] and p != surface.baseline):
        mean = surface.mean[point]
        for _ in range(repeats):
            baseline = surface.observe(surface.baseline, rng)
            seen = simulate_trial(surface, point, surface.observe(point, rng), baseline, early, rng)
            for name, member in (("near", mean >= 0.98 * surface.best), ("faster", mean >= base_mean),
                                 ("slower", mean < base_mean)):
                if member:
                    counts[name][0] += bool(seen.stopped_at)
                    counts[name][1] += 1
            if mean < base_mean:
                saved += early.requests - seen.stopped_at if seen.stopped_at else 0
                ran += early.requests
    return StopRates(tuple(counts["near"]), tuple(counts["faster"]), tuple(counts["slower"]),  # type: ignore[arg-type]
                     saved / ran if ran else 0.0)


@dataclass(frozen=True)
class Promotion:
    noise_aware: Point  # what the pipeline's rule deploys (the baseline when it keeps it)
    naive: Point  # what "deploy the best single measurement" deploys


def promote(surface: Surface, run: Run, budget: int, seed: int, finalists: int = 2, runs: int = 3,
            policy: PromotionPolicy | None = None) -> Promotion:
    """The pipeline's end of study on the first `budget` trials: the best `finalists` distinct completed configs and
    the baseline re-measured `runs` times each (fresh noise), then `pipeline.decide.decision.decide`."""
    # a method outside METHODS (benchmarks/simulate_replay.py's simulate-first) draws after them
    rng = np.random.default_rng([seed, 99, METHODS.index(run.method) if run.method in METHODS else len(METHODS)])
    trials = run.trials[:budget]
    base = surface.baseline
    ranked: list[Point] = []
    flags = run.stopped[:budget] or (0,) * len(trials)
    for point, _ in sorted((t for t, k in zip(trials, flags) if not k), key=lambda t: -t[1]):  # PRUNED: no finalist
        if point != base and surface.complete[point] and point not in ranked:
            ranked.append(point)
    naive = max(trials, key=lambda t: t[1])[0]
    if not ranked:
        return Promotion(base, naive)
    chosen = ranked[:finalists]
    entries = [Finalist(id=str(i), throughputs=tuple(surface.observe(p, rng) for _ in range(runs)), equivalent=True,
                        draft_tokens=surface.draft_tokens[p]) for i, p in enumerate(chosen)]
    decision = decide([surface.observe(base, rng) for _ in range(runs)], entries,
                      policy or PromotionPolicy(runs=runs))
    return Promotion(chosen[int(decision.winner)] if decision.winner is not None else base, naive)


def runs_for(surface: Surface, methods: tuple[str, ...], seeds: range, budget: int) -> Iterator[Run]:
    for method in methods:
        for seed in seeds:
            yield run_method(surface, method, seed, budget)
