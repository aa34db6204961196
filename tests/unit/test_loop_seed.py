"""The re-tune's study starts from production (pipeline/loop/seed.py): the served spec becomes the space's Optuna
point, the baseline is asked first and production's point second (real Optuna on SQLite), a resumed re-tune
enqueues nothing twice, and what the space cannot express is said."""

from __future__ import annotations

import pytest

from pipeline.config import load_study
from pipeline.errors import PipelineError
from pipeline.loop.seed import SEEDED_ATTR, production_point, seed_study, with_capture_corpus
from pipeline.search.space import BASELINE_ATTR, CategoricalParam, define_by_run, load_space, resolve
from serve.engines.base import ReplicaConfig
from serve.serving import Provenance, ServingConfig

SPEC = {"algorithm": "ngram", "num_draft_tokens": 6, "max_bfs_breadth": 2, "min_bfs_breadth": 1,
        "match_type": "PROB", "max_trie_depth": 10, "capacity": 1_000_000}


def served(spec: dict) -> ServingConfig:
    return ServingConfig(replica=ReplicaConfig(model="smollm2-135m", spec=spec),
                         provenance=Provenance(study="s", decision="promote", source="final-0", workload="templated",
                                               workload_digest="0" * 16))


@pytest.fixture()
def study(tmp_path):
    return load_study(None, {"name": "retune-unit", "output_dir": str(tmp_path)})


def test_the_served_spec_becomes_a_point_that_resolves_back_to_it(study):
    space = load_space(study.search_space_path())
    point, mismatches = production_point(space, served(SPEC), study)
    assert point["algorithm"] == "ngram" and point["ngram.num_draft_tokens"] == 6
    assert mismatches == []
    resolved = resolve(space, point, study)
    assert resolved.config is not None and resolved.config.spec.model_dump() == served(SPEC).replica.spec.model_dump()


def test_what_the_space_cannot_express_is_said(study):
    space = load_space(study.search_space_path())
    _, mismatches = production_point(space, served({**SPEC, "capacity": 5000}), study)
    assert mismatches == ["spec.capacity: production runs 5000, the seeded trial 1000000"]
    with pytest.raises(PipelineError, match="production serves standalone, which the search space"):
        production_point(space, served({"algorithm": "standalone", "draft_model": "qwen2.5-coder-0.5b",
                                        "num_steps": 3, "topk": 1, "num_draft_tokens": 4}), study)
    assert production_point(space, served({"algorithm": "none"}), study) == ({}, [])


def test_the_baseline_runs_first_then_production_and_a_resume_adds_nothing(study, tmp_path):
    import optuna

    space = load_space(study.search_space_path())
    point, _ = production_point(space, served(SPEC), study)
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    assert seed_study(study, space, storage, point, "production version 3") is True
    assert seed_study(study, space, storage, point, "production version 3") is False
    ot = optuna.load_study(study_name=study.name, storage=storage)
    sampler = define_by_run(space)
    first, second = ot.ask(), ot.ask()
    assert first.user_attrs.get(BASELINE_ATTR) and sampler(first) == {"algorithm": "none"}
    assert second.user_attrs[SEEDED_ATTR] == "production version 3"
    sampler(second)
    assert {k: second.params[k] for k in point} == point
    assert len(ot.get_trials()) == 2


def test_a_capture_corpus_choice_points_at_the_captures_corpus(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text("algorithms: [none, ngram]\nbranches:\n  ngram:\n    num_draft_tokens: {type: fixed, value: 4}\n"
                    "    external_corpus: {type: categorical, choices: [null, capture]}\n"
                    "    external_sam_budget: {type: fixed, value: 2, when: {external_corpus: [capture]}}\n")
    space = load_space(path)
    with_corpus = with_capture_corpus(space, "/runs/c/corpus.jsonl").branches["ngram"]
    corpus_param = with_corpus["external_corpus"]
    assert isinstance(corpus_param, CategoricalParam) and corpus_param.choices == [None, "/runs/c/corpus.jsonl"]
    assert with_corpus["external_sam_budget"].when == {"external_corpus": ["/runs/c/corpus.jsonl"]}
    without = with_capture_corpus(space, None).branches["ngram"]["external_corpus"]
    assert isinstance(without, CategoricalParam) and without.choices == [None]
