"""An engine's `/server_info` parsed once (pipeline/measure/server_info.py): the typed fields the pipeline reads, every
key kept for the record (`server_info.json` stays the JSON the engine gave), lenient where an engine reports a key
in another shape, and the readers on the other side of the boundary (the watch's curve, provenance)."""

from __future__ import annotations

import json

import pytest

from pipeline.measure.server_info import ServerInfo
from pipeline.records.provenance import tuned_on
from pipeline.trial.pruning import verify_curve

CPU_ANSWER = {"engine": "cpu", "version": "0.3.1", "speculative_algorithm": "NGRAM", "max_running_requests": 8,
              "weights_mode": "gguf", "weights_isa": "avx512",
              "verify_cost": {"sizes": [1, 2, 4], "relative": [1.0, 1.1, 1.4], "round_cost": {"ms": [[1.0]]}},
              "internal_states": [{"avg_spec_accept_length": 2.5}]}


def test_the_record_keeps_every_key_in_the_engines_order():
    info = ServerInfo.parse(CPU_ANSWER)
    assert json.dumps(info.as_json(), indent=2) == json.dumps(CPU_ANSWER, indent=2)
    assert (info.version, info.max_running_requests, info.weights) == ("0.3.1", 8, "gguf-avx512")
    assert info.has_round_table and info.internal_states == [{"avg_spec_accept_length": 2.5}]
    info.as_json()["version"] = "changed"  # a reader's copy, never the record
    assert info.raw["version"] == "0.3.1"


def test_keys_the_trial_adds_keep_a_replaced_keys_place_and_go_last_when_new():
    info = ServerInfo.parse(CPU_ANSWER).with_keys(replica_node_id="node-1", verify_cost={"source": "http-probe"})
    assert list(info.raw) == [*CPU_ANSWER, "replica_node_id"]
    assert info.replica_node_id == "node-1" and info.verify_cost == {"source": "http-probe"}
    assert not info.has_round_table
    assert ServerInfo.parse(CPU_ANSWER).verify_cost == CPU_ANSWER["verify_cost"]  # the original is untouched


def test_a_key_in_another_shape_reads_as_unreported_and_stays_on_record():
    odd = {"version": 3, "max_running_requests": "48", "verify_cost": [1, 2], "internal_states": {"a": 1},
           "weights_mode": "", "replica_node_id": None}
    info = ServerInfo.parse(odd)
    assert info.version == "3"  # printed as the engine gave it
    assert (info.max_running_requests, info.verify_cost, info.internal_states) == (None, None, None)
    assert info.weights == "" and info.replica_node_id is None
    assert info.as_json() == odd
    assert ServerInfo.parse(["not", "an", "object"]) == ServerInfo()


def test_an_artifact_is_read_once_into_the_same_type():
    assert ServerInfo.from_text(json.dumps(CPU_ANSWER)) == ServerInfo.parse(CPU_ANSWER)
    assert ServerInfo.from_text(None) == ServerInfo.from_text("") == ServerInfo()
    with pytest.raises(ValueError):
        ServerInfo.from_text("{not json")


def test_the_watch_reads_its_verify_cost_curve_from_the_typed_answer():
    curve = verify_curve(ServerInfo.parse(CPU_ANSWER))
    assert curve is not None and curve.sizes == (1, 2, 4) and curve.cost(4) == pytest.approx(1.4)
    assert verify_curve(ServerInfo()) is None
    assert verify_curve(ServerInfo.parse({"verify_cost": {}})) is None
    with pytest.raises(KeyError):
        verify_curve(ServerInfo.parse({"verify_cost": {"sizes": [1]}}))


class _Runs:
    """A tracking store holding one trial run's artifacts."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def artifact_text(self, run_id: str, name: str) -> str | None:
        return self.texts.get(name) if run_id == "run-1" else None


def test_what_a_config_was_tuned_on_reads_the_trial_runs_server_info():
    engine, hardware = tuned_on(_Runs({"server_info.json": json.dumps(CPU_ANSWER)}), "run-1", "cpu")
    assert engine == "cpu 0.3.1" and hardware  # no Ray node recorded: this machine
    assert tuned_on(_Runs({}), "run-1", "cpu")[0] == "cpu (version unknown)"
    assert tuned_on(_Runs({"server_info.json": "{broken"}), "run-1", "sglang")[0] == "sglang (version unknown)"
