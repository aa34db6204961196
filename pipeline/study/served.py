"""What production serves after a decision, and whether it has room for it: the GPUs one engine holds, the largest
node's, the room a two-engine split needs (`pipeline.decide.levels.ServingRoom`), the config the policy serves at its
lowest level and, for an adaptive EAGLE winner, the candidate steps said but not served.
"""

from __future__ import annotations

import math
import sys

from pipeline.config import TrialConfig
from pipeline.decide.adaptive import tuned_adaptive_steps
from pipeline.decide.levels import BASELINE, LevelsDecision, ServingRoom
from serve.engines.base import ReplicaConfig
from serve.replica.placement import actor_options

__all__ = ["adaptive_suggestion", "engine_gpus", "largest_node_gpus", "served_config", "serving_room"]


def engine_gpus(replica: ReplicaConfig) -> float:
    """GPUs one engine of `replica` holds (what its Ray actor asks for; 0 on a CPU)."""
    return float(actor_options(replica).get("num_gpus") or 0)


def largest_node_gpus() -> int | None:
    """The GPU count of the largest live node of the Ray cluster this process is connected to (None: outside Ray,
    or no node has a GPU)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    counts = [int(node.get("Resources", {}).get("GPU", 0)) for node in ray.nodes() if node.get("Alive")]
    return max(counts) if counts and max(counts) > 0 else None


def serving_room(serving_gpus: int | None, gpus_per_engine: float, node_gpus: int | None) -> ServingRoom:
    """What production can hold: `engine.serving_gpus` where the study sets it, else the largest node's GPUs, else
    one engine (so a split, two engines, does not fit). Pure."""
    if serving_gpus is not None:
        return ServingRoom(engine_gpus=gpus_per_engine, gpus=serving_gpus, source="engine.serving_gpus")
    if node_gpus is not None:
        return ServingRoom(engine_gpus=gpus_per_engine, gpus=node_gpus,
                           source="engine.serving_gpus unset: the GPUs of the largest node of the study's cluster")
    return ServingRoom(engine_gpus=gpus_per_engine, gpus=math.ceil(gpus_per_engine),
                       source="engine.serving_gpus unset and no node's GPU count known: room for one engine assumed")


def served_config(decision: LevelsDecision, configs: dict[str, TrialConfig]) -> tuple[str, TrialConfig, str | None]:
    """(id, config, note) of what the policy serves at its lowest level: the config exactly as its finalist runs
    measured it (an adaptive EAGLE winner on SGLang's default candidate steps, which its runs measured), and, for an
    adaptive winner, the candidate steps the level table suggests, as a note (`adaptive_suggestion`). Pure."""
    chosen = decision.policy.config or BASELINE
    return chosen, configs[chosen], adaptive_suggestion(decision, chosen, configs)


def adaptive_suggestion(decision: LevelsDecision, served: str, configs: dict[str, TrialConfig]) -> str | None:
    """An adaptive EAGLE winner is served exactly as its finalist runs measured it, on SGLang's default candidate
    steps; the steps the level table suggests (`pipeline.decide.adaptive.tuned_adaptive_steps`) were measured by no
    run, so they are said, not served. None for any other winner. Pure."""
    tuned = tuned_adaptive_steps(decision, served, {n: c.spec for n, c in configs.items()})
    if tuned is None:
        return None
    steps = ", ".join(f"{level}: {list(candidates)}" for level, candidates in sorted(tuned.items()))
    return (f"{served!r} is served as measured, on SGLang's default adaptive candidate steps; the level table "
            f"suggests candidate steps per batch size {{{steps}}}, not served: no run measured them")
