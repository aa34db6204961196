"""The promotion's registry action against a real MLflow (SQLite store, artifacts in a tmp dir): register, the
`production` alias moving with `previous` kept, rollback, and reading a config back the way production does."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.record import Tracker
from pipeline.registry import PREVIOUS, PRODUCTION, load_serving_config, register_config, rollback, set_production

NAME = "specdec-unit"


def serving(label: str, algorithm: str = "ngram") -> dict:
    return {"study": "unit", "engine": "cpu", "model": "smollm2-135m", "dtype": "float32", "decision": label,
            "trial": {"spec": {"algorithm": algorithm}, "warmup_requests": 0, "concurrency": 1}, "source": label}


@pytest.fixture()
def tracker(tmp_path: Path) -> Tracker:
    return Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "unit", artifact_dir=tmp_path / "artifacts")


@pytest.fixture()
def run_id(tracker: Tracker) -> str:
    return tracker.start_study("unit", "name: unit\n", resume=False)


def aliases(tracker: Tracker) -> dict[str, str]:
    return {k: str(v) for k, v in tracker.client().get_registered_model(NAME).aliases.items()}


def read(tracker: Tracker, ref: str) -> dict:
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
    assert [read(tracker, ref)["source"] for ref in ("/1", "/2", "/3", f"@{PRODUCTION}", f"@{PREVIOUS}")] == \
        ["a", "b", "c", "c", "b"]
    version = tracker.client().get_model_version(NAME, "3")
    assert version.run_id == run_id and version.tags == {"decision": "c", "algorithm": "ngram"}


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
    assert read(tracker, f"@{PRODUCTION}")["source"] == "a"
    assert rollback(tracker, NAME) == ("2", "1")  # rolling back a rollback restores the promotion
    assert read(tracker, f"@{PRODUCTION}")["source"] == "b"


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
    assert read(tracker, "/2")["source"] == "b"
    assert read(tracker, f"/{version}")["source"] == "c"


def test_a_config_file_is_read_back_as_is(tmp_path):
    path = tmp_path / "promoted.yaml"
    path.write_text("engine: cpu\ntrial:\n  spec:\n    algorithm: ngram\n    num_draft_tokens: 4\n")
    assert load_serving_config(None, str(path)) == {"engine": "cpu",
                                                    "trial": {"spec": {"algorithm": "ngram", "num_draft_tokens": 4}}}
