"""Issue 59: the trial, the production roll and `python -m pipeline.promote --deploy` wait for an engine from one
source (`serve.engines.waits`): its `start_timeout_s` plus the engine's cold-start allowance; and the Serve config and
RayService patch a study writes roll a GPU engine the way `python -m serve.production` does where a second copy does
not fit (stop, then start), never with a second copy of a whole-node engine."""

from __future__ import annotations

import yaml

from pipeline.promote import _parser, deploy_wait_s
from serve.engines import engine_for
from serve.engines.base import ReplicaConfig
from serve.engines.sglang.engine import COLD_START_ALLOWANCE_S
from serve.engines.waits import TRIAL_MARGIN_S, engine_start_s, trial_wait_s
from serve.production.roll import deploy_timeout_s, plan_roll
from serve.production.settings import ProductionSettings
from serve.serving import Provenance, ServingConfig, deploy_files, RAYSERVICE_PATCH_FILE, SERVE_CONFIG_FILE

PROVENANCE = Provenance(study="s", decision="promote", source="final-0", workload="w", workload_digest="0" * 16)
# The seed example's engine: 1800 s to load ~470 GB at tp 8, on a node whose first start compiles kernels.
SEED = {"engine": "sglang", "device": "cuda", "model": "/models/deepseek-v2", "tp_size": 8, "start_timeout_s": 1800}
SOURCE = {"registered_model": "specdec-seed", "version": "3", "tracking_uri": "sqlite:///mlflow.db"}


def serving(**replica) -> ServingConfig:
    return ServingConfig(replica=ReplicaConfig(**{"model": "m", **replica}), provenance=PROVENANCE)


def test_every_wait_covers_a_cold_start_of_the_seed_engine():
    replica = ReplicaConfig(**SEED)
    cold = 1800 + COLD_START_ALLOWANCE_S["cuda"]
    engine = engine_for(replica.engine)
    assert engine_start_s(replica, engine) == cold
    assert trial_wait_s(replica, engine) == cold + TRIAL_MARGIN_S  # the trial's wait for its replica
    roll = deploy_timeout_s(serving(**SEED))
    assert roll > cold  # the production roll's deadline: 1800 s alone would give up on a cold node
    default_poll = ProductionSettings.model_fields["follow_alias_s"].default
    assert deploy_wait_s(serving(**SEED)) == roll + default_poll  # promote --deploy outlasts the roll it waits for


def test_the_cpu_engine_has_no_allowance_and_its_waits_follow_its_timeout():
    replica = ReplicaConfig(model="smollm2-135m", start_timeout_s=90)
    assert engine_start_s(replica, engine_for(replica.engine)) == 90
    assert deploy_timeout_s(serving(model="smollm2-135m", start_timeout_s=90)) < \
        deploy_timeout_s(serving(model="smollm2-135m", start_timeout_s=900))


def test_promote_deploy_waits_for_the_promoted_config_unless_told():
    assert _parser().parse_args(["--deploy", "http://x"]).timeout is None  # computed from the serving config
    assert _parser().parse_args(["--deploy", "http://x", "--timeout", "5"]).timeout == 5.0


def surges(files: dict[str, str]) -> list[dict[str, dict]]:
    config = yaml.safe_load(files[SERVE_CONFIG_FILE])
    patch = yaml.safe_load(files[RAYSERVICE_PATCH_FILE])
    embedded = yaml.safe_load(patch["spec"]["serveConfigV2"])
    return [{d["name"]: d["max_surge_percent"] for d in c["applications"][0]["deployments"]}
            for c in (config, embedded)]


def test_exported_files_stop_then_start_a_gpu_engine_as_the_driver_does_on_a_full_node():
    seed = serving(**SEED)
    for surge in surges(deploy_files(seed, SOURCE, "v3")):
        assert surge["EngineBackend"] == 0  # no second tp-8 copy: Serve stops the old replica first
        assert surge["OpenAIIngress"] == 100
    # the driver's own plan for the same roll on the one 8-GPU node the old engine fills
    changed = serving(**{**SEED, "max_running_requests": 64})
    assert plan_roll(changed, seed, 1, [{"CPU": 112.0, "GPU": 0.0}]) == "stop_then_start"


def test_exported_files_surge_an_engine_without_gpus():
    for surge in surges(deploy_files(serving(model="smollm2-135m"), SOURCE, "v1")):
        assert surge["EngineBackend"] == 100
