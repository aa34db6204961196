"""Ray Tune's searcher for simulate-first: the study's Optuna searcher (`constrained_search_class`: SLA figures and
PRUNED trials handled as in every study) whose suggestions after the baseline come from the simulator
(`SimulateFirstPlan`) instead of TPE: each chosen config is enqueued in the Optuna study and asked for, so Optuna's
storage, the resume checks and the report see ordinary trials. FINISHED once the plan's launches are spent; TPE
again for the rest of the budget when the plan fell back. Imported lazily (it imports Ray)."""

from __future__ import annotations

from typing import Any

from pipeline.search.simulate_first import SimulateFirstPlan
from pipeline.search.space.sampler import constrained_search_class
from pipeline.simulate.predict import PREDICTION_ATTR

__all__ = ["simulate_first_search_class"]


def simulate_first_search_class() -> Any:
    # lazy: Ray takes seconds to import; only the paths that use the cluster pay for it
    from ray.tune.search import Searcher

    class SimulateFirstSearch(constrained_search_class()):  # type: ignore[misc]
        def __init__(self, *args: Any, plan: SimulateFirstPlan, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.plan = plan

        def suggest(self, trial_id: str) -> dict[str, Any] | str | None:
            plan = self.plan
            if plan.baseline_id is None and plan.adopt(self._ot_study):
                pass  # a resumed study: its baseline ran under an earlier driver
            elif plan.baseline_id is None:  # the enqueued baseline
                config = super().suggest(trial_id)
                plan.on_suggested(trial_id, None)
                return config
            if plan.fallback is not None:
                return super().suggest(trial_id)
            if plan.waiting():
                return None  # Tune asks again later
            if plan.exhausted():  # a running launch may still widen the budget: wait for it before finishing
                return None if plan.running() else Searcher.FINISHED
            launch = plan.next_launch()
            if launch is None:
                return super().suggest(trial_id) if plan.fallback is not None else Searcher.FINISHED
            self._ot_study.enqueue_trial(launch.params, user_attrs={PREDICTION_ATTR: launch.figures})
            config = super().suggest(trial_id)
            plan.on_suggested(trial_id, launch)
            return config

        def on_trial_complete(self, trial_id: str, result: dict[str, Any] | None = None,
                              error: bool = False) -> None:
            super().on_trial_complete(trial_id, result, error)
            self.plan.on_complete(trial_id, None if error else result)

    return SimulateFirstSearch
