"""Config labels: readable, stable (a function of the config alone), and distinct for distinct configs of every
bundled search space; repeats made unique for display; the slug form safe for Serve apps and folders."""

from __future__ import annotations

import re

import optuna
import pytest

from pipeline.config import SEARCH_SPACES_DIR, TrialConfig, load_study
from pipeline.records.labels import config_label, params_label, slug, unique_names
from pipeline.search.space import define_by_run, load_space, resolve


def label(data: dict) -> str:
    return config_label(TrialConfig.model_validate(data))


def test_examples_read_as_the_settings_they_name() -> None:
    assert label({}) == "none"
    assert label({"warmup_requests": 2}) == "none"  # the baseline's warm-up is the study's, not its setting
    assert label({"spec": {"algorithm": "ngram", "match_type": "PROB", "num_draft_tokens": 10, "max_bfs_breadth": 1,
                           "max_trie_depth": 14}, "warmup_requests": 8}) == "ngram PROB d10 b1 depth14 warm8"
    assert label({"spec": {"algorithm": "ngram", "min_bfs_breadth": 2, "max_bfs_breadth": 4, "capacity": 100_000,
                           "external_corpus": "/data/tickets.jsonl", "external_sam_budget": 2}}) == \
        "ngram BFS d12 b2-4 depth18 cap100k corpus:tickets sam2 warm0"
    assert label({"spec": {"algorithm": "eagle3", "num_steps": 3, "topk": 1, "num_draft_tokens": 4,
                           "draft_model": "/models/EAGLE3-8B"}}) == "eagle3 s3 k1 d4 @EAGLE3-8B warm0"
    assert label({"spec": {"algorithm": "standalone", "draft_model": "qwen2.5-coder-0.5b"}}) == \
        "standalone auto @qwen2.5-coder-0.5b warm0"
    assert label({"spec": {"algorithm": "llama_ngram_mod", "n_match": 24, "n_min": 48, "n_max": 64},
                  "warmup_requests": 4}) == "llama ngram-mod match24 min48 max64 warm4"
    assert label({"spec": {"algorithm": "llama_draft", "draft_model": "smollm2-135m@f32", "threads": 2}}) == \
        "llama draft n3 @smollm2-135m@f32 t2 warm0"
    assert label({"max_running_requests": 16}) == "none mrr16"


def test_the_concurrency_a_config_is_measured_at_is_not_part_of_its_label() -> None:
    spec = {"algorithm": "ngram", "num_draft_tokens": 4}
    assert label({"spec": spec, "concurrency": 1}) == label({"spec": spec, "concurrency": 8})


def test_a_field_without_a_short_name_is_still_shown_when_it_is_not_its_default() -> None:
    # external_corpus_max_tokens has no short form: the generic `name=value` keeps two such configs apart
    assert label({"spec": {"algorithm": "ngram"}}) == "ngram BFS d12 b10 depth18 warm0"
    assert label({"spec": {"algorithm": "ngram", "external_corpus_max_tokens": 5000}}) == \
        "ngram BFS d12 b10 depth18 external_corpus_max_tokens=5000 warm0"


def sampled(path, count: int = 300) -> list[TrialConfig]:
    """`count` random points of a bundled space, as the study resolves them (invalid ones included)."""
    space = load_space(path)
    engine = "llama_cpp" if path.name.startswith("llama-cpp") else "cpu"
    study = load_study(None, {"search_space": path.name, "engine.kind": engine})
    sampler = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=7))
    sample = define_by_run(space)
    out = []
    for _ in range(count):
        trial = sampler.ask()
        constants = sample(trial)  # first: it suggests the params
        config = resolve(space, {**trial.params, **constants}, study).config
        sampler.tell(trial, 0.0)
        if config is not None:
            out.append(config.model_copy(update={"concurrency": 1}))
    return out


def neighbours(configs: list[TrialConfig]) -> list[TrialConfig]:
    """Each config with one setting changed to a value another sampled config of its algorithm has: the pairs a
    label dropping (or conflating) that setting would name alike."""
    seen: dict[tuple[str, str], list] = {}
    for c in configs:
        for key, value in {**c.spec.model_dump(), **c.model_dump(exclude={"spec"})}.items():
            if value not in seen.setdefault((c.spec.algorithm, key), []):
                seen[(c.spec.algorithm, key)].append(value)
    out = []
    for c in configs[:60]:
        for (algorithm, key), values in seen.items():
            if algorithm != c.spec.algorithm or key == "algorithm":
                continue
            for value in values[:3]:
                data = c.model_dump()
                (data["spec"] if key in data["spec"] else data)[key] = value
                out.append(TrialConfig.model_validate(data))
    return out


@pytest.mark.parametrize("path", sorted(SEARCH_SPACES_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_distinct_configs_of_a_bundled_space_get_distinct_labels(path) -> None:
    """300 random points of the space and their one-setting neighbours: every label names exactly one config
    (concurrency aside), and labelling is stable (a config rebuilt from its JSON gets the same label)."""
    configs = sampled(path)
    named: dict[str, set[str]] = {}
    for config in configs + neighbours(configs):
        named.setdefault(config_label(config), set()).add(config.model_dump_json())
    assert len(named) > 1
    shared = {name: keys for name, keys in named.items() if len(keys) > 1}
    assert not shared, shared
    assert all(config_label(TrialConfig.model_validate_json(k)) == n for n, ks in named.items() for k in ks)


def test_a_point_that_never_became_a_config_is_named_by_its_values() -> None:
    assert params_label({"algorithm": "ngram", "ngram.num_draft_tokens": 0}) == "ngram num_draft_tokens=0 (invalid)"


def test_repeats_are_made_unique_by_their_trial_ids_in_order() -> None:
    assert unique_names(["none", "ngram a", "ngram a", "ngram a"], ["1", "2", "3", "3"]) == [
        "none", "ngram a", "ngram a #3", "ngram a #3'"]


def test_slug_keeps_only_characters_an_app_name_a_route_and_a_folder_take() -> None:
    assert slug("ngram PROB d10 b1 depth14 warm8") == "ngram-PROB-d10-b1-depth14-warm8"
    assert re.fullmatch(r"[A-Za-z0-9._-]+", slug("llama draft n3 @x/y:z t2 #a1"))
