"""How long anything waits for an engine to start, from one source: the engine's `start_timeout_s` plus its
cold-start allowance (`Engine.start_timeout_s(config, cold=True)`: SGLang's first start on a node compiles its kernels
and reads the checkpoint from disk, `serve.engines.sglang.engine.COLD_START_ALLOWANCE_S`). The trial's wait for its
replica, the production roll's deadline (`serve.production.roll.deploy_timeout_s`) and `python -m pipeline.promote
--deploy` all start from `engine_start_s`; a caller that cannot know whether the node is warm assumes it is not.
The trial hands in the engine it already holds (`TrialContext.engine`); the roll, which holds configs only, has each
one's engine resolved from its kind where it asks, in `slowest_start_s`.
"""

from __future__ import annotations

from collections.abc import Iterable

from serve.engines import engine_for
from serve.engines.base import Engine, ReplicaConfig

__all__ = ["TRIAL_MARGIN_S", "engine_start_s", "slowest_start_s", "trial_wait_s"]

# Around the engine's own start, a trial's replica also places itself, runs the node checks and the preflight.
TRIAL_MARGIN_S = 60.0


def engine_start_s(config: ReplicaConfig, engine: Engine) -> float:
    """The longest one start of `config`'s engine (`engine`) may take on a node that never started it: its
    `start_timeout_s` plus the engine's cold-start allowance."""
    return engine.start_timeout_s(config, cold=True)


def slowest_start_s(configs: Iterable[ReplicaConfig]) -> float:
    """`engine_start_s` of the slowest of `configs` (engines that start side by side)."""
    return max(engine_start_s(config, engine_for(config.engine)) for config in configs)


def trial_wait_s(config: ReplicaConfig, engine: Engine) -> float:
    """How long a trial waits for its replica's engine (`engine`, the trial's own): `engine_start_s` and
    `TRIAL_MARGIN_S`."""
    return engine_start_s(config, engine) + TRIAL_MARGIN_S
