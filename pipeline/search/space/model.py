"""The parsed shape of a search-space file: parameter types, branches, and each parameter's default value.

A space file names the algorithms to choose from, parameters common to all of them, and per-algorithm branches:

    algorithms: [none, ngram]            # 'none' is required: the baseline is always trial 0
    common:
      warmup_requests: {type: fixed, value: 2}
    branches:
      ngram:
        num_draft_tokens: {type: int, low: 2, high: 12}
        min_bfs_breadth: {type: int, low: 1, high: max_bfs_breadth}   # bounds may name earlier parameters
        match_type: {type: categorical, choices: [BFS, PROB]}
        min_bfs_breadth: {type: int, low: 1, high: 4, when: {match_type: [BFS]}}   # only where it matters

A branch parameter overrides a common one of the same name for that algorithm. Optuna sees `algorithm`, common
parameters by name and branch parameters as `<algorithm>.<name>`, so parameters of other branches never appear.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field

from pipeline.search.space.bounds import Bound, evaluate_bound
from serve.spec import Algorithm, FrozenModel

TRIAL_FIELDS = ("warmup_requests", "max_running_requests")  # TrialConfig fields a space may search
Choice = Union[bool, int, float, str, None]  # None: "off" (e.g. no external corpus)


class _Conditional(FrozenModel):
    # `when: {match_type: [BFS]}`: the parameter exists only where every named earlier parameter took one of the
    # listed values (elsewhere the engine ignores the field, so sampling it would only add noise to the search).
    when: dict[str, list[Choice]] = Field(default_factory=dict)


class IntParam(_Conditional):
    type: Literal["int"]
    low: Bound
    high: Bound
    step: int = Field(1, ge=1)
    log: bool = False
    default: int | None = None


class FloatParam(_Conditional):
    type: Literal["float"]
    low: Bound
    high: Bound
    step: float | None = Field(None, gt=0)
    log: bool = False
    default: float | None = None


class CategoricalParam(_Conditional):
    type: Literal["categorical"]
    choices: list[Choice] = Field(min_length=1)
    default: Union[bool, int, float, str, None] = None


class FixedParam(_Conditional):
    type: Literal["fixed"]
    value: Union[bool, int, float, str, None]


Param = Annotated[Union[IntParam, FloatParam, CategoricalParam, FixedParam], Field(discriminator="type")]


class SearchSpace(FrozenModel):
    """A parsed space file. Build it with `load_space`, which also checks names, ranges and values."""

    name: str = ""
    description: str = ""
    algorithms: list[Algorithm] = Field(min_length=1)
    common: dict[str, Param] = Field(default_factory=dict)
    branches: dict[Algorithm, dict[str, Param]] = Field(default_factory=dict)

    def params_for(self, algorithm: str) -> list[tuple[str, str, Param]]:
        """(optuna name, field name, param) for one branch, common ones first, in file order."""
        branch = self.branches.get(algorithm, {})  # type: ignore[call-overload]
        out = [(name, name, p) for name, p in self.common.items() if name not in branch]
        out += [(f"{algorithm}.{name}", name, p) for name, p in branch.items()]
        return out


def applies(p: Param, values: dict[str, Any]) -> bool:
    """Whether a parameter with a `when` condition exists at this point (`values`: earlier parameters' values)."""
    return all(values.get(name) in allowed for name, allowed in p.when.items())


def default_value(p: Param, values: dict[str, Any], where: str = "bound") -> Any:
    """A parameter's value when nothing was sampled: fixed value, declared default, first choice, or low bound."""
    if isinstance(p, FixedParam):
        return p.value
    if p.default is not None:
        return p.default
    if isinstance(p, CategoricalParam):
        return p.choices[0]
    return evaluate_bound(p.low, values, f"{where}.low")


def baseline_point(space: SearchSpace) -> dict[str, Any]:
    """Optuna params of the baseline: defaults of the parameters the `none` branch has (often none at all)."""
    point: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for optuna_name, name, p in space.params_for("none"):
        if not applies(p, values):
            continue
        values[name] = default_value(p, values, optuna_name)
        if not isinstance(p, FixedParam):
            point[optuna_name] = values[name]
    return point
