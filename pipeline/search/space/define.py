"""The Optuna define-by-run function: algorithm first, then only that branch's parameters; the baseline enqueued."""

from __future__ import annotations

from typing import Any

from pipeline.search.space.bounds import evaluate_bound
from pipeline.search.space.model import (CategoricalParam, FloatParam, IntParam, Param, SearchSpace, applies,
                                  baseline_point)
from pipeline.vocabulary.outcome import Outcome
from pipeline.vocabulary.report import LOAD_FAILURE_KEY

BASELINE_ATTR = "baseline"  # user attribute that marks the enqueued baseline trial in the Optuna study
OUTCOME_ATTR = "outcome"  # the trial's outcome (COMPLETE, TIMEOUT, ...), set by the searcher before Optuna is told
# A baseline that ended otherwise (a cold node's first launch timing out, a node failing) is queued again, this many
# attempts in all: a baseline that keeps failing ends the study ("no baseline") instead of spending the budget.
BASELINE_ATTEMPTS = 3
# The cause of a load failure a retry would repeat (out of memory at load, a missing file, an unsupported
# architecture: `serve.engines.load_failures`), in the trial's report and the Optuna trial's user attributes.
LOAD_FAILURE_ATTR = LOAD_FAILURE_KEY


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


def baseline_retried(outcome: str | None, error: bool = False, load_failure: str | None = None) -> bool:
    """Whether a baseline trial that ended with `outcome` (a stored value: Tune's report, the Optuna attribute) is
    queued again: after an error, an ending that names no outcome, or a failure of the machine
    (`Outcome.machine_failure`); never after a verdict on its config (INVALID: the engine refused the baseline's own
    flags, a retry would be refused too), nor after a load failure a retry would repeat (`load_failure`: its cause,
    e.g. out of memory at load). Pure."""
    if load_failure:
        return False
    ended = Outcome.read(outcome)
    return error or ended is None or ended.machine_failure


def enqueue_baseline(study: Any, space: SearchSpace) -> bool:
    """Put the baseline first in an Optuna study unless it has one that is waiting, running or completed (a resumed
    study) or one whose engine's load failed in a way a retry would repeat, or it already failed `BASELINE_ATTEMPTS`
    times. A baseline Optuna recorded COMPLETE with another outcome
    (TIMEOUT and LAUNCH_FAILED report the worst value, which Optuna records as COMPLETE) did not complete. Returns True
    if added."""
    # lazy: Optuna takes a second to import; only the paths that read or sample a study pay for it
    from optuna.trial import TrialState

    baselines = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get(BASELINE_ATTR)]
    done = [t for t in baselines if t.state in (TrialState.RUNNING, TrialState.WAITING) or (
        t.state == TrialState.COMPLETE and not baseline_retried(t.user_attrs.get(OUTCOME_ATTR, Outcome.COMPLETE.value),
                                                                load_failure=t.user_attrs.get(LOAD_FAILURE_ATTR)))]
    if done or len(baselines) >= BASELINE_ATTEMPTS:
        return False
    study.enqueue_trial(baseline_point(space), user_attrs={BASELINE_ATTR: True})
    return True


def baseline_waiting(study: Any) -> bool:
    """Whether the Optuna study has a baseline queued (the next trial asked for)."""
    # lazy: Optuna takes a second to import; only the paths that read or sample a study pay for it
    from optuna.trial import TrialState

    return any(t.user_attrs.get(BASELINE_ATTR) for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
