"""simulate-first's search over predictions (pure apart from Optuna): evaluate the space on the simulator, rank the
predictions, pick the few to launch (diverse), and decide when the predictions miss enough to launch more.

- `explore`: every point of the space when it has at most `points` (`grid_points`); a finite space with more is
  predicted whole by the caller's `whole` (pipeline/search/whole_space.py: each distinct replay once, no sampler);
  else Optuna's TPE (the study's own `tpe_sampler`, in memory) over the define-by-run space with the predicted
  objective(s); all stop at `seconds`. The baseline is not a candidate (it is always launched); invalid points are
  skipped as they would be INVALID trials.
- `rank`: points that keep every SLA limit (predicted, at the search level) first; then non-dominated fronts of the
  objectives (one objective: its order), each front by the first objective.
- `pick`: greedily down the ranking, skipping a point that differs from an already chosen or launched one in fewer
  than `min_distance` searched parameters; when that leaves too few, the distance is relaxed one step at a time.
- `misses`: the median relative error of the launched predictions, and whether it exceeds the threshold.
"""

from __future__ import annotations

import gc
import json
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
import statistics
from typing import Any, Literal

from pipeline.config import StudyConfig, TrialConfig
from pipeline.decide.sla import check as sla_check
from pipeline.errors import ConfigError
from pipeline.search.space import SearchSpace, define_by_run, grid_points, resolve, tpe_sampler

__all__ = ["Explored", "Predicted", "distance", "explore", "misses", "pick", "point_key", "rank"]

Predict = Callable[[TrialConfig], dict[str, float]]
Prepare = Callable[[list[TrialConfig], float], object]  # (every config to be predicted, deadline) -> anything
# (started, seconds) -> the whole space predicted (whole_space.explore_whole); ConfigError: it has no finite grid
Whole = Callable[[float, float], "Explored"]


@dataclass(frozen=True)
class Predicted:
    params: dict[str, Any]  # resolve params (Optuna names), what a launch enqueues
    config: TrialConfig
    figures: dict[str, float]  # predicted Summary figures at the search level

    @property
    def key(self) -> str:
        return point_key(self.params)


@dataclass(frozen=True)
class Explored:
    predicted: list[Predicted]
    evaluated: int  # points simulated (valid ones)
    seconds: float
    method: str  # "every point" | "every point, by replay class" | "TPE over the predictions"
    complete: bool  # every point of the space was simulated
    whole: Any = None  # whole_space.WholeSpace when the space was predicted whole: re-prices after a refit


def point_key(params: dict[str, Any]) -> str:
    return json.dumps(params, sort_keys=True, default=str)


def explore(space: SearchSpace, study: StudyConfig, predict: Predict, *, points: int, seconds: float,
            prepare: Prepare | None = None, whole: Whole | None = None) -> Explored:
    """`prepare`, when given, is called once with every valid point's config (and the deadline, time.monotonic())
    before they are predicted one by one: the simulator replays them in parallel there. The cyclic garbage collector
    waits until the end: a space's replays allocate millions of small objects and no cycles, and its passes over
    them were near a tenth of the prediction's time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _explore(space, study, predict, points, seconds, prepare, whole)
    finally:
        if enabled:
            gc.enable()


def _explore(space: SearchSpace, study: StudyConfig, predict: Predict, points: int, seconds: float,
             prepare: Prepare | None, whole: Whole | None = None) -> Explored:
    started = time.monotonic()
    try:
        grid = grid_points(space, limit=points)
    except ConfigError:
        grid = None
    if grid is not None and len(grid) <= points + 1:  # +1: the baseline, never simulated here
        valid = []
        for params in grid:
            if params.get("algorithm") == "none":
                continue
            resolution = resolve(space, params, study)
            if resolution.valid and resolution.config is not None:
                valid.append((params, resolution.config))
        if prepare is not None:
            prepare([config for _, config in valid], started + seconds)
        out, timed_out = [], False
        for params, config in valid:
            if time.monotonic() - started > seconds:
                timed_out = True
                break
            out.append(Predicted(params, config, predict(config)))
        return Explored(out, len(out), time.monotonic() - started, "every point", not timed_out)
    if whole is not None:
        try:
            return whole(started, seconds)
        except ConfigError:  # a continuous parameter, or too many points to enumerate
            pass
    return _tpe(space, study, predict, points, seconds, started)


def _tpe(space: SearchSpace, study: StudyConfig, predict: Predict, points: int, seconds: float,
         started: float) -> Explored:
    # lazy: Optuna takes a second to import; only the paths that read or sample a study pay for it
    import optuna

    metrics, modes = study.objective.metrics, study.objective.modes
    directions: list[Literal["maximize", "minimize"]] = ["maximize" if m == "max" else "minimize" for m in modes]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        ot = optuna.create_study(directions=directions, sampler=tpe_sampler(study.seed, points))
    sample = define_by_run(space)
    seen: dict[str, Predicted] = {}
    asked = 0
    while asked < points and time.monotonic() - started <= seconds:
        trial = ot.ask()
        asked += 1
        constants = sample(trial)  # first: it makes the suggestions trial.params then holds
        params = {**trial.params, **constants}
        resolution = resolve(space, params, study)
        if not resolution.valid or resolution.config is None:
            ot.tell(trial, state=optuna.trial.TrialState.FAIL)
            continue
        key = point_key(params)
        if key not in seen:
            seen[key] = Predicted(params, resolution.config, predict(resolution.config))
        figures = seen[key].figures
        ot.tell(trial, [figures.get(m, 0.0) for m in metrics])
    return Explored(list(seen.values()), len(seen), time.monotonic() - started, "TPE over the predictions", False)


def rank(predicted: Sequence[Predicted], study: StudyConfig) -> list[Predicted]:
    """Feasible first (every SLA limit kept at the search level), then by non-dominated fronts of the objectives, each
    front by the first objective; ties by the point's key, so the order never depends on the input's. The fronts come
    from one pass of domination counts (`fronts`): a space's thousands of points rank in well under a second, where
    peeling the fronts one by one took tens of seconds after every launch."""
    metrics, modes = list(study.objective.metrics), list(study.objective.modes)
    signs = [1.0 if m == "max" else -1.0 for m in modes]
    level = study.search_concurrency

    def feasible(p: Predicted) -> bool:
        return all(v.ok for v in sla_check(study.objective.constraints, level, p.figures))

    ordered: list[Predicted] = []
    for group in ([p for p in predicted if feasible(p)], [p for p in predicted if not feasible(p)]):
        scores = [tuple(p.figures.get(m, 0.0) * sign for m, sign in zip(metrics, signs)) for p in group]
        front = fronts(scores)
        order = sorted(range(len(group)), key=lambda i: (front[i], -scores[i][0], group[i].key))
        ordered.extend(group[i] for i in order)
    return ordered


def fronts(scores: Sequence[tuple[float, ...]]) -> list[int]:
    """Each score's non-dominated front (0 = dominated by none; higher is better in every coordinate). One
    coordinate: the rank of its distinct value. Several: Deb's fast non-dominated sort. Pure."""
    if not scores:
        return []
    if len(scores[0]) == 1:
        values = sorted({s[0] for s in scores}, reverse=True)
        place = {v: i for i, v in enumerate(values)}
        return [place[s[0]] for s in scores]
    n = len(scores)
    beaten_by = [0] * n
    beats: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        a = scores[i]
        for j in range(i + 1, n):
            b = scores[j]
            if all(x >= y for x, y in zip(a, b)) and a != b:
                beats[i].append(j)
                beaten_by[j] += 1
            elif all(y >= x for x, y in zip(a, b)) and a != b:
                beats[j].append(i)
                beaten_by[i] += 1
    out = [0] * n
    current = [i for i in range(n) if beaten_by[i] == 0]
    level = 0
    while current:
        following = []
        for i in current:
            out[i] = level
            for j in beats[i]:
                beaten_by[j] -= 1
                if beaten_by[j] == 0:
                    following.append(j)
        current, level = following, level + 1
    return out


def distance(a: dict[str, Any], b: dict[str, Any]) -> int:
    """Searched parameters in which two points differ (a parameter one of them lacks counts as a difference)."""
    return sum(1 for k in set(a) | set(b) if a.get(k) != b.get(k))


def pick(ranked: Sequence[Predicted], count: int, min_distance: int,
         taken: Sequence[dict[str, Any]] = (), same: Callable[[dict[str, Any]], str] | None = None
         ) -> list[Predicted]:
    """Up to `count` points down the ranking, each at least `min_distance` from the others and from `taken`.
    `same` maps a point's params to its equivalence class (the simulator's replay signature): points of one class
    have the same predicted acceptance and cost, so they are one config to the instrument, and only the first of a
    class (the best ranked) is ever picked, never a second one whose measurement could only differ by noise."""
    taken_keys = {point_key(t) for t in taken}
    classes = {same(t) for t in taken} if same is not None else set()
    pool = [p for p in ranked if p.key not in taken_keys]
    for floor in range(min_distance, -1, -1):
        chosen: list[Predicted] = []
        others = list(taken)
        seen = set(classes)
        for p in pool:
            if len(chosen) == count:
                break
            kind = same(p.params) if same is not None else None
            if kind is not None and kind in seen:
                continue
            if all(distance(p.params, o) >= max(floor, 1) for o in others):
                chosen.append(p)
                others.append(p.params)
                if kind is not None:
                    seen.add(kind)
        if len(chosen) == count or floor == 0:
            return chosen
    return []


def misses(errors: Sequence[float | None], threshold: float,
           noises: Sequence[float | None] | None = None) -> tuple[float | None, bool]:
    """(median relative error of the known errors, whether the predictions miss). With `noises` (each launch's
    measurement noise, relative: its figure is only known to within it), a launch's error counts only beyond its
    noise: a prediction within the noise is as good as a measurement, and a threshold below the noise could
    otherwise never be met."""
    pairs = [(e, (noises[i] if noises is not None and i < len(noises) else None) or 0.0)
             for i, e in enumerate(errors) if e is not None]
    if not pairs:
        return None, False
    median = statistics.median(e for e, _ in pairs)
    beyond = statistics.median(max(0.0, e - n) for e, n in pairs)
    return median, beyond > threshold
