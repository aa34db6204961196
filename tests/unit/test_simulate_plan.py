"""simulate-first's driver-side plan without Ray or MLflow: the baseline first and alone, one predicted launch,
widening while the logged error exceeds the threshold, a failed launch replaced by the next best, never past the
trial budget, and the summary the study run records. The simulator is a stand-in that returns fixed predictions
(the real one is tested in test_simulate_replay/cost and end to end in tests/integration/test_simulate_study.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from pipeline.config import TrialConfig, load_study
from pipeline.search.simulate_first import SimulateFirstPlan
from pipeline.search.simulated import Predicted
from pipeline.simulate.cost import CostModel
from serve.spec import NgramSpec


def draft_tokens(config: TrialConfig) -> int:
    assert isinstance(config.spec, NgramSpec), f"this plan only has NGRAM configs, got {config.spec!r}"
    return config.spec.num_draft_tokens


class FixedSimulator:
    def __init__(self, figures: dict[int, float]) -> None:
        self.figures = figures

    def fitted(self, base: CostModel, launched: Any) -> CostModel:
        return base.model_copy(update={"launches": len(launched)})

    def predict(self, config: TrialConfig, cost: CostModel) -> dict[str, float]:
        return {"tput_tok_s": self.figures[draft_tokens(config)]}

    def signature(self, config: TrialConfig) -> str:
        tokens = draft_tokens(config)
        return f"class-{self.classes.get(tokens, tokens)}"

    classes: dict[int, int] = {}  # draft tokens -> a shared class (configs with one replay)


@dataclass
class Ctx:
    study: Any
    tracker: Any = None
    parent_run_id: str = ""
    output_dir: str = "."
    warmup: tuple = ()
    measure: tuple = ()


def plan_with(**settings: Any) -> SimulateFirstPlan:
    study = load_study(None, {f"search.simulate.{k}": v for k, v in settings.items()})
    plan = SimulateFirstPlan(Ctx(study), space=None)  # type: ignore[arg-type]
    figures = {2: 10.0, 4: 20.0, 6: 15.0, 8: 12.0}
    predicted = [Predicted({"algorithm": "ngram", "ngram.num_draft_tokens": n},
                           TrialConfig(spec=NgramSpec(num_draft_tokens=n)), {"tput_tok_s": v})
                 for n, v in figures.items()]
    cost = CostModel(shape="prior", k=1.0)
    plan._cache.update(simulator=FixedSimulator(figures), base=cost, cost=cost, launched=[],
                       explored=type("E", (), {"predicted": predicted})(),
                       ranked=sorted(predicted, key=lambda p: -p.figures["tput_tok_s"]))
    plan._remember_launch = lambda trial_id: None  # type: ignore[method-assign]  # no MLflow records here
    return plan


def launch_next(plan: SimulateFirstPlan, trial_id: str) -> int:
    launch = plan.next_launch()
    assert launch is not None
    plan.on_suggested(trial_id, launch)
    return draft_tokens(launch.config)


def test_the_baseline_then_the_best_prediction_and_then_nothing_when_it_hit():
    plan = plan_with(min_distance=1)
    plan.on_suggested("t0", None)
    assert plan.waiting() and not plan.exhausted()
    plan.on_complete("t0", {"outcome": "COMPLETE", "tput_tok_s": 9.0})
    assert launch_next(plan, "t1") == 4
    assert plan.exhausted() and plan.running()  # the searcher waits, then finishes
    plan.on_complete("t1", {"outcome": "COMPLETE", "tput_tok_s": 19.0, "mlflow_run_id": ""})  # 5% off: a hit
    assert plan.exhausted() and not plan.running()
    summary = plan.summary()
    assert summary["median_error"] == abs(20.0 - 19.0) / 19.0 and summary["widened"] == 0 and not summary["missed"]


def test_a_miss_widens_by_one_until_the_budget_and_a_failed_launch_is_replaced():
    plan = plan_with(min_distance=1)
    plan.on_suggested("t0", None)
    plan.on_complete("t0", {"outcome": "COMPLETE", "tput_tok_s": 9.0})
    assert launch_next(plan, "t1") == 4
    plan.on_complete("t1", {"outcome": "COMPLETE", "tput_tok_s": 10.0, "mlflow_run_id": ""})  # 100% off
    assert not plan.exhausted() and plan.widened == 1
    assert launch_next(plan, "t2") == 6  # the next best, never a launched one
    plan.on_complete("t2", {"outcome": "LAUNCH_FAILED"})  # nothing measured: the next takes its place
    assert not plan.exhausted() and plan.widened == 1
    assert launch_next(plan, "t3") == 8
    small = plan_with(min_distance=1)
    cast(Ctx, small.ctx).study = load_study(None, {"budget.max_trials": 2})  # plan_with's stand-in for a TrialContext
    small.on_suggested("t0", None)
    small.on_complete("t0", {"outcome": "COMPLETE", "tput_tok_s": 9.0})
    launch_next(small, "t1")
    small.on_complete("t1", {"outcome": "COMPLETE", "tput_tok_s": 10.0, "mlflow_run_id": ""})
    assert small.exhausted() and small.widened == 0  # missed, but 2 trials is the whole budget


def test_a_failed_baseline_falls_back_to_tpe():
    plan = plan_with()
    plan.on_suggested("t0", None)
    plan.on_complete("t0", {"outcome": "UNHEALTHY"})
    assert plan.fallback and "UNHEALTHY" in plan.fallback and not plan.exhausted()
    assert plan.next_launch() is None


def test_a_miss_within_the_measurements_noise_is_a_hit():
    plan = plan_with(min_distance=1)
    plan.on_suggested("t0", None)
    plan.on_complete("t0", {"outcome": "COMPLETE", "tput_tok_s": 9.0})
    launch_next(plan, "t1")  # predicted 20
    # 25% off, but the measurement itself is only known to within +-20%: 5% beyond it, under the 10% threshold
    plan.on_complete("t1", {"outcome": "COMPLETE", "tput_tok_s": 16.0, "tput_noise": 0.2, "mlflow_run_id": ""})
    assert plan.widened == 0 and plan.exhausted() and not plan.summary()["missed"]
    assert plan.summary()["median_error"] == 0.25


def test_a_config_the_simulator_cannot_tell_from_a_launched_one_is_never_launched(monkeypatch):
    monkeypatch.setattr(FixedSimulator, "classes", {6: 4})  # 6 draft tokens replay exactly as 4 do
    plan = plan_with(min_distance=1)
    plan.on_suggested("t0", None)
    plan.on_complete("t0", {"outcome": "COMPLETE", "tput_tok_s": 9.0})
    assert launch_next(plan, "t1") == 4
    plan.on_complete("t1", {"outcome": "COMPLETE", "tput_tok_s": 10.0, "mlflow_run_id": ""})  # a miss: widen
    assert launch_next(plan, "t2") == 8  # 6, second in the ranking, is the same config as 4 to the instrument


def test_a_launch_disturbed_in_every_window_neither_judges_nor_refits():
    plan = plan_with(min_distance=1)
    plan.on_suggested("t0", None)
    plan.on_complete("t0", {"outcome": "COMPLETE", "tput_tok_s": 9.0})
    launch_next(plan, "t1")
    refits = []
    plan._refit = lambda trial_id: refits.append(trial_id)  # type: ignore[method-assign]
    plan.on_complete("t1", {"outcome": "COMPLETE", "tput_tok_s": 10.0, "measurement_flag": "disturbed",
                            "mlflow_run_id": ""})  # 100% off, but measured the machine's load
    assert plan.widened == 0 and refits == [] and plan.summary()["median_error"] is None
