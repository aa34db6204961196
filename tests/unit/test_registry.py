"""The promotion's registry action against a real MLflow (SQLite store, artifacts in a tmp dir): register, the
`production` alias moving with `previous` kept, rollback, and reading a config back the way production does."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.records.tracking import Tracker
from pipeline.records.registry import PREVIOUS, PRODUCTION, load_serving_config, register_config, rollback, set_production
from serve.engines.base import ReplicaConfig
from serve.serving import Provenance, ServingConfig

NAME = "specdec-unit"


def serving(label: str, algorithm: str = "ngram") -> ServingConfig:
    return ServingConfig(replica=ReplicaConfig(model="smollm2-135m", spec={"algorithm": algorithm}, tp_size=2,
                                               extra_flags=["--mem-fraction-static", "0.85"], env_from=["HF_TOKEN"]),
                         provenance=Provenance(study="unit", decision=label, source=label, workload="templated",
                                               workload_digest="0123456789abcdef", medians={"tput_tok_s": 12.5}))


@pytest.fixture()
def tracker(tmp_path: Path) -> Tracker:
    return Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "unit", artifact_dir=tmp_path / "artifacts")


@pytest.fixture()
def run_id(tracker: Tracker) -> str:
    return tracker.start_study("unit", "name: unit\n", resume=False)


def aliases(tracker: Tracker) -> dict[str, str]:
    return {k: str(v) for k, v in tracker.client().get_registered_model(NAME).aliases.items()}


def read(tracker: Tracker, ref: str) -> ServingConfig:
    return load_serving_config(tracker.tracking_uri, f"models:/{NAME}{ref}")


def test_first_version_goes_to_production_even_without_a_promotion(tracker, run_id):
    assert register_config(tracker, run_id, NAME, serving("keep_baseline", "none"), move_production=False) == "1"
    assert aliases(tracker) == {PRODUCTION: "1"}
    assert read(tracker, f"@{PRODUCTION}") == serving("keep_baseline", "none")


def test_keep_baseline_leaves_production_alone(tracker, run_id):
    register_config(tracker, run_id, NAME, serving("first"), move_production=True)
    assert register_config(tracker, run_id, NAME, serving("keep_baseline", "none"), move_production=False) is None
    assert aliases(tracker) == {PRODUCTION: "1"}
    assert len(tracker.client().search_model_versions(f"name='{NAME}'")) == 1


def test_promotions_move_production_and_keep_the_one_before_as_previous(tracker, run_id):
    for label in ("a", "b", "c"):
        register_config(tracker, run_id, NAME, serving(label), move_production=True)
    assert aliases(tracker) == {PRODUCTION: "3", PREVIOUS: "2"}
    assert [read(tracker, ref).provenance.source for ref in ("/1", "/2", "/3", f"@{PRODUCTION}", f"@{PREVIOUS}")] == \
        ["a", "b", "c", "c", "b"]
    version = tracker.client().get_model_version(NAME, "3")
    assert version.run_id == run_id and version.tags["model_id"].startswith("m-")
    assert {k: version.tags[k] for k in ("decision", "algorithm")} == {"decision": "c", "algorithm": "ngram"}


def test_the_registered_model_shows_the_spec_and_the_workload_it_was_measured_on(tracker, run_id):
    version = register_config(tracker, run_id, NAME, serving("a"), move_production=True)
    client = tracker.client()
    model = client.get_logged_model(client.get_model_version(NAME, version).tags["model_id"])
    assert model.params["spec.algorithm"] == "ngram" and model.params["tp_size"] == "2"
    assert "--mem-fraction-static" in model.params["extra_flags"] and model.params["env_from"] == "[HF_TOKEN]"
    assert model.tags["workload_digest"] == "0123456789abcdef"
    assert [(m.key, m.dataset_digest) for m in model.metrics] == [("serving_tput_tok_s", "0123456789abcdef")]
    inputs = client.get_run(run_id).inputs.dataset_inputs
    assert [(i.dataset.name, i.dataset.digest) for i in inputs] == [("templated", "0123456789abcdef")]


def test_the_version_is_tagged_with_the_whole_spec_defaults_included(tracker, run_id):
    from serve.spec import NgramSpec

    version = register_config(tracker, run_id, NAME, serving("a"), move_production=True)
    tags = tracker.client().get_model_version(NAME, version).tags
    defaults = NgramSpec()  # serving("a") asks for NGRAM with every setting at its default
    assert tags["spec.num_draft_tokens"] == str(defaults.num_draft_tokens)
    assert tags["spec.max_bfs_breadth"] == str(defaults.max_bfs_breadth)
    assert tags["spec.max_trie_depth"] == str(defaults.max_trie_depth) and tags["spec.match_type"] == "BFS"
    assert tags["measured.tput_tok_s"] == "12.5" and tags["model"] == "smollm2-135m"


def test_pointing_production_at_its_own_version_keeps_previous(tracker, run_id):
    register_config(tracker, run_id, NAME, serving("a"), move_production=True)
    register_config(tracker, run_id, NAME, serving("b"), move_production=True)
    set_production(tracker, NAME, "2")
    assert aliases(tracker) == {PRODUCTION: "2", PREVIOUS: "1"}


def test_rollback_swaps_production_and_previous(tracker, run_id):
    register_config(tracker, run_id, NAME, serving("a"), move_production=True)
    register_config(tracker, run_id, NAME, serving("b"), move_production=True)
    assert rollback(tracker, NAME) == ("1", "2")
    assert aliases(tracker) == {PRODUCTION: "1", PREVIOUS: "2"}
    assert read(tracker, f"@{PRODUCTION}").provenance.source == "a"
    assert rollback(tracker, NAME) == ("2", "1")  # rolling back a rollback restores the promotion
    assert read(tracker, f"@{PRODUCTION}").provenance.source == "b"


def test_rollback_without_previous_fails_naming_the_alias_and_changes_nothing(tracker, run_id):
    register_config(tracker, run_id, NAME, serving("a"), move_production=True)
    with pytest.raises(PipelineError, match=f"no alias '{PREVIOUS}'.*production=1, previous=None"):
        rollback(tracker, NAME)
    assert aliases(tracker) == {PRODUCTION: "1"}


def test_a_new_version_never_overwrites_the_config_of_an_existing_one(tracker, run_id):
    # Versions can be deleted in the MLflow UI; the next config must still get a folder of its own.
    for label in ("a", "b"):
        register_config(tracker, run_id, NAME, serving(label), move_production=True)
    tracker.client().delete_model_version(NAME, "1")
    version = register_config(tracker, run_id, NAME, serving("c"), move_production=True)
    assert read(tracker, "/2").provenance.source == "b"
    assert read(tracker, f"/{version}").provenance.source == "c"


def test_a_config_file_is_validated_when_loaded(tmp_path):
    good = tmp_path / "serving_config.json"
    good.write_text(serving("a").model_dump_json())
    assert load_serving_config(None, str(good)) == serving("a")
    bad = tmp_path / "promoted.yaml"
    bad.write_text("engine: cpu\ntrial:\n  spec:\n    algorithm: ngram\n")
    with pytest.raises(ValueError, match="is not a serving config.*replica"):
        load_serving_config(None, str(bad))


def test_a_candidate_is_registered_beside_production_which_stays(tracker, run_id):
    from pipeline.records.registry import CANDIDATE, remove_alias

    register_config(tracker, run_id, NAME, serving("a"), move_production=True)
    # a re-tune registers its result, promote or keep-baseline, and never moves production
    assert register_config(tracker, run_id, NAME, serving("keep_baseline", "none"), move_production=False,
                           alias=CANDIDATE) == "2"
    assert aliases(tracker) == {PRODUCTION: "1", CANDIDATE: "2"}
    remove_alias(tracker, NAME, CANDIDATE)
    remove_alias(tracker, NAME, CANDIDATE)  # gone already: nothing to do
    assert aliases(tracker) == {PRODUCTION: "1"}
    with pytest.raises(PipelineError, match="refusing to remove alias 'production'"):
        remove_alias(tracker, NAME, PRODUCTION)


def test_the_version_page_shows_the_spec_and_the_figures_and_links_its_logged_model(tracker, run_id):
    import json

    version = register_config(tracker, run_id, NAME, serving("a"), move_production=True)
    client = tracker.client()
    mv = client.get_model_version(NAME, version)
    assert "| `spec.algorithm` | ngram |" in mv.description and "| `tput_tok_s` | 12.5 |" in mv.description
    assert mv.tags["spec.algorithm"] == "ngram" and mv.tags["model"] == "smollm2-135m"
    assert mv.tags["spec.num_draft_tokens"] == "12"  # at its default, and still what the engine runs
    assert mv.tags["measured.tput_tok_s"] == "12.5"
    model = client.get_logged_model(mv.tags["model_id"])
    assert json.loads(model.tags["mlflow.modelVersions"]) == [{"name": NAME, "version": version}]
    assert model.model_id in mv.description


def test_every_move_of_production_is_stamped_and_the_retune_reads_it(tracker, run_id):
    import time

    from pipeline.records.registry import PROMOTED_AT_TAG, production_since_ms

    assert production_since_ms(tracker, NAME) is None
    before = int(time.time() * 1000)
    register_config(tracker, run_id, NAME, serving("a"), move_production=True)
    register_config(tracker, run_id, NAME, serving("b"), move_production=True)
    after = int(time.time() * 1000)
    since = production_since_ms(tracker, NAME)
    assert since is not None and before <= since <= after
    rollback(tracker, NAME)
    stamp = tracker.client().get_model_version(NAME, "1").tags[PROMOTED_AT_TAG]
    assert int(stamp) >= since and production_since_ms(tracker, NAME) == int(stamp)
