"""Enumeration: every point of a space, for the search-efficiency replay and exhaustive comparisons."""

from __future__ import annotations

from typing import Any

from pipeline.errors import ConfigError
from pipeline.search.space.bounds import evaluate_bound
from pipeline.search.space.model import (CategoricalParam, FixedParam, FloatParam, Param, SearchSpace, applies,
                                  baseline_point)


def _values(optuna_name: str, p: Param, values: dict[str, Any]) -> list[Any]:
    if isinstance(p, FixedParam):
        return [p.value]
    if isinstance(p, CategoricalParam):
        return list(p.choices)
    if p.log or (isinstance(p, FloatParam) and p.step is None):
        raise ConfigError(f"{optuna_name}: a {'log-scaled' if p.log else 'continuous'} parameter has no finite grid; "
                          f"give it a step (and log: false) or make it categorical to enumerate the space")
    low = evaluate_bound(p.low, values, f"{optuna_name}.low")
    high = evaluate_bound(p.high, values, f"{optuna_name}.high")
    step = p.step if p.step is not None else 1  # a float without a step was refused above
    count = int((high - low) // step) + 1 if high >= low else 1
    return [low + i * step for i in range(count)]


def grid_points(space: SearchSpace, limit: int = 100_000) -> list[dict[str, Any]]:
    """Every point of the space as `resolve` params ({"algorithm": ..., "<algorithm>.<name>": ...}), baseline first.

    Bounds that name earlier parameters are evaluated per point, as in sampling. Raises ConfigError for a parameter
    without a finite grid or when the space has more than `limit` points.
    """
    points: list[dict[str, Any]] = (
        [{"algorithm": "none", **baseline_point(space)}] if "none" in space.algorithms else [])
    for algorithm in (a for a in space.algorithms if a != "none"):
        params = space.params_for(algorithm)

        def expand(i: int, values: dict[str, Any], point: dict[str, Any]) -> None:
            if len(points) > limit:
                raise ConfigError(f"search space {space.name!r} has more than {limit} points: too many to enumerate")
            if i == len(params):
                points.append(point)
                return
            optuna_name, name, p = params[i]
            if not applies(p, values):
                expand(i + 1, values, point)
                return
            for value in _values(optuna_name, p, values):
                extra = {} if isinstance(p, FixedParam) else {optuna_name: value}
                expand(i + 1, {**values, name: value}, {**point, **extra})

        expand(0, {}, {"algorithm": algorithm})
    return points
