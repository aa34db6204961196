"""Every rule of serve.spec.validate_spec: one passing and one failing case each, and the message content."""

import pytest
from pydantic import ValidationError

from serve.spec import (
    Eagle3Spec, EagleSpec, NgramSpec, NoSpec, StandaloneSpec, draft_token_count, parse_spec, validate_spec,
)


def fields(violations):
    return [v.field for v in violations]


def test_baseline_and_defaults_are_valid():
    assert validate_spec(NoSpec()) == []
    assert validate_spec(NgramSpec()) == []
    assert validate_spec(StandaloneSpec(draft_model="d")) == []  # auto params: all unset


def test_ngram_min_breadth_le_max():
    assert validate_spec(NgramSpec(min_bfs_breadth=2, max_bfs_breadth=2)) == []
    (v,) = validate_spec(NgramSpec(min_bfs_breadth=4, max_bfs_breadth=2))
    assert v.field == "spec.min_bfs_breadth"
    assert str(v) == ("spec.min_bfs_breadth: ngram: min_bfs_breadth <= max_bfs_breadth must hold, "
                      "got min_bfs_breadth=4, max_bfs_breadth=2")


def test_ngram_capacity_gt_depth():
    assert validate_spec(NgramSpec(capacity=19, max_trie_depth=18)) == []
    (v,) = validate_spec(NgramSpec(capacity=18, max_trie_depth=18))  # == crashes SGLang (issue #36495)
    assert v.field == "spec.capacity" and "capacity=18, max_trie_depth=18" in str(v)


def test_ngram_needs_one_draft():
    assert validate_spec(NgramSpec(num_draft_tokens=2)) == []
    assert fields(validate_spec(NgramSpec(num_draft_tokens=1))) == ["spec.num_draft_tokens"]


def test_all_violations_are_returned_together():
    bad = NgramSpec(min_bfs_breadth=3, max_bfs_breadth=1, capacity=5, max_trie_depth=8, num_draft_tokens=1)
    assert sorted(fields(validate_spec(bad))) == ["spec.capacity", "spec.min_bfs_breadth", "spec.num_draft_tokens"]


@pytest.mark.parametrize("cls", [EagleSpec, Eagle3Spec, StandaloneSpec])
def test_draft_model_required(cls):
    assert validate_spec(cls(draft_model="x", num_steps=3, topk=1, num_draft_tokens=4)) == []
    violations = validate_spec(cls(num_steps=3, topk=1, num_draft_tokens=4))
    assert fields(violations) == ["spec.draft_model"]
    assert f"model.drafts.{cls().algorithm}" in str(violations[0])


@pytest.mark.parametrize("partial", [dict(num_steps=3), dict(num_steps=3, topk=2), dict(num_draft_tokens=4)])
def test_eagle_steps_topk_draft_all_or_none(partial):
    (v,) = validate_spec(Eagle3Spec(draft_model="x", **partial))
    assert "all set or all unset" in v.rule
    assert "num_steps=" in v.value and "topk=" in v.value and "num_draft_tokens=" in v.value


def test_topk_one_forces_chain_length():
    assert validate_spec(EagleSpec(draft_model="x", num_steps=3, topk=1, num_draft_tokens=4)) == []
    (v,) = validate_spec(EagleSpec(draft_model="x", num_steps=3, topk=1, num_draft_tokens=8))
    assert v.field == "spec.num_draft_tokens" and "num_steps + 1" in v.rule


def test_tree_capacity_bound():
    # steps=2, topk=2 holds 2 + 1*4 = 6 candidates: 7 draft tokens fit (6 drafts), 8 do not.
    assert validate_spec(Eagle3Spec(draft_model="x", num_steps=2, topk=2, num_draft_tokens=7)) == []
    (v,) = validate_spec(Eagle3Spec(draft_model="x", num_steps=2, topk=2, num_draft_tokens=8))
    assert "(7 > 6)" in v.value


def test_tagged_union_rejects_other_branch_fields():
    with pytest.raises(ValidationError) as err:
        parse_spec({"algorithm": "ngram", "topk": 2})  # NGRAM must never carry EAGLE's topk
    assert "topk" in str(err.value)
    with pytest.raises(ValidationError):
        parse_spec({"algorithm": "medusa"})
    assert isinstance(parse_spec({"algorithm": "standalone", "draft_model": "d"}), StandaloneSpec)


def test_configs_are_frozen():
    spec = NgramSpec()
    with pytest.raises(ValidationError):
        spec.num_draft_tokens = 4  # type: ignore[misc]


@pytest.mark.parametrize("spec", [
    NoSpec(), NgramSpec(num_draft_tokens=4, match_type="PROB"),
    EagleSpec(draft_model="a", num_steps=2, topk=2, num_draft_tokens=5), Eagle3Spec(draft_model="b"),
    StandaloneSpec(draft_model="c", num_steps=3, topk=1, num_draft_tokens=4),
])
def test_json_round_trip(spec):
    assert parse_spec(spec.model_dump(mode="json")) == spec
    assert type(parse_spec(spec.model_dump(mode="json"))) is type(spec)


def test_draft_token_count():
    assert draft_token_count(NoSpec()) == 0
    assert draft_token_count(NgramSpec(num_draft_tokens=4)) == 3
    assert draft_token_count(StandaloneSpec(draft_model="d")) == 0  # auto: unknown until the engine resolves it


def test_every_algorithm_name_list_is_the_unions_own():
    # `Algorithm` is spelled out for type checkers; everything else is read off the union's variants (serve/spec.py).
    from typing import get_args

    from serve.engines import algorithms_of
    from serve.spec import (DRAFT_MODEL_ALGORITHMS, EAGLE_HEAD_ALGORITHMS, LLAMA_CPP_ALGORITHMS, SGLANG_ALGORITHMS,
                            SPEC_TYPES, Algorithm, SpecConfig)

    union_tags = {t.model_fields["algorithm"].default for t in get_args(get_args(SpecConfig)[0])
                  for t in (get_args(t) or (t,))}
    assert set(get_args(Algorithm)) == set(SPEC_TYPES) == union_tags
    assert set(SGLANG_ALGORITHMS).isdisjoint(LLAMA_CPP_ALGORITHMS)  # llama.cpp's own names never shadow SGLang's
    assert set(EAGLE_HEAD_ALGORITHMS) < set(DRAFT_MODEL_ALGORITHMS) < set(SGLANG_ALGORITHMS)
    assert algorithms_of("sglang") == set(SGLANG_ALGORITHMS)
    assert algorithms_of("llama_cpp") == {"none", *LLAMA_CPP_ALGORITHMS}
    assert algorithms_of("cpu") <= set(SGLANG_ALGORITHMS)
