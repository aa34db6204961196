"""SLA limits: config validation, verdicts, and the Optuna constraints_func on the study's sampler."""

from __future__ import annotations

import optuna
import pytest

from pipeline.config import SlaConstraint, load_study
from pipeline.errors import ConfigError
from pipeline.decide.sla import check, constraint_attr, constraint_user_attrs, constraints_func
from pipeline.search.space import tpe_sampler


def test_config_accepts_limits_and_rejects_unknown_names() -> None:
    study = load_study(None, {"concurrency": [1, 4], "objective.constraints": [
        {"metric": "ttft_p99_ms", "max_ms": 500, "concurrency": 4}]})
    assert study.objective.constraints[0].concurrency == 4 and study.search_concurrency == 1
    with pytest.raises(ConfigError, match="objective.constraints.0.metric.*ttft_p98_ms"):
        load_study(None, {"objective.constraints": [{"metric": "ttft_p98_ms", "max_ms": 5}]})
    with pytest.raises(ConfigError, match="concurrency=8 is not a measured level"):
        load_study(None, {"objective.constraints": [{"metric": "ttft_p99_ms", "max_ms": 5, "concurrency": 8}]})
    with pytest.raises(ConfigError, match="unknown objective metric.*'throughput'"):
        load_study(None, {"objective.metrics": ["throughput"], "objective.modes": ["max"]})
    with pytest.raises(ConfigError, match="distinct"):
        load_study(None, {"concurrency": [8, 1, 8]})
    with pytest.raises(ConfigError, match="max_ms"):
        load_study(None, {"objective.constraints": [{"metric": "ttft_p99_ms", "max_ms": 0}]})


def test_verdicts_name_figure_and_limit() -> None:
    limits = [SlaConstraint(metric="ttft_p99_ms", max_ms=200), SlaConstraint(metric="itl_p50_ms", max_ms=30)]
    verdicts = check(limits, 4, {"ttft_p99_ms": 250.0, "itl_p50_ms": None})
    assert [v.ok for v in verdicts] == [False, False]
    assert verdicts[0].text == "ttft_p99_ms at concurrency 4: 250.0 ms > limit 200 ms"
    assert "not measured" in verdicts[1].text


def test_constraints_func_reads_user_attrs() -> None:
    limits = [SlaConstraint(metric="ttft_p99_ms", max_ms=200, concurrency=1),
              SlaConstraint(metric="e2e_p99_ms", max_ms=900, concurrency=4)]
    assert constraints_func(limits, 4) is not None and constraints_func(limits[:1], 4) is None
    func = constraints_func(limits, 1)
    assert func is not None, "a limit at concurrency 1 needs a constraints function"
    attrs = constraint_user_attrs(limits, 1, {"ttft_p99_ms": 250.0, "e2e_p99_ms": 10.0})
    assert attrs == {"sla.ttft_p99_ms@1": 250.0}
    trial = optuna.trial.create_trial(value=1.0, user_attrs=attrs)
    assert func(trial) == (50.0,)
    missing = optuna.trial.create_trial(value=1.0)
    assert func(missing)[0] > 0  # an unmeasured figure cannot satisfy a limit
    assert constraint_attr(SlaConstraint(metric="itl_p50_ms", max_ms=1)) == "sla.itl_p50_ms@any"


def test_study_sampler_marks_infeasible_trials() -> None:
    limits = [SlaConstraint(metric="ttft_p99_ms", max_ms=200)]
    sampler = tpe_sampler(0, 8, constraints=limits, search_level=1)
    study = optuna.create_study(sampler=sampler, direction="maximize")
    for figure, value in ((250.0, 10.0), (150.0, 5.0)):
        trial = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
        for key, v in constraint_user_attrs(limits, 1, {"ttft_p99_ms": figure}).items():
            trial.set_user_attr(key, v)
        study.tell(trial, value)
    # best_trial skips the faster but infeasible trial
    assert study.best_trial.value == 5.0
    assert tpe_sampler(0, 8)._constraints_func is None


def test_ray_search_hands_sla_figures_to_the_sampler() -> None:
    from pipeline.search.space.sampler import constrained_search_class

    limits = [SlaConstraint(metric="ttft_p99_ms", max_ms=200)]
    def space(trial: optuna.Trial) -> None:
        trial.suggest_float("x", 0, 1)

    search = constrained_search_class()(
        space, metric="tput_tok_s", mode="max",
        sampler=tpe_sampler(0, 8, constraints=limits, search_level=1), storage=optuna.storages.InMemoryStorage(),
        study_name="sla", seed=0)
    for i, (tput, ttft) in enumerate([(10.0, 250.0), (5.0, 150.0), (20.0, None)]):
        search.suggest(f"t{i}")
        attrs = constraint_user_attrs(limits, 1, {"ttft_p99_ms": ttft})
        search.on_trial_complete(f"t{i}", {"tput_tok_s": tput, **attrs})
    study = search._ot_study
    assert [t.system_attrs["constraints"][0] > 0 for t in study.trials] == [True, False, True]
    assert study.best_trial.value == 5.0  # the faster trials broke the limit or did not measure it


def test_the_constrained_sampler_survives_tune_checkpointing_by_pickle() -> None:
    # Ray Tune checkpoints the searcher by pickling its state, sampler included (a closure failed the study).
    import pickle

    limits = [SlaConstraint(metric="ttft_p99_ms", max_ms=100.0)]
    sampler = pickle.loads(pickle.dumps(tpe_sampler(0, 8, constraints=limits, search_level=1)))
    trial = type("T", (), {"user_attrs": {constraint_attr(limits[0]): 150.0}})()
    assert tuple(sampler._constraints_func(trial)) == (50.0,)
