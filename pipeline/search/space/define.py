"""The Optuna define-by-run function: algorithm first, then only that branch's parameters; the baseline enqueued."""

from __future__ import annotations

from typing import Any

from pipeline.search.space.bounds import evaluate_bound
from pipeline.search.space.model import (CategoricalParam, FloatParam, IntParam, Param, SearchSpace, applies,
                                  baseline_point)

BASELINE_ATTR = "baseline"  # user attribute that marks the enqueued baseline trial in the Optuna study


def suggest(trial: Any, optuna_name: str, p: Param, values: dict[str, Any]) -> Any:
    """Ask Optuna for one parameter; a bound that names earlier parameters is evaluated with their `values`."""
    if isinstance(p, IntParam):
        low = int(evaluate_bound(p.low, values, f"{optuna_name}.low"))
        high = int(evaluate_bound(p.high, values, f"{optuna_name}.high"))
        return trial.suggest_int(optuna_name, low, max(low, high), step=p.step, log=p.log)
    if isinstance(p, FloatParam):
        flow = float(evaluate_bound(p.low, values, f"{optuna_name}.low"))
        fhigh = float(evaluate_bound(p.high, values, f"{optuna_name}.high"))
        return trial.suggest_float(optuna_name, flow, max(flow, fhigh), step=p.step, log=p.log)
    if isinstance(p, CategoricalParam):
        return trial.suggest_categorical(optuna_name, p.choices)
    return p.value


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
            if applies(p, values):
                values[name] = suggest(trial, optuna_name, p, values)
        return {"algorithm": algorithm} if is_baseline else {}


def define_by_run(space: SearchSpace) -> SpaceSampler:
    return SpaceSampler(space)


def enqueue_baseline(study: Any, space: SearchSpace) -> bool:
    """Put the baseline first in an Optuna study unless it already has one (a resumed study). Returns True if added."""
    from optuna.trial import TrialState

    alive = (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)
    if any(t.user_attrs.get(BASELINE_ATTR) and t.state in alive for t in study.get_trials(deepcopy=False)):
        return False  # a failed baseline (e.g. its driver died) is enqueued again
    study.enqueue_trial(baseline_point(space), user_attrs={BASELINE_ATTR: True})
    return True
