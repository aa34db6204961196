"""Issue #60, point 2: the dry run counts the launches of the strategy that will run (simulate-first's, not the
fallback search's), estimates the time from measured figures, and names a search space the engine can run."""

from __future__ import annotations

import pytest

from pipeline.config import load_study
from pipeline.search.space import Resolution, load_space
from pipeline.search.strategy import resolve_strategy
from pipeline.study.dry_checks import fitting_spaces, space_problem
from pipeline.study.estimate import estimate, figures_for, format_estimate
from pipeline.trial.gate import effective_mode
from pipeline.tune import sample_configs
from serve.model_store import KNOWN_MODELS


def _estimate(overrides, planned_search=None):
    study = load_study(None, overrides)
    space = load_space(study.search_space_path())
    strategy = resolve_strategy(study, space)
    known = KNOWN_MODELS.get(study.model.target)
    device = "cuda" if study.engine.device == "cuda" else "cpu"
    figures = figures_for(study.engine.kind, device, known.size_bytes if known else None, study.model.target)
    return study, strategy, estimate(study, strategy, effective_mode(study), figures, planned_search)


def test_the_default_study_is_simulate_first_with_eight_launches_in_its_measured_time():
    study, strategy, est = _estimate({})
    assert strategy.simulated
    assert est.launches == 8  # baseline + 1 predicted, then baseline + 1 finalist x 3 runs
    assert est.launches_most == 8 + 6 + 4  # widening to 8 search launches, 2 spread re-runs per config
    # docs/benchmarks.md, "Default study": the study took 133-195 s warm on the reference machine
    assert est.seconds is not None and 120 <= est.seconds <= 195
    text = format_estimate(est, strategy, study)
    assert "engine launches for simulate-first: 8" in text and "an estimate" in text and "docs/benchmarks.md" in text


def test_tpe_counts_the_planned_search_launches():
    _, strategy, est = _estimate({"search.strategy": "tpe"}, planned_search=7)
    assert not strategy.simulated and est.launches == 7 + 6


def test_equivalence_passes_are_counted():
    _, _, noise = _estimate({"promotion.equivalence": "baseline-noise", "workload.measure_prompts": 8})
    assert noise.launches == 8 + 1
    _, _, det = _estimate({"engine.kind": "sglang", "engine.device": "cuda", "promotion.equivalence":
                           "deterministic", "promotion.finalists": 0})
    assert det.launches == 2 + 2  # the baseline and the predicted config, each once more deterministic


def test_a_gpu_study_is_counted_not_timed():
    study, strategy, est = _estimate({"engine.kind": "sglang", "engine.device": "cuda"})
    assert est.seconds is None
    assert "not estimated" in format_estimate(est, strategy, study)


def test_a_bigger_model_and_longer_outputs_take_longer():
    _, _, small = _estimate({})
    _, _, big = _estimate({"model.target": "qwen2.5-coder-1.5b"})
    _, _, long = _estimate({"workload.max_new_tokens": 96})
    assert small.seconds and big.seconds and long.seconds
    assert big.seconds > 3 * small.seconds and long.seconds > 2 * small.seconds


def test_llama_cpp_is_pointed_at_its_own_spaces():
    assert fitting_spaces("llama_cpp")[0] == "llama-cpp-ngram.yaml"
    assert "default.yaml" not in fitting_spaces("llama_cpp") and fitting_spaces("cpu")[0] == "default.yaml"
    study = load_study(None, {"engine.kind": "llama_cpp"})
    space = load_space(study.search_space_path())
    sampled = sample_configs(space, study, 8)
    assert all(not r.valid for r in sampled[1:])  # what the issue saw: 7 of 8 INVALID
    problem = space_problem(study, space, sampled, fitting_spaces("llama_cpp"))
    assert problem and "--search-space search_spaces/llama-cpp-ngram.yaml" in problem


def test_a_space_the_engine_runs_is_no_problem():
    study = load_study(None, {})
    space = load_space(study.search_space_path())
    assert space_problem(study, space, sample_configs(space, study, 4), fitting_spaces("cpu")) is None


@pytest.mark.parametrize("valid", [False, True])
def test_every_sampled_speculative_config_invalid_is_a_problem(valid):
    study = load_study(None, {})
    space = load_space(study.search_space_path())
    sampled = sample_configs(space, study, 3)
    if not valid:  # force the verdicts: each speculative config refused, as a constraint of the space would
        sampled = [r if r.params.get("algorithm") == "none" else Resolution(r.params, None) for r in sampled]
    problem = space_problem(study, space, sampled, fitting_spaces("cpu"))
    assert (problem is None) == valid
    if problem:
        assert "all 2 sampled configs of ngram are INVALID" in problem
