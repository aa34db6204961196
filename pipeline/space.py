"""Search spaces: YAML files in search_spaces/ -> a validated `SearchSpace` -> an Optuna define-by-run function.

A space file names the algorithms to choose from, parameters common to all of them, and per-algorithm branches:

    algorithms: [none, ngram]            # 'none' is required: the baseline is always trial 0
    common:
      warmup_requests: {type: fixed, value: 2}
    branches:
      ngram:
        num_draft_tokens: {type: int, low: 2, high: 12}
        min_bfs_breadth: {type: int, low: 1, high: max_bfs_breadth}   # bounds may name earlier parameters
        match_type: {type: categorical, choices: [BFS, PROB]}

A branch parameter overrides a common one of the same name for that algorithm. Optuna sees `algorithm`, common
parameters by name and branch parameters as `<algorithm>.<name>`, so parameters of other branches never appear.
"""

from __future__ import annotations

import ast
import difflib
import operator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Union

from pydantic import Field, ValidationError

from pipeline.config import StudyConfig, TrialConfig, read_yaml, validate_trial
from pipeline.errors import ConfigError, format_validation_error
from serve.spec import DRAFT_MODEL_ALGORITHMS, SPEC_TYPES, Algorithm, FrozenModel, Violation

TRIAL_FIELDS = ("warmup_requests", "max_running_requests")  # TrialConfig fields a space may search
Bound = Union[int, float, str]  # a number, or an expression over earlier parameters (e.g. "num_steps + 1")


class IntParam(FrozenModel):
    type: Literal["int"]
    low: Bound
    high: Bound
    step: int = Field(1, ge=1)
    log: bool = False
    default: int | None = None


class FloatParam(FrozenModel):
    type: Literal["float"]
    low: Bound
    high: Bound
    step: float | None = Field(None, gt=0)
    log: bool = False
    default: float | None = None


class CategoricalParam(FrozenModel):
    type: Literal["categorical"]
    choices: list[Union[bool, int, float, str]] = Field(min_length=1)
    default: Union[bool, int, float, str, None] = None


class FixedParam(FrozenModel):
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


# --- bounds that name earlier parameters -------------------------------------------------------------------------

_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
}


def _names_in(expr: str) -> set[str]:
    return {node.id for node in ast.walk(ast.parse(expr, mode="eval")) if isinstance(node, ast.Name)} - {"min", "max"}


def _evaluate(expr: Bound, values: dict[str, Any]) -> Any:
    """Evaluate + - * // min() max() over numbers and earlier parameter values; nothing else is allowed."""
    if not isinstance(expr, str):
        return expr

    def walk(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.Name):
            return values[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("min", "max"):
            return (min if node.func.id == "min" else max)(*(walk(a) for a in node.args))
        raise ValueError(f"unsupported expression element {ast.dump(node)}")

    return walk(ast.parse(expr, mode="eval"))


# --- loading and checking ----------------------------------------------------------------------------------------

def _allowed_fields(algorithm: str) -> list[str]:
    return [f for f in SPEC_TYPES[algorithm].model_fields if f != "algorithm"] + list(TRIAL_FIELDS)


def _value_problem(algorithm: str, name: str, value: Any) -> str | None:
    """Does `value` fit field `name` of this algorithm's spec (or of TrialConfig)? Returns pydantic's reason."""
    try:
        if name in TRIAL_FIELDS:
            TrialConfig.model_validate({name: value})
        else:
            SPEC_TYPES[algorithm].model_validate({"algorithm": algorithm, name: value})
    except ValidationError as exc:
        return "; ".join(e["msg"] for e in exc.errors(include_url=False))
    return None


def _check_param(algorithm: str, key: str, name: str, p: Param, earlier: list[str]) -> list[str]:
    problems = []
    if isinstance(p, (IntParam, FloatParam)):
        for side in ("low", "high"):
            bound = getattr(p, side)
            if isinstance(bound, str):
                try:
                    unknown = _names_in(bound) - set(earlier)
                except SyntaxError:
                    problems.append(f"{key}.{side}: {bound!r} is not an expression")
                    continue
                if unknown:
                    problems.append(f"{key}.{side}: {bound!r} names {sorted(unknown)}, which are not parameters "
                                    f"defined before '{name}' (earlier: {earlier or 'none'})")
            elif isinstance(p, IntParam) and not isinstance(bound, int):
                problems.append(f"{key}.{side}: an int parameter needs an integer bound, got {bound!r}")
            elif (reason := _value_problem(algorithm, name, bound)) is not None:
                problems.append(f"{key}.{side}: {bound!r} is not a valid {name}: {reason}")
        if not isinstance(p.low, str) and not isinstance(p.high, str) and p.low > p.high:
            problems.append(f"{key}: empty range, low <= high must hold, got low={p.low}, high={p.high}")
        if p.log and (isinstance(p.low, str) or p.low <= 0):
            problems.append(f"{key}.log: a log range needs a numeric low > 0, got low={p.low!r}")
        if isinstance(p, IntParam) and p.log and p.step != 1:
            problems.append(f"{key}: step and log cannot be combined (Optuna), got step={p.step}")
    elif isinstance(p, CategoricalParam):
        if len(set(map(repr, p.choices))) != len(p.choices):
            problems.append(f"{key}.choices: duplicates in {p.choices}")
        for choice in p.choices:
            if (reason := _value_problem(algorithm, name, choice)) is not None:
                problems.append(f"{key}.choices: {choice!r} is not a valid {name}: {reason}")
    elif p.value is not None and (reason := _value_problem(algorithm, name, p.value)) is not None:
        problems.append(f"{key}.value: {p.value!r} is not a valid {name}: {reason}")
    return problems


def check_space(space: SearchSpace) -> list[str]:
    """Every problem of a parsed space: unknown parameter names, bad ranges, values the configs reject."""
    problems = []
    if "none" not in space.algorithms:
        problems.append(f"algorithms: must include 'none' (the baseline every study measures first), "
                        f"got {space.algorithms}")
    if not any(a != "none" for a in space.algorithms):
        problems.append(f"algorithms: name at least one speculative algorithm besides none, got {space.algorithms}")
    for algorithm in space.branches:
        if algorithm not in space.algorithms:
            problems.append(f"branches.{algorithm}: '{algorithm}' is not listed in algorithms {space.algorithms}")
    for name in space.common:
        if name not in TRIAL_FIELDS:
            # Spec fields differ per algorithm, so they live in branches; common holds trial-level knobs only.
            close = difflib.get_close_matches(name, TRIAL_FIELDS, n=1)
            hint = f"did you mean '{close[0]}'?" if close else "speculative parameters belong under branches.<algo>"
            problems.append(f"common.{name}: unknown common parameter (allowed: {', '.join(TRIAL_FIELDS)}); {hint}")
    for algorithm in space.algorithms:
        seen: list[str] = []
        allowed = _allowed_fields(algorithm)
        for optuna_name, name, p in space.params_for(algorithm):
            key = f"branches.{optuna_name}" if "." in optuna_name else f"common.{name}"
            if name not in allowed:
                if key.startswith("branches."):
                    close = difflib.get_close_matches(name, allowed, n=1)
                    hint = f"did you mean '{close[0]}'?" if close else f"known: {', '.join(allowed)}"
                    problems.append(f"{key}: unknown parameter for {algorithm}; {hint}")
                continue
            problems.extend(_check_param(algorithm, key, name, p, seen))
            seen.append(name)
    return list(dict.fromkeys(problems))  # a common parameter is checked once per branch: report it once


def load_space(path: str | Path) -> SearchSpace:
    """Read, parse and check a space file; raises ConfigError naming the file, every bad key and value."""
    path = Path(path)
    data = read_yaml(path, "search space")
    try:
        space = SearchSpace.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, f"search space {path}",
                                                  {"": list(SearchSpace.model_fields)})) from None
    problems = check_space(space)
    if problems:
        raise ConfigError(f"search space {path}: {len(problems)} problem(s)\n"
                          + "\n".join(f"  - {p}" for p in problems))
    return space


# --- sampling ----------------------------------------------------------------------------------------------------

def _suggest(trial: Any, optuna_name: str, p: Param, values: dict[str, Any]) -> Any:
    if isinstance(p, IntParam):
        low, high = int(_evaluate(p.low, values)), int(_evaluate(p.high, values))
        return trial.suggest_int(optuna_name, low, max(low, high), step=p.step, log=p.log)
    if isinstance(p, FloatParam):
        low, high = float(_evaluate(p.low, values)), float(_evaluate(p.high, values))
        return trial.suggest_float(optuna_name, low, max(low, high), step=p.step, log=p.log)
    if isinstance(p, CategoricalParam):
        return trial.suggest_categorical(optuna_name, p.choices)
    return p.value


BASELINE_ATTR = "baseline"  # user attribute that marks the enqueued baseline trial in the Optuna study


class SpaceSampler:
    """The Optuna define-by-run function: algorithm first, then only that branch's parameters.

    The baseline is not one of the sampled choices (re-sampling `none` would waste trials): it is the trial enqueued
    by `enqueue_baseline`, recognised by its user attribute, and it returns `algorithm: none` as a constant.
    A class, not a closure: Tune pickles the searcher (and this function with it) into its experiment checkpoint.
    """

    def __init__(self, space: SearchSpace) -> None:
        self.space = space
        self.speculative = [a for a in space.algorithms if a != "none"]

    def __call__(self, trial: Any) -> dict[str, Any]:
        is_baseline = bool(trial.user_attrs.get(BASELINE_ATTR))
        algorithm = "none" if is_baseline else trial.suggest_categorical("algorithm", self.speculative)
        values: dict[str, Any] = {}
        for optuna_name, name, p in self.space.params_for(algorithm):
            values[name] = _suggest(trial, optuna_name, p, values)
        return {"algorithm": algorithm} if is_baseline else {}


def define_by_run(space: SearchSpace) -> SpaceSampler:
    return SpaceSampler(space)


def startup_trials(max_trials: int) -> int:
    """Random trials before TPE models the results: Optuna's default of 10 would make an 8-trial study pure random
    search. A quarter of the budget, 3 to 10 (the baseline counts as one). Measured by
    `python benchmarks/search_efficiency.py replay --seeds 100 [--startup-trials 10]` (docs/benchmarks.md)."""
    return min(10, max(3, max_trials // 4))


def tpe_sampler(seed: int, max_trials: int, n_startup_trials: int | None = None) -> Any:
    """The study's sampler: multivariate TPE with conditional groups (branches), seeded. `n_startup_trials`
    overrides `startup_trials(max_trials)` (the search-efficiency replay compares the two)."""
    import warnings

    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True,
                                          n_startup_trials=n_startup_trials or startup_trials(max_trials))


def _default(p: Param, values: dict[str, Any]) -> Any:
    if isinstance(p, FixedParam):
        return p.value
    if p.default is not None:
        return p.default
    if isinstance(p, CategoricalParam):
        return p.choices[0]
    return _evaluate(p.low, values)


def baseline_point(space: SearchSpace) -> dict[str, Any]:
    """Optuna params of the baseline: defaults of the parameters the `none` branch has (often none at all)."""
    point: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for optuna_name, name, p in space.params_for("none"):
        values[name] = _default(p, values)
        if not isinstance(p, FixedParam):
            point[optuna_name] = values[name]
    return point


def enqueue_baseline(study: Any, space: SearchSpace) -> bool:
    """Put the baseline first in an Optuna study unless it already has one (a resumed study). Returns True if added."""
    from optuna.trial import TrialState

    alive = (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)
    if any(t.user_attrs.get(BASELINE_ATTR) and t.state in alive for t in study.get_trials(deepcopy=False)):
        return False  # a failed baseline (e.g. its driver died) is enqueued again
    study.enqueue_trial(baseline_point(space), user_attrs={BASELINE_ATTR: True})
    return True


@dataclass(frozen=True)
class Resolution:
    """A sampled point turned into a TrialConfig, or the reasons it cannot be one (an INVALID trial)."""

    params: dict[str, Any]
    config: TrialConfig | None
    violations: list[Violation] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return self.config is not None and not self.violations


def resolve(space: SearchSpace, params: dict[str, Any], study: StudyConfig) -> Resolution:
    """Optuna params (+ fixed values, study drafts and concurrency) -> TrialConfig, validated for the study's engine."""
    algorithm = params.get("algorithm")
    if algorithm not in space.algorithms:
        return Resolution(params, None, [Violation("algorithm", f"one of {space.algorithms}", f"{algorithm!r}")])
    values: dict[str, Any] = {}
    for optuna_name, name, p in space.params_for(algorithm):
        values[name] = p.value if isinstance(p, FixedParam) else params.get(optuna_name, _default(p, values))
    spec: dict[str, Any] = {"algorithm": algorithm}
    trial: dict[str, Any] = {"concurrency": study.concurrency[0]}
    for name, value in values.items():
        (trial if name in TRIAL_FIELDS else spec)[name] = value
    if algorithm in DRAFT_MODEL_ALGORITHMS and not spec.get("draft_model"):
        spec["draft_model"] = study.model.drafts.get(algorithm)
    try:
        config = TrialConfig.model_validate({**trial, "spec": spec})
    except ValidationError as exc:
        return Resolution(params, None, [
            Violation(".".join(str(x) for x in e["loc"] if x != algorithm), e["msg"], repr(e.get("input")))
            for e in exc.errors(include_url=False)])
    return Resolution(params, config, validate_trial(config, study.engine.kind))


# --- enumeration -------------------------------------------------------------------------------------------------

def _values(optuna_name: str, p: Param, values: dict[str, Any]) -> list[Any]:
    if isinstance(p, FixedParam):
        return [p.value]
    if isinstance(p, CategoricalParam):
        return list(p.choices)
    if p.log or (isinstance(p, FloatParam) and p.step is None):
        raise ConfigError(f"{optuna_name}: a {'log-scaled' if p.log else 'continuous'} parameter has no finite grid; "
                          f"give it a step (and log: false) or make it categorical to enumerate the space")
    low, high = _evaluate(p.low, values), _evaluate(p.high, values)
    step = p.step
    count = int((high - low) // step) + 1 if high >= low else 1
    return [low + i * step for i in range(count)]


def grid_points(space: SearchSpace, limit: int = 100_000) -> list[dict[str, Any]]:
    """Every point of the space as `resolve` params ({"algorithm": ..., "<algorithm>.<name>": ...}), baseline first.

    Bounds that name earlier parameters are evaluated per point, as in sampling. Raises ConfigError for a parameter
    without a finite grid or when the space has more than `limit` points.
    """
    points: list[dict[str, Any]] = [{"algorithm": "none", **baseline_point(space)}] if "none" in space.algorithms else []
    for algorithm in (a for a in space.algorithms if a != "none"):
        params = space.params_for(algorithm)

        def expand(i: int, values: dict[str, Any], point: dict[str, Any]) -> None:
            if len(points) > limit:
                raise ConfigError(f"search space {space.name!r} has more than {limit} points: too many to enumerate")
            if i == len(params):
                points.append(point)
                return
            optuna_name, name, p = params[i]
            for value in _values(optuna_name, p, values):
                extra = {} if isinstance(p, FixedParam) else {optuna_name: value}
                expand(i + 1, {**values, name: value}, {**point, **extra})

        expand(0, {}, {"algorithm": algorithm})
    return points
