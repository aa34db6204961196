"""Issue #63 item 9: inputs refused at load, naming where: a lone surrogate in a workload, a seed numpy refuses,
a key given twice in a YAML file, a parameter default outside its range, a 1-prompt workload with a warm-up."""

from __future__ import annotations

import json

import pytest

from pipeline.config import load_study
from pipeline.errors import ConfigError
from pipeline.preflight import check_workload
from pipeline.search.space import load_space
from pipeline.workloads import WorkloadError, load_workload, read_prompts

SPACE = "algorithms: [none, ngram]\nbranches:\n  ngram:\n    num_draft_tokens: {type: int, low: 2, high: 8%s}\n"


def test_a_lone_surrogate_is_refused_at_load_naming_the_row(tmp_path):
    path = tmp_path / "w.jsonl"
    # json.loads turns the unpaired escape into a lone surrogate; the file itself is valid UTF-8
    path.write_text('{"prompt": "fine"}\n{"prompt": "bad \\ud83d here"}\n', encoding="utf-8")
    with pytest.raises(WorkloadError) as caught:
        read_prompts(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:2: field 'prompt' holds a lone surrogate (U+D83D at character 4)")
    chat = tmp_path / "c.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "x\udc00"}]}, ensure_ascii=True) + "\n")
    with pytest.raises(WorkloadError, match=r"c.jsonl:1: field 'messages.0.content' holds a lone surrogate"):
        read_prompts(chat)


def test_the_preflight_refuses_it_instead_of_crashing(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "\\udfff"}\n', encoding="utf-8")
    with pytest.raises(WorkloadError, match="w.jsonl:3"):
        check_workload(load_study(None, {"workload.source": str(path)}))  # before: UnicodeEncodeError


@pytest.mark.parametrize("seed", [-1, 99999999999, 2**32])
def test_a_seed_outside_numpys_range_is_refused_naming_the_field(seed):
    with pytest.raises(ConfigError) as caught:
        load_study(None, {"seed": seed})
    assert f"seed: seed={seed} is outside 0..4294967295" in str(caught.value)


def test_the_ends_of_numpys_seed_range_load():
    assert load_study(None, {"seed": 0}).seed == 0
    assert load_study(None, {"seed": 2**32 - 1}).seed == 2**32 - 1


def test_a_key_given_twice_in_a_study_file_is_an_error_naming_it_and_its_lines(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("budget:\n  max_trials: 4\nseed: 1\nbudget:\n  time_budget_s: 60\n")
    with pytest.raises(ConfigError) as caught:
        load_study(path)
    assert str(caught.value) == (f"study file {path}: duplicate key 'budget' on line 4 (first on line 1): the second "
                                 "would silently replace the first. Fix: merge the two into one key")
    nested = tmp_path / "n.yaml"
    nested.write_text("budget:\n  max_trials: 4\n  max_trials: 5\n")
    with pytest.raises(ConfigError, match="duplicate key 'max_trials' on line 3 \\(first on line 2\\)"):
        load_study(nested)


def test_a_branch_given_twice_in_a_space_is_an_error(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("algorithms: [none, ngram]\nbranches:\n  ngram:\n    num_draft_tokens: {type: int, low: 2, "
                    "high: 8}\n  ngram:\n    max_trie_depth: {type: int, low: 2, high: 8}\n")
    with pytest.raises(ConfigError, match=r"search space .*space.yaml: duplicate key 'ngram' on line 5"):
        load_space(path)


def test_a_merge_key_may_still_override(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("x: &b {max_trials: 4}\nbudget:\n  <<: *b\n  max_trials: 6\n")
    with pytest.raises(ConfigError, match="unknown key 'x'"):  # past the YAML: the override itself was accepted
        load_study(path)


@pytest.mark.parametrize("default, ok", [(", default: 9", False), (", default: 1", False), (", default: 8", True)])
def test_a_default_outside_the_range_is_refused(tmp_path, default, ok):
    path = tmp_path / "space.yaml"
    path.write_text(SPACE % default)
    if ok:
        assert load_space(path)
        return
    with pytest.raises(ConfigError, match=r"branches.ngram.num_draft_tokens.default: \d is outside the range "
                                          r"low=2, high=8"):
        load_space(path)


def test_a_categorical_default_must_be_a_choice(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("algorithms: [none, ngram]\nbranches:\n  ngram:\n    match_type: {type: categorical, "
                    "choices: [BFS, PROB], default: DFS}\n")
    with pytest.raises(ConfigError, match="match_type.default: 'DFS' is not one of the choices"):
        load_space(path)


def test_a_one_prompt_workload_names_the_study_key(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text('{"prompt": "only"}\n')
    with pytest.raises(WorkloadError) as caught:
        load_workload(path, seed=0, n_warmup=2, n_measure=4)
    assert "workload.warmup_prompts=2" in str(caught.value) and "workload.warmup_prompts: 0" in str(caught.value)
    assert "n_warmup=0" not in str(caught.value)
