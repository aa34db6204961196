"""Loading and checking a space file: every problem is found at load (and so by `--dry-run`), none at trial 5."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pipeline.config import TrialConfig, read_yaml
from pipeline.errors import ConfigError, format_validation_error
from pipeline.search.space.bounds import evaluate_bound, literal_zero_divisor, names_in
from pipeline.search.space.model import TRIAL_FIELDS, CategoricalParam, FixedParam, FloatParam, IntParam, Param, SearchSpace
from serve.spec import SPEC_TYPES


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


def _names(bound: str) -> set[str]:
    try:
        return set(names_in(bound))
    except SyntaxError:
        return set()


def _check_param(algorithm: str, key: str, name: str, p: Param, earlier: list[str]) -> list[str]:
    problems = []
    for other, allowed in p.when.items():
        if other not in earlier:
            problems.append(f"{key}.when: '{other}' is not a parameter defined before '{name}' "
                            f"(earlier: {earlier or 'none'})")
        elif not allowed:
            problems.append(f"{key}.when.{other}: list at least one value")
    if isinstance(p, (IntParam, FloatParam)):
        for side in ("low", "high"):
            bound = getattr(p, side)
            if isinstance(bound, str):
                try:
                    unknown = names_in(bound) - set(earlier)
                except SyntaxError:
                    problems.append(f"{key}.{side}: {bound!r} is not an expression")
                    continue
                if unknown:
                    problems.append(f"{key}.{side}: {bound!r} names {sorted(unknown)}, which are not parameters "
                                    f"defined before '{name}' (earlier: {earlier or 'none'})")
                elif literal_zero_divisor(bound):
                    problems.append(f"{key}.{side}: {bound!r} divides by zero for every point; fix the expression")
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
        problems.extend(default_problems(key, p))
    elif isinstance(p, CategoricalParam):
        if p.default is not None and repr(p.default) not in map(repr, p.choices):
            problems.append(f"{key}.default: {p.default!r} is not one of the choices {p.choices}; the baseline and "
                            "grid points use it. Fix: make it one of the choices, or remove it")
        if len(set(map(repr, p.choices))) != len(p.choices):
            problems.append(f"{key}.choices: duplicates in {p.choices}")
        for choice in p.choices:
            if (reason := _value_problem(algorithm, name, choice)) is not None:
                problems.append(f"{key}.choices: {choice!r} is not a valid {name}: {reason}")
    elif p.value is not None and (reason := _value_problem(algorithm, name, p.value)) is not None:
        problems.append(f"{key}.value: {p.value!r} is not a valid {name}: {reason}")
    return problems


def default_problems(key: str, p: IntParam | FloatParam) -> list[str]:
    """A declared `default` outside the parameter's range (numeric bounds; an expression bound is known only at a
    point): the baseline would be enqueued with a value the range forbids. Pure."""
    if p.default is None or isinstance(p.low, str) or isinstance(p.high, str) or p.low > p.high:
        return []
    if not p.low <= p.default <= p.high:
        return [f"{key}.default: {p.default!r} is outside the range low={p.low}, high={p.high}. Fix: a default "
                "within the range, or remove it"]
    return []


def _extremes(p: Param, values: dict[str, Any], key: str, end: int) -> Any:
    """The parameter's value at one end of its range (0 = low, -1 = high), for probing later bounds."""
    if isinstance(p, FixedParam):
        return p.value
    if isinstance(p, CategoricalParam):
        return p.choices[end]
    return evaluate_bound(p.low if end == 0 else p.high, values, f"{key}.{'low' if end == 0 else 'high'}")


def _probe_bounds(algorithm: str, params: list[tuple[str, str, str, Param]]) -> list[str]:
    """Evaluate every bound with the earlier parameters all at their lows, then all at their highs: an expression
    that fails there (a division by a parameter that can be 0, a non-number) fails at load, not mid-study."""
    problems = []
    for end in (0, -1):
        values: dict[str, Any] = {}
        for key, name, _, p in params:
            try:
                if isinstance(p, (IntParam, FloatParam)):
                    for side in ("low", "high"):
                        evaluate_bound(getattr(p, side), values, f"{key}.{side}")
                values[name] = _extremes(p, values, key, end)
            except ConfigError as exc:
                problems.append(f"{exc} (earlier parameters at their {'lows' if end == 0 else 'highs'})")
                break
    return problems


def check_space(space: SearchSpace) -> list[str]:
    """Every problem of a parsed space: unknown parameter names, bad ranges, values the configs reject, bounds that
    cannot be evaluated."""
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
        conditional: dict[str, dict[str, list[Any]]] = {}  # parameter -> its `when`
        checked: list[tuple[str, str, str, Param]] = []
        allowed = _allowed_fields(algorithm)
        before = len(problems)
        for optuna_name, name, p in space.params_for(algorithm):
            key = f"branches.{optuna_name}" if "." in optuna_name else f"common.{name}"
            if name not in allowed:
                if key.startswith("branches."):
                    close = difflib.get_close_matches(name, allowed, n=1)
                    hint = f"did you mean '{close[0]}'?" if close else f"known: {', '.join(allowed)}"
                    problems.append(f"{key}: unknown parameter for {algorithm}; {hint}")
                continue
            problems.extend(_check_param(algorithm, key, name, p, seen))
            for side in ("low", "high"):
                bound = getattr(p, side, None)
                # a bound may name a conditional parameter only where its own condition implies that one's
                absent = sorted(n for n in (_names(bound) if isinstance(bound, str) else set())
                                if n in conditional and not _implies(p.when, conditional[n]))
                if absent:
                    problems.append(f"{key}.{side}: {bound!r} names {absent}, which exist only under a `when` "
                                    "condition; bound by unconditional parameters (or give this parameter the same "
                                    "condition)")
            if p.when:
                conditional[name] = dict(p.when)
            seen.append(name)
            checked.append((key, name, optuna_name, p))
        if len(problems) == before:  # probing needs well-formed bounds
            problems.extend(_probe_bounds(algorithm, checked))
    return list(dict.fromkeys(problems))  # a common parameter is checked once per branch: report it once


def _implies(when: dict[str, list[Any]], other: dict[str, list[Any]]) -> bool:
    """Whether every point where condition `when` holds also satisfies `other`. Pure."""
    return all(name in when and set(map(repr, when[name])) <= set(map(repr, allowed))
               for name, allowed in other.items())


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
