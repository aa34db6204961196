"""The study's sampler: one definition, used by the study, by `--dry-run` and by the search-efficiency replay."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pipeline.decide.sla import constraints_func
from pipeline.search.space.define import (BASELINE_ATTR, LOAD_FAILURE_ATTR, OUTCOME_ATTR, baseline_retried,
                                          baseline_waiting, enqueue_baseline)
from pipeline.vocabulary.outcome import NO_REPORT
from pipeline.vocabulary.report import TrialReport

if TYPE_CHECKING:
    from pipeline.config import SlaConstraint


def startup_trials(max_trials: int) -> int:
    """Random trials before TPE models the results: Optuna's default of 10 would make an 8-trial study pure random
    search. A quarter of the budget, 3 to 10 (the baseline counts as one). Measured by
    `python benchmarks/search_efficiency.py replay --seeds 100 [--startup-trials 10]` (docs/benchmarks.md)."""
    return min(10, max(3, max_trials // 4))


def tpe_sampler(seed: int, max_trials: int, n_startup_trials: int | None = None, *,
                constraints: Sequence[SlaConstraint] = (), search_level: int = 1) -> Any:
    """Multivariate TPE with conditional groups (branches), seeded. `n_startup_trials` overrides
    `startup_trials(max_trials)` (the search-efficiency replay compares the two). SLA limits that hold at
    `search_level` become Optuna's `constraints_func` (pipeline/decide/sla.py: the trial must set the user attributes
    `pipeline.decide.sla.constraint_user_attrs` names); without such limits the sampler is unconstrained."""
    # lazy: Optuna takes a second to import; only the paths that read or sample a study pay for it
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # Optuna 5 deprecates constraints_func (removal planned for 7) for Trial.set_constraint, which a trial
        # inside Ray Tune cannot call on the driver's study; the sampler argument still works the same.
        warnings.filterwarnings("ignore", message=".*constraints_func.*", category=FutureWarning)
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True,
                                          n_startup_trials=n_startup_trials or startup_trials(max_trials),
                                          constraints_func=constraints_func(constraints, search_level))


def constrained_search_class() -> Any:
    """Ray Tune's `OptunaSearch` that copies a trial's SLA figures (result keys starting `sla.`, as
    `pipeline.decide.sla.constraint_user_attrs` names them) and its outcome into the Optuna trial's user attributes
    before telling Optuna, so the sampler's `constraints_func` sees them: the trial runs in a Ray worker and cannot
    touch the driver's study. The baseline runs alone (no trial starts beside it: trials on one node share its host
    CPU, where NGRAM drafts, its PCIe and its disk), and a baseline that did not complete is queued again
    (`enqueue_baseline`)."""
    from pipeline.search.searcher import PruningOptunaSearch  # imports Ray: only here; it also maps PRUNED trials

    class ConstrainedOptunaSearch(PruningOptunaSearch):  # type: ignore[misc]
        def _baseline_blocks(self) -> bool:
            """While the baseline runs, or is next while other trials run, nothing more starts (Tune asks again)."""
            live = [t for tid, t in self._ot_trials.items() if tid not in self._completed_trials]
            if any(t.user_attrs.get(BASELINE_ATTR) for t in live):
                return True
            return bool(live) and baseline_waiting(self._ot_study)

        def suggest(self, trial_id: str) -> dict[Any, Any] | None:
            if trial_id not in self._ot_trials and self._baseline_blocks():
                return None
            return super().suggest(trial_id)

        def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None,
                              error: bool = False) -> None:
            ot_trial = self._ot_trials.get(trial_id)
            report = TrialReport.from_tune(result)
            outcome = report.said if report.said != NO_REPORT else None
            load_failure = report.load_failure
            if result and ot_trial is not None:
                for key, value in report.sla.items():
                    ot_trial.set_user_attr(key, value)
                if outcome is not None:
                    ot_trial.set_user_attr(OUTCOME_ATTR, outcome)
                if load_failure is not None:
                    ot_trial.set_user_attr(LOAD_FAILURE_ATTR, load_failure)
            super().on_trial_complete(trial_id, result, error)
            space = getattr(self._space, "space", None)  # the define-by-run SpaceSampler's
            if ot_trial is None or not ot_trial.user_attrs.get(BASELINE_ATTR) or space is None:
                return
            if baseline_retried(outcome, error, load_failure):
                if enqueue_baseline(self._ot_study, space):
                    print(f"the baseline ended {outcome or 'with an error'}: queued again, to run alone next",
                          flush=True)
            elif load_failure:
                print(f"the baseline ended {outcome}: its engine's load failed ({load_failure}), which a retry would "
                      "repeat: not queued again", flush=True)

    return ConstrainedOptunaSearch
