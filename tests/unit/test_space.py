"""Search-space files: loading errors, conditional sampling, baseline first, resolution into TrialConfig."""

from pathlib import Path

import optuna
import pytest

from pipeline.config import SEARCH_SPACES_DIR, load_study
from pipeline.errors import ConfigError
from pipeline.search.space import (
    BASELINE_ATTR, baseline_point, define_by_run, enqueue_baseline, grid_points, load_space, resolve,
)
from pipeline.tune import sample_configs
from serve.spec import NgramSpec, NoSpec, StandaloneSpec

BUNDLED = sorted(SEARCH_SPACES_DIR.glob("*.yaml"))


def space_file(tmp_path, text):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return path


def test_the_bundled_spaces_exist_and_load():
    names = {p.name for p in BUNDLED}
    assert {"default.yaml", "ngram.yaml", "eagle3.yaml", "standalone.yaml", "all.yaml"} <= names
    for path in BUNDLED:
        assert "none" in load_space(path).algorithms


@pytest.mark.parametrize("text, fragments", [
    ("algorithms: [none, ngram]\nbranches:\n  ngram:\n    num_draft_tokns: {type: int, low: 2, high: 4}\n",
     ["branches.ngram.num_draft_tokns", "did you mean 'num_draft_tokens'"]),
    ("algorithms: [none, ngram]\nbranches:\n  ngram:\n    num_draft_tokens: {type: int, low: 8, high: 4}\n",
     ["branches.ngram.num_draft_tokens", "low=8, high=4"]),
    ("algorithms: [none, ngram]\nbranches:\n  ngram:\n    match_type: {type: categorical, choices: []}\n",
     ["branches.ngram.match_type.categorical.choices"]),
    ("algorithms: [none, ngram]\nbranches:\n  ngram:\n    match_type: {type: categorical, choices: [BFS, bfs]}\n",
     ["'bfs' is not a valid match_type"]),
    ("algorithms: [none, medusa]\n", ["algorithms.1", "'medusa'"]),
    ("algorithms: [ngram]\n", ["must include 'none'"]),
    ("algorithms: [none]\n", ["at least one speculative algorithm"]),
    ("algorithms: [none, ngram]\nbranches:\n  eagle3: {}\n", ["branches.eagle3", "not listed in algorithms"]),
    ("algorithms: [none, ngram]\nbranchs: {}\n", ["branchs", "did you mean 'branches'"]),
    ("algorithms: [none, ngram]\ncommon:\n  num_draft_tokens: {type: fixed, value: 4}\n",
     ["common.num_draft_tokens", "belong under branches"]),
    ("algorithms: [none, ngram]\nbranches:\n  ngram:\n    num_draft_tokens: {type: int, low: 2, high: 9}\n"
     "    max_bfs_breadth: {type: int, low: 1, high: num_draft_tokens + later}\n",
     ["branches.ngram.max_bfs_breadth.high", "['later']"]),
    ("algorithms: [none, ngram]\nbranches:\n  ngram:\n    num_draft_tokens: {type: int, low: 0, high: 4}\n",
     ["branches.ngram.num_draft_tokens.low", "greater than or equal to 1"]),
])
def test_bad_space_files_name_file_key_and_value(tmp_path, text, fragments):
    path = space_file(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_space(path)
    message = str(err.value)
    assert str(path) in message
    for fragment in fragments:
        assert fragment in message


def sampled(space_path, count=30, seed=0):
    space = load_space(space_path)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed))
    enqueue_baseline(study, space)
    fn = define_by_run(space)
    trials = []
    for _ in range(count):
        trial = study.ask()
        constants = fn(trial)  # suggest first: trial.params fills as the function runs
        trials.append((trial, {**trial.params, **constants}))
    return space, study, trials


@pytest.mark.parametrize("path", BUNDLED, ids=lambda p: p.name)
def test_params_of_other_branches_never_appear(path):
    _, _, trials = sampled(path)
    for _, params in trials:
        algorithm = params["algorithm"]
        for name in params:
            if "." in name:
                assert name.startswith(f"{algorithm}."), (algorithm, params)


def test_baseline_is_trial_zero_and_never_resampled():
    _, study, trials = sampled(SEARCH_SPACES_DIR / "default.yaml")
    first, params = trials[0]
    assert first.number == 0 and first.user_attrs[BASELINE_ATTR] and params["algorithm"] == "none"
    assert all(p["algorithm"] != "none" for _, p in trials[1:])


def test_enqueue_baseline_is_idempotent_for_a_resumed_study():
    space = load_space(SEARCH_SPACES_DIR / "default.yaml")
    study = optuna.create_study()
    assert enqueue_baseline(study, space) is True
    study.ask()
    assert enqueue_baseline(study, space) is False


def test_dependent_bounds_keep_points_valid():
    study_cfg = load_study(None, {"engine.kind": "sglang", "model.drafts": {"eagle3": "head"}})
    space, _, trials = sampled(SEARCH_SPACES_DIR / "eagle3.yaml", count=60)
    for _, params in trials:
        resolution = resolve(space, params, study_cfg)
        assert resolution.valid, resolution.violations
    space, _, trials = sampled(SEARCH_SPACES_DIR / "ngram.yaml", count=60)
    for _, params in trials[1:]:
        if params["ngram.match_type"] == "BFS":  # PROB points have no min_bfs_breadth (a `when` condition)
            assert params["ngram.min_bfs_breadth"] <= params["ngram.max_bfs_breadth"]
        else:
            assert "ngram.min_bfs_breadth" not in params


def test_resolve_builds_trial_configs_with_fixed_values_and_study_settings():
    space = load_space(SEARCH_SPACES_DIR / "default.yaml")
    study = load_study(None, {"concurrency": [4, 8]})
    base = resolve(space, {"algorithm": "none", **baseline_point(space)}, study)
    assert base.valid and base.config is not None
    assert base.config.spec == NoSpec() and base.config.warmup_requests == 2
    assert base.config.concurrency == 4  # the target level is the first one
    point = {"algorithm": "ngram", "ngram.num_draft_tokens": 3, "ngram.max_bfs_breadth": 2,
             "ngram.match_type": "PROB", "ngram.max_trie_depth": 6, "ngram.warmup_requests": 12}
    cfg = resolve(space, point, study).config
    assert cfg is not None
    assert cfg.spec == NgramSpec(num_draft_tokens=3, max_bfs_breadth=2, min_bfs_breadth=1, match_type="PROB",
                                 max_trie_depth=6, capacity=1_000_000)
    assert cfg.warmup_requests == 12  # the branch overrides the common fixed value


def test_invalid_points_carry_their_reasons():
    space = load_space(SEARCH_SPACES_DIR / "standalone.yaml")
    point = {"algorithm": "standalone", "standalone.num_steps": 2, "standalone.topk": 2,
             "standalone.num_draft_tokens": 5}
    missing = resolve(space, point, load_study(None))
    assert not missing.valid and [v.field for v in missing.violations] == ["spec.draft_model"]
    ok = resolve(space, point, load_study(None, {"model.drafts": {"standalone": "qwen2.5-coder-0.5b"}}))
    assert ok.valid and ok.config is not None and isinstance(ok.config.spec, StandaloneSpec)
    assert ok.config.spec.draft_model == "qwen2.5-coder-0.5b"


def test_dry_run_sampling_is_seeded():
    space = load_space(SEARCH_SPACES_DIR / "ngram.yaml")
    study = load_study(None, {"seed": 3})
    first = [r.params for r in sample_configs(space, study, 6)]
    assert first == [r.params for r in sample_configs(space, study, 6)]
    assert first[0] == {"algorithm": "none"}
    assert first != [r.params for r in sample_configs(space, load_study(None, {"seed": 4}), 6)]


def test_space_files_only_use_known_keys():
    # Guard against a bundled file silently growing keys the loader ignores (extra="forbid" everywhere).
    for path in BUNDLED:
        assert Path(path).read_text().strip()
        load_space(path)


def test_a_failed_baseline_is_enqueued_again():
    space = load_space(SEARCH_SPACES_DIR / "default.yaml")
    study = optuna.create_study()
    enqueue_baseline(study, space)
    trial = study.ask()
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    assert enqueue_baseline(study, space) is True


def test_the_sampler_pickles():
    # Tune checkpoints the searcher, define-by-run function included.
    import pickle

    sampler = define_by_run(load_space(SEARCH_SPACES_DIR / "ngram.yaml"))
    assert pickle.loads(pickle.dumps(sampler)).speculative == ["ngram"]


def test_grid_points_enumerate_every_branch_point_once_baseline_first():
    space = load_space(SEARCH_SPACES_DIR / "grid-small.yaml")
    points = grid_points(space)
    assert points[0] == {"algorithm": "none"}
    ngram = points[1:]
    assert len(ngram) == 5 * 2 * 3  # draft 2..10 step 2, breadth 1 or 4, warm-up 0/4/8
    assert len({tuple(sorted(p.items())) for p in ngram}) == len(ngram)
    assert {p["ngram.max_bfs_breadth"] for p in ngram} == {1, 4}
    assert all("ngram.match_type" not in p for p in ngram)  # fixed values are not Optuna params
    study_cfg = load_study(None, {})
    assert all(resolve(space, p, study_cfg).valid for p in points)


def test_grid_points_follow_dependent_bounds(tmp_path):
    space = load_space(space_file(tmp_path, "algorithms: [none, ngram]\nbranches:\n  ngram:\n"
                                       "    max_bfs_breadth: {type: int, low: 1, high: 3}\n"
                                       "    min_bfs_breadth: {type: int, low: 1, high: max_bfs_breadth}\n"))
    pairs = [(p["ngram.max_bfs_breadth"], p["ngram.min_bfs_breadth"]) for p in grid_points(space)[1:]]
    assert pairs == [(1, 1), (2, 1), (2, 2), (3, 1), (3, 2), (3, 3)]


def test_grid_points_refuse_continuous_parameters_and_huge_spaces(tmp_path):
    space = load_space(space_file(tmp_path, "algorithms: [none, eagle]\nbranches:\n  eagle:\n"
                                       "    num_steps: {type: int, low: 1, high: 4, log: true}\n"))
    with pytest.raises(ConfigError, match="eagle.num_steps: a log-scaled parameter has no finite grid"):
        grid_points(space)
    with pytest.raises(ConfigError, match="more than 1000 points"):
        grid_points(load_space(SEARCH_SPACES_DIR / "default.yaml"), limit=1000)


def test_a_bundled_space_is_found_by_its_name_with_or_without_yaml():
    for name in ("grid-small", "grid-small.yaml"):
        assert load_study(None, {"search_space": name}).search_space_path() == SEARCH_SPACES_DIR / "grid-small.yaml"


# --- bounds are checked at load (issue #15 item 14) ---------------------------------------------------------------

def test_a_bound_dividing_by_literal_zero_fails_at_load_naming_parameter_and_expression(tmp_path):
    path = space_file(tmp_path, "algorithms: [none, ngram]\nbranches:\n  ngram:\n"
                                "    max_bfs_breadth: {type: int, low: 1, high: 4}\n"
                                "    num_draft_tokens: {type: int, low: 2, high: max_bfs_breadth // 0}\n")
    with pytest.raises(ConfigError) as err:
        load_space(path)
    assert "branches.ngram.num_draft_tokens.high: 'max_bfs_breadth // 0' divides by zero" in str(err.value)


def test_a_bound_dividing_by_a_parameter_that_can_be_zero_fails_at_load(tmp_path):
    path = space_file(tmp_path, "algorithms: [none, ngram]\nbranches:\n  ngram:\n"
                                "    warmup_requests: {type: int, low: 0, high: 4}\n"
                                "    num_draft_tokens: {type: int, low: 2, high: 16 // warmup_requests}\n")
    with pytest.raises(ConfigError) as err:
        load_space(path)
    message = str(err.value)
    assert "branches.ngram.num_draft_tokens.high: '16 // warmup_requests' cannot be evaluated" in message
    assert "{'warmup_requests': 0}" in message


def test_bound_evaluation_errors_are_config_errors_not_tracebacks():
    from pipeline.search.space import evaluate_bound

    with pytest.raises(ConfigError, match=r"ngram.x.high: 'a // b' cannot be evaluated .* with \{'a': 4, 'b': 0\}"):
        evaluate_bound("a // b", {"a": 4, "b": 0}, "ngram.x.high")
    with pytest.raises(ConfigError, match="is not allowed"):
        evaluate_bound("__import__('os')", {}, "x")
    assert evaluate_bound("min(a, 3) + 1", {"a": 7}) == 4


def test_a_conditional_parameter_exists_only_where_its_condition_holds(tmp_path):
    # PROB ignores min_bfs_breadth (SGLang's trie.cpp): sampling it there would only add noise to the search.
    from pipeline.search.space import grid_points

    path = tmp_path / "s.yaml"
    path.write_text("algorithms: [none, ngram]\nbranches:\n  ngram:\n"
                    "    max_bfs_breadth: {type: int, low: 2, high: 2}\n"
                    "    match_type: {type: categorical, choices: [BFS, PROB]}\n"
                    "    min_bfs_breadth: {type: int, low: 1, high: max_bfs_breadth, when: {match_type: [BFS]}}\n")
    space = load_space(path)
    points = grid_points(space)
    prob = [p for p in points if p.get("ngram.match_type") == "PROB"]
    bfs = [p for p in points if p.get("ngram.match_type") == "BFS"]
    assert len(prob) == 1 and "ngram.min_bfs_breadth" not in prob[0]
    assert sorted(p["ngram.min_bfs_breadth"] for p in bfs) == [1, 2]
    study = load_study(None, {})
    prob_config = resolve(space, prob[0], study).config
    assert prob_config is not None and isinstance(prob_config.spec, NgramSpec)
    assert prob_config.spec.min_bfs_breadth == 1  # the field keeps its default


def test_a_condition_must_name_an_earlier_parameter(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("algorithms: [none, ngram]\nbranches:\n  ngram:\n"
                    "    min_bfs_breadth: {type: int, low: 1, high: 2, when: {match_type: [BFS]}}\n"
                    "    match_type: {type: categorical, choices: [BFS, PROB]}\n")
    with pytest.raises(ConfigError, match="'match_type' is not a parameter defined before 'min_bfs_breadth'"):
        load_space(path)
