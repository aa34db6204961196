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
