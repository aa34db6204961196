"""The per-level decision as production serves it: one engine or two, the switch by in-flight requests, and what
the deploy files and the Serve config carry."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipeline.study.finalists import run_label
from pipeline.decide.levels import BASELINE, Candidate, LevelInput, RunFigures, decide_levels, routing_policy
from serve.engines.base import ReplicaConfig
from serve.serving import (HIGH, HIGH_COMMAND_FILE, LOW, Provenance, RoutingPolicy, ServingConfig, deploy_files,
                           serve_app, serving_config)

NGRAM = {"algorithm": "ngram", "num_draft_tokens": 4, "max_bfs_breadth": 2, "min_bfs_breadth": 1,
         "match_type": "BFS", "max_trie_depth": 8, "capacity": 100000}
REPLICAS = {BASELINE: ReplicaConfig(model="smollm2-135m"),
            "fast": ReplicaConfig(model="smollm2-135m", spec=NGRAM),
            "wide": ReplicaConfig(model="smollm2-135m", spec={**NGRAM, "num_draft_tokens": 2})}


def level(n: int, base: float, **cands: float) -> LevelInput:
    def runs(t: float) -> tuple[RunFigures, ...]:
        return tuple(RunFigures(tput_tok_s=t * f, ttft_p50_ms=50.0) for f in (0.99, 1.0, 1.01))

    return LevelInput(level=n, baseline=runs(base), candidates=tuple(
        Candidate(id=k, runs=runs(v), equivalent=True, draft_tokens=4) for k, v in cands.items()))


def provenance() -> Provenance:
    return Provenance(study="s", decision="promote", source="fast", workload="templated", workload_digest="0" * 16)


def test_wins_at_1_loses_at_4_switches_to_the_baseline_above_1() -> None:
    policy = routing_policy(decide_levels([level(1, 10, fast=15), level(4, 40, fast=30)]), REPLICAS)
    assert (policy.source, policy.switch_above, policy.high_source) == ("fast", 1, BASELINE)
    assert policy.high == REPLICAS[BASELINE] and policy.winners == {"1": "fast", "4": BASELINE}
    assert "speculation off above 1" in policy.text
    # A request that makes 1 in flight is served by the winner at 1; one that makes 2 goes to the baseline.
    assert [policy.route(n) for n in (1, 2, 5)] == [LOW, HIGH, HIGH]


def test_a_second_config_above_the_switch_is_the_high_engine() -> None:
    policy = routing_policy(decide_levels([level(1, 10, fast=15, wide=11), level(4, 40, fast=30, wide=50)]),
                            REPLICAS)
    assert (policy.switch_above, policy.high_source, policy.high) == (1, "wide", REPLICAS["wide"])


def test_one_level_or_one_winner_everywhere_is_one_engine() -> None:
    for decision in (decide_levels([level(1, 10, fast=15)]),
                     decide_levels([level(1, 10, fast=15), level(4, 40, fast=60)]),
                     decide_levels([level(1, 10, fast=9)])):
        policy = routing_policy(decision, REPLICAS)
        assert policy.switch_above is None and policy.high is None
        assert {policy.route(n) for n in (1, 2, 100)} == {LOW}
    assert routing_policy(decide_levels([level(1, 10, fast=9)]), REPLICAS).source == BASELINE


def test_a_policy_naming_a_config_without_its_replica_is_refused() -> None:
    decision = decide_levels([level(1, 10, fast=15, wide=11), level(4, 40, fast=30, wide=50)])
    with pytest.raises(ValueError, match="'wide' above concurrency 1 but no replica"):
        routing_policy(decision, {k: v for k, v in REPLICAS.items() if k != "wide"})


def test_half_a_two_engine_policy_is_refused_naming_the_fields() -> None:
    with pytest.raises(ValidationError, match="give all three"):
        RoutingPolicy(text="t", source="fast", switch_above=2)
    with pytest.raises(ValidationError, match="switch_above"):
        RoutingPolicy(text="t", source="fast", switch_above=0, high=REPLICAS[BASELINE], high_source=BASELINE)


def test_the_high_engine_is_served_without_secret_values_and_deployed_beside_the_first() -> None:
    high = REPLICAS[BASELINE].model_copy(update={"env": {"HF_TOKEN": "hf-secret-value"}, "log_dir": "/tmp/trial"})
    policy = RoutingPolicy(text="serve 'fast' up to concurrency 1; speculation off above 1", source="fast",
                           switch_above=1, high=high, high_source=BASELINE)
    serving = serving_config(REPLICAS["fast"], provenance(), policy)
    assert serving.policy is not None and serving.policy.high is not None
    assert serving.policy.high.env == {} and serving.policy.high.env_from == ["HF_TOKEN"]
    assert serving.policy.high.log_dir is None
    assert set(serving.replicas()) == {LOW, HIGH}
    names = [d["name"] for d in serve_app(serving, {"config_file": "x.json"})["deployments"]]
    assert names == ["EngineBackend", "EngineBackendHigh", "OpenAIIngress"]
    files = deploy_files(serving, {"config_file": "x.json"}, "promote")
    assert "speculation off above 1" in files[HIGH_COMMAND_FILE] and "hf-secret-value" not in "".join(files.values())
    with pytest.raises(ValidationError, match="policy.high.env: holds values for"):
        ServingConfig(replica=REPLICAS["fast"], provenance=provenance(), policy=policy)


def test_a_config_without_a_policy_loads_and_serves_one_engine() -> None:
    # Versions registered before per-level decisions have no `policy` key.
    old = ServingConfig.model_validate({"replica": REPLICAS["fast"].model_dump(mode="json"),
                                        "provenance": provenance().model_dump(mode="json")})
    assert old.policy is None and set(old.replicas()) == {LOW}
    assert "policy" not in old.model_dump(mode="json")  # dumps (registry, /v1/config) exactly as before policies
    assert [d["name"] for d in serve_app(old, {})["deployments"]] == ["EngineBackend", "OpenAIIngress"]
    assert HIGH_COMMAND_FILE not in deploy_files(old, {}, "v1")


def test_rerun_labels_name_the_level_only_when_there_are_several() -> None:
    assert run_label("final-baseline", 1, 0, several_levels=False) == "final-baseline-run0"
    assert run_label("final-0-trial-x", 4, 2, several_levels=True) == "final-0-trial-x-c4-run2"
