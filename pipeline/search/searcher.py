"""Ray Tune's OptunaSearch, told which trials were PRUNED.

Ray 2.60's `OptunaSearch.on_trial_complete` marks a trial PRUNED only when its last result has no objective value and
no error, but Tune refuses a result without the objective metric (strict metric checking), so a trial that reported
can only end COMPLETE or FAIL there. Early stopping (pipeline/trial/pruning.py) ends a trial with outcome PRUNED; this
subclass hands such a trial to OptunaSearch as "no value, no error", which Optuna records as PRUNED (with the last
intermediate value, the partial throughput, for a single objective). A trial whose last result is still an
intermediate one (it ended without its final report, e.g. stopped by `time_budget_s`) is a FAIL, never a COMPLETE
with a partial value. Imported lazily (it imports Ray); a module-level class because Tune pickles the searcher into
its experiment checkpoint.
"""

from __future__ import annotations

from typing import Any

from ray.tune.search.optuna import OptunaSearch

from pipeline.vocabulary.outcome import Outcome
from pipeline.vocabulary.report import TrialReport


def completion(result: dict[str, Any] | None, error: bool) -> tuple[dict[str, Any] | None, bool]:
    """What OptunaSearch should be told for a trial that ended with `result` (its last report) and `error`. Pure."""
    report = TrialReport.from_tune(result)
    if error:
        return result, error
    if report.outcome is Outcome.PRUNED:
        return None, False  # OptunaSearch: no value and no error -> TrialState.PRUNED
    if report.intermediate:
        return None, True  # OptunaSearch: no value and an error -> TrialState.FAIL
    return result, error


class PruningOptunaSearch(OptunaSearch):
    def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None, error: bool = False) -> None:
        result, error = completion(result, error)
        super().on_trial_complete(trial_id, result=result, error=error)
