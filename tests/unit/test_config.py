"""StudyConfig / TrialConfig: YAML loading, precedence, error messages, round trips."""

import json

import pytest
import yaml

from pipeline.config import StudyConfig, TrialConfig, load_study, study_to_yaml, validate_trial
from pipeline.errors import ConfigError
from serve.spec import Eagle3Spec, NgramSpec, StandaloneSpec


def write(tmp_path, text, name="study.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_run_the_cpu_engine_with_the_smallest_model():
    study = load_study(None)
    assert study.engine.kind == "cpu" and study.model.target == "smollm2-135m"
    assert study.search_space_path().name == "default.yaml" and study.search_space_path().exists()


def test_precedence_cli_over_file_over_defaults(tmp_path):
    path = write(tmp_path, "name: mine\nbudget: {max_trials: 5}\nseed: 7\n")
    study = load_study(path, {"budget.max_trials": 3})
    assert study.budget.max_trials == 3  # CLI wins
    assert study.seed == 7 and study.name == "mine"  # file wins over defaults
    assert study.workload.max_new_tokens == StudyConfig().workload.max_new_tokens  # default kept


def test_misspelled_key_names_key_and_suggestion(tmp_path):
    path = write(tmp_path, "budget:\n  max_trails: 5\n")
    with pytest.raises(ConfigError) as err:
        load_study(path)
    message = str(err.value)
    assert str(path) in message and "budget.max_trails" in message and "did you mean 'max_trials'" in message


def test_bad_value_names_field_and_value(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_study(write(tmp_path, "engine: {kind: tpu}\nconcurrency: [0]\n"))
    message = str(err.value)
    assert "engine.kind" in message and "'tpu'" in message and "concurrency" in message


@pytest.mark.parametrize("text, fragment", [
    ("- a\n- b\n", "must be a mapping"),
    ("name: [unclosed\n", "not valid YAML"),
])
def test_malformed_files(tmp_path, text, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_study(write(tmp_path, text))


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_study(tmp_path / "nope.yaml")


def test_objective_lists_must_match():
    with pytest.raises(ConfigError, match="same length"):
        load_study(None, {"objective.metrics": ["tput_tok_s", "ttft_p50_ms"], "objective.modes": ["max"]})


def test_study_yaml_round_trip(tmp_path):
    study = load_study(None, {"name": "rt", "model.drafts": {"standalone": "qwen2.5-coder-0.5b"},
                              "concurrency": [1, 4], "tracking.uri": "sqlite:///x.db"})
    again = load_study(write(tmp_path, study_to_yaml(study)))
    assert again == study


@pytest.mark.parametrize("trial", [
    TrialConfig(),
    TrialConfig(spec=NgramSpec(num_draft_tokens=3), warmup_requests=8, max_running_requests=4, concurrency=2),
    TrialConfig(spec=StandaloneSpec(draft_model="d", num_steps=2, topk=2, num_draft_tokens=5)),
])
def test_trial_round_trip_json_and_yaml(trial):
    assert TrialConfig.model_validate_json(trial.model_dump_json()) == trial
    assert TrialConfig.model_validate(yaml.safe_load(yaml.safe_dump(trial.model_dump(mode="json")))) == trial
    assert json.loads(trial.model_dump_json())["spec"]["algorithm"] == trial.spec.algorithm


def test_validate_trial_checks_the_engine():
    eagle = TrialConfig(spec=Eagle3Spec(draft_model="head"))
    assert validate_trial(eagle, "sglang") == []
    (v,) = validate_trial(eagle, "cpu")
    assert v.field == "spec.algorithm" and "eagle3" in v.value


def test_output_path_defaults_under_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_study(None, {"name": "s1"}).output_path() == tmp_path / "runs" / "s1"
    assert str(load_study(None, {"output_dir": "/x/y"}).output_path()) == "/x/y"


# --- errors at load, not at trial 5 (issue #15 item 14) -----------------------------------------------------------

@pytest.mark.parametrize("override, fragments", [
    ({"promotion.equivalence_threshold": 0}, ["promotion.equivalence_threshold", "got 0", "Fix: 1.0 for fp32"]),
    ({"promotion.tie_tolerance": 1.5}, ["promotion.tie_tolerance", "got 1.5", "Fix: e.g. 0.01"]),
    ({"promotion.tie_tolerance": 1}, ["promotion.tie_tolerance", "[0, 1)"]),
    ({"promotion.margin": float("inf")}, ["promotion.margin", "finite"]),
    ({"promotion.finalists": -1}, ["promotion.finalists", "greater than or equal to 0", "got -1"]),
    ({"workload.max_new_tokens": 10**9}, ["workload.max_new_tokens", "<= 32768", "got 1000000000", "Fix:"]),
    ({"engine.extra_flags": ["--port", "1"]}, ["engine.extra_flags", "'--port' sets --port", "Fix: remove it"]),
    ({"engine.extra_flags": ["--speculative-num-draft-tokens=3"]},
     ["'--speculative-num-draft-tokens=3' sets --speculative-num-draft-tokens"]),
    ({"engine.extra_flags": ["--spec", "NGRAM"]}, ["'--spec' is a prefix of --speculative-"]),
    ({"engine.kind": "sglang", "engine.weights": "gguf"},
     ["engine.weights='gguf'", "cpu engine only", "Fix: remove engine.weights"]),
    ({"engine.extra_flags": ["--weights", "fp32"]}, ["'--weights' sets --weights"]),
])
def test_values_that_would_fail_mid_study_fail_at_load(override, fragments):
    with pytest.raises(ConfigError) as err:
        load_study(None, override)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_extra_flags_the_tuner_does_not_render_pass():
    study = load_study(None, {"engine.extra_flags": ["--mem-fraction-static", "0.8", "--log-level=debug"]})
    assert study.engine.extra_flags == ["--mem-fraction-static", "0.8", "--log-level=debug"]


def test_bounds_at_their_edges_are_accepted():
    study = load_study(None, {"promotion.equivalence_threshold": 1.0, "promotion.tie_tolerance": 0,
                              "workload.max_new_tokens": 32768, "promotion.finalists": 0})
    assert study.workload.max_new_tokens == 32768 and study.promotion.finalists == 0


def test_zero_finalists_means_search_only_and_the_decision_says_nothing_was_re_measured():
    from pipeline.study.finalize import no_finalist_reason

    search_only = no_finalist_reason(0, infeasible=False)
    assert search_only.startswith("keep baseline: promotion.finalists is 0")
    assert "nothing was re-measured" in search_only and "nothing can be promoted" in search_only
    assert "promotion.finalists >= 1" in search_only  # the fix is named
    # With finalists asked for, the reason is about the trials, not the setting.
    none_fit = no_finalist_reason(1, infeasible=True)
    assert "no speculative trial completed" in none_fit and "SLA limits" in none_fit
    assert "re-measured" not in none_fit and "SLA" not in no_finalist_reason(2, infeasible=False)


# --- credentials (issue #15 item 6) -------------------------------------------------------------------------------

def test_the_resolved_study_masks_passwords_but_the_config_keeps_them():
    study = load_study(None, {"storage.url": "postgresql://tuner:hunter2@db:5432/optuna",
                              "tracking.uri": "https://bob:s3cret@mlflow.example/?token=abc"})
    text = study_to_yaml(study)
    assert "hunter2" not in text and "s3cret" not in text and "abc" not in text
    assert "postgresql://tuner:***@db:5432/optuna" in text
    assert study.storage.url == "postgresql://tuner:hunter2@db:5432/optuna"  # still usable to connect
