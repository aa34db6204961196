"""How the production app rolls (serve/production/roll.py) and how `python -m serve.production` follows the alias
(serve/production/cli.py `Follower`): issue 40 item 5. A roll surges only where a second copy of the engines fits
(at tp 8 on an 8-GPU node it never would be placed), the deploy waits as long as the serving config allows, and a
failed roll is rolled back instead of ending the process that serves production."""

from __future__ import annotations

import pytest

from serve.engines.base import ReplicaConfig
from serve.production.cli import Follower
from serve.production.roll import STOP_THEN_START, SURGE, deploy_timeout_s, fits, plan_roll
from serve.production.settings import ProductionSettings
from serve.serving import Provenance, ServingConfig

PROVENANCE = Provenance(study="s", decision="promote", source="final-0", workload="w", workload_digest="0" * 16)


def serving(**replica) -> ServingConfig:
    return ServingConfig(replica=ReplicaConfig(**{"model": "m", **replica}), provenance=PROVENANCE)


GPU8 = {"engine": "sglang", "device": "cuda", "model": "/models/deepseek-v3", "tp_size": 8, "start_timeout_s": 1800}
NODE_8_GPUS = {"CPU": 128.0, "GPU": 8.0}


def test_two_copies_at_tp_8_on_one_8_gpu_node_do_not_fit_so_the_roll_stops_then_starts():
    old, new = serving(**GPU8), serving(**{**GPU8, "max_running_requests": 64})
    # the old engine holds all 8 GPUs: the node has none free
    assert plan_roll(new, old, 1, [{"CPU": 120.0, "GPU": 0.0}]) == STOP_THEN_START
    # two such nodes: the new copy fits on the second
    assert plan_roll(new, old, 1, [{"CPU": 120.0, "GPU": 0.0}, NODE_8_GPUS]) == SURGE


def test_a_first_deploy_or_an_unchanged_engine_replaces_nothing():
    config = serving(**GPU8)
    assert plan_roll(config, None, 1, []) == SURGE  # nothing runs: nothing to make room for
    assert plan_roll(config, config, 1, [{"GPU": 0.0}]) == SURGE  # the engine does not change: Serve keeps it


def test_a_custom_resource_the_cluster_has_once_forces_stop_then_start():
    slot = {"replica_resources": {"engine_slot": 1.0}}
    old, new = serving(**slot), serving(**slot, max_running_requests=8)
    assert plan_roll(new, old, 1, [{"CPU": 2.0, "engine_slot": 0.0}]) == STOP_THEN_START
    assert plan_roll(new, old, 1, [{"CPU": 2.0, "engine_slot": 1.0}]) == SURGE
    assert plan_roll(new, old, 2, [{"CPU": 4.0, "engine_slot": 1.0}]) == STOP_THEN_START  # two replicas, one slot


def test_fits_places_each_replica_on_one_node():
    assert fits([{"GPU": 4}, {"GPU": 4}], [{"GPU": 4}, {"GPU": 4}])
    assert not fits([{"GPU": 8}], [{"GPU": 4}, {"GPU": 4}])  # 8 free GPUs in all, but on no one node
    assert fits([{"GPU": 2}, {"GPU": 6}], [{"GPU": 2}, {"GPU": 6}])  # largest first: 6 is not split by the 2
    assert fits([], [])


def test_the_deploy_waits_as_long_as_the_serving_config_allows():
    # issue 40 item 5: a fixed 900 s wait was shorter than a big model's own start_timeout_s
    assert deploy_timeout_s(serving(**GPU8)) > 1800
    assert deploy_timeout_s(serving(start_timeout_s=60)) < 900


class Registry:
    """The alias, and a deploy that fails for the versions in `broken` (as Serve would: DEPLOY_FAILED or a
    timeout)."""

    def __init__(self, broken: set[str]) -> None:
        self.alias, self.broken = "1", broken
        self.deployed: list[str] = []
        self.said: list[str] = []

    def deploy(self, settings: ProductionSettings) -> dict:
        version = settings.version or self.alias
        self.deployed.append(version)
        if version in self.broken:
            raise TimeoutError(f"production app not RUNNING after 2045 s (version {version})")
        return {"origin": {"version": version}}


def test_a_failed_roll_is_rolled_back_and_not_retried_until_the_alias_moves():
    registry = Registry(broken={"2"})
    settings = ProductionSettings(registered_model="m")
    follower = Follower(settings, "1", deploy=registry.deploy, current=lambda s: registry.alias,
                        say=registry.said.append)
    follower.step()
    assert registry.deployed == []  # nothing moved
    registry.alias = "2"
    follower.step()  # never raises: the process serving production must outlive a failed roll
    assert registry.deployed == ["2", "1"] and follower.serving == "1"
    assert any("roll to version 2 failed" in line for line in registry.said)
    follower.step()
    follower.step()
    assert registry.deployed == ["2", "1"]  # the broken version is not rolled to (and production cut) every poll
    registry.alias = "3"
    follower.step()
    assert registry.deployed == ["2", "1", "3"] and follower.serving == "3"


def test_a_rollback_that_fails_too_is_tried_again_at_the_next_poll():
    registry = Registry(broken={"2", "1"})
    follower = Follower(ProductionSettings(registered_model="m"), "1", deploy=registry.deploy,
                        current=lambda s: registry.alias, say=registry.said.append)
    registry.alias = "2"
    follower.step()
    registry.broken = {"2"}  # whatever stopped the rollback has passed
    follower.step()
    assert registry.deployed == ["2", "1", "1"] and not follower.restore


@pytest.mark.parametrize("failure", [RuntimeError("production app failed to deploy: EngineBackend: ..."),
                                     TimeoutError("production app not RUNNING after 2045 s")])
def test_follow_survives_every_kind_of_failed_deploy(failure):
    calls = []

    def deploy(settings):
        calls.append(settings.version)
        if len(calls) == 1:
            raise failure
        return {"origin": {"version": settings.version}}

    follower = Follower(ProductionSettings(registered_model="m"), "4", deploy=deploy, current=lambda s: "5",
                        say=lambda text: None)
    follower.step()
    assert calls == [None, "4"] and follower.serving == "4" and follower.failed == "5"
