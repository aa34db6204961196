"""Replay a measured grid as a response surface and compare search methods on it (pure; no engine, no Ray).

The surface holds, for every point of a search space, the throughput measured with the normal trial protocol and
its outcome. A replayed trial returns the point's mean throughput times exp(sigma * z), z ~ N(0, 1), where sigma is
the run-to-run noise measured on repeated points; a point whose measurement failed (e.g. NOT_EQUIVALENT) returns 0,
as a failed trial reports to Optuna in the pipeline. Everything is seeded: the same seed gives the same numbers.

Methods, each starting with the baseline as trial 0, as the pipeline does:
- `optuna`: the pipeline's searcher (`pipeline.space.tpe_sampler`) over `define_by_run(space)`, baseline enqueued;
- `random`: Optuna's RandomSampler over the same define-by-run space;
- `grid`: every point once, in the file's order;
- `tier`: one knob at a time (SGLang auto_benchmark's tier 1, run to convergence): from the space's defaults, sweep
  each knob with the others at the incumbent, move to the best observed, repeat passes until nothing is new.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.config import PromotionPolicy
from pipeline.decision import Finalist, decide
from pipeline.space import SearchSpace, baseline_point, define_by_run, enqueue_baseline, grid_points, tpe_sampler

METHODS = ("optuna", "random", "grid", "tier")
Point = tuple[tuple[str, Any], ...]  # a canonical, hashable point: sorted resolve-params items


def key(params: dict[str, Any]) -> Point:
    return tuple(sorted(params.items()))


@dataclass(frozen=True)
class Surface:
    """Measured means per point (0 where the point did not complete), the noise, and the draft tokens per point."""

    space: SearchSpace
    mean: dict[Point, float]
    complete: dict[Point, bool]
    draft_tokens: dict[Point, int]
    sigma: float

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


Observe = Callable[[dict[str, Any]], float]


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
            study.tell(trial, observe({**trial.params, **constants}))


def _grid(surface: Surface, budget: int, observe: Observe) -> None:
    for params in grid_points(surface.space)[:budget]:
        observe(params)


def _tier(surface: Surface, budget: int, observe: Observe, seen: dict[Point, float]) -> None:
    observe({"algorithm": "none", **baseline_point(surface.space)})
    points = grid_points(surface.space)
    for algorithm in (a for a in surface.space.algorithms if a != "none"):
        branch = [p for p in points if p["algorithm"] == algorithm]
        knobs = [(name, list(dict.fromkeys(p[name] for p in branch)), param)
                 for name, _, param in surface.space.params_for(algorithm) if name in branch[0]]
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
                    incumbent = dict(max(mine, key=mine.__getitem__))


@dataclass(frozen=True)
class Run:
    """One method on one seed: every trial in order as (point, observed value)."""

    method: str
    seed: int
    trials: tuple[tuple[Point, float], ...]


def run_method(surface: Surface, method: str, seed: int, budget: int, max_trials: int = 8,
               startup: int | None = None) -> Run:
    """Run `method` for at most `budget` trials (the tier search may stop earlier) with noise seeded by `seed`.
    `max_trials` is the study budget the pipeline's sampler is configured for (its random start-up length);
    `startup` overrides that length for `optuna`."""
    rng = np.random.default_rng([seed, METHODS.index(method)])
    trials: list[tuple[Point, float]] = []
    seen: dict[Point, float] = {}

    def observe(params: dict[str, Any]) -> float:
        point = key(params)
        value = surface.observe(point, rng)
        trials.append((point, value))
        seen[point] = max(value, seen.get(point, value))
        return value

    if method in ("optuna", "random"):
        _optuna(surface, seed, budget, observe, method, max_trials, startup)
    elif method == "grid":
        _grid(surface, budget, observe)
    elif method == "tier":
        _tier(surface, budget, observe, seen)
    else:
        raise ValueError(f"method {method!r}: choose one of {METHODS}")
    return Run(method, seed, tuple(trials))


def trials_to_reach(surface: Surface, run: Run, within: float = 0.02) -> int | None:
    """First trial count at which the incumbent (best observed so far) is truly within `within` of the grid's best;
    None if that never happens in the run."""
    target = (1 - within) * surface.best
    best_seen, incumbent = -1.0, None
    for n, (point, value) in enumerate(run.trials, start=1):
        if value > best_seen:
            best_seen, incumbent = value, point
        if incumbent is not None and surface.complete[incumbent] and surface.mean[incumbent] >= target:
            return n
    return None


@dataclass(frozen=True)
class Promotion:
    noise_aware: Point  # what the pipeline's rule deploys (the baseline when it keeps it)
    naive: Point  # what "deploy the best single measurement" deploys


def promote(surface: Surface, run: Run, budget: int, seed: int, finalists: int = 2, runs: int = 3,
            policy: PromotionPolicy | None = None) -> Promotion:
    """The pipeline's end of study on the first `budget` trials: the best `finalists` distinct completed configs and
    the baseline re-measured `runs` times each (fresh noise), then `pipeline.decision.decide`."""
    rng = np.random.default_rng([seed, 99, METHODS.index(run.method)])
    trials = run.trials[:budget]
    base = surface.baseline
    ranked: list[Point] = []
    for point, _ in sorted(trials, key=lambda t: -t[1]):
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
