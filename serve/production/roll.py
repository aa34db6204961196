"""How the production app rolls to a new config, and how long it may take.

Surge (the default): the new engine replicas start beside the old ones, which stop once the new ones are ready, so
the roll drops no request; it needs room for a second copy of every engine that changes. Where that room is not
there (tp 8 on one 8-GPU node: the second copy needs 8 more GPUs and would never be placed), the roll is
stop-then-start: the old engine stops first (its in-flight requests finish), then the new one starts. The gap is
announced, not hidden: from the moment the driver decides on it until the new engines run, generation requests and
`/health` answer 503 with Retry-After (the running ingress is told before the roll; the new one starts in the gap
and leaves it when the controller reports its engines healthy). `plan_roll` decides from what each changing engine
needs and what each node has free now (`fits`, pure).

The deploy waits as long as the serving config allows (`deploy_timeout_s`): the slowest engine's `start_timeout_s`
with its cold-start allowance (the trial's and `pipeline.promote --deploy`'s wait too: `serve.engines.waits`), the
old engines' drain, and a margin; a roll that fails or times out is rolled back by `python -m serve.production`
(`serve.production.cli.Follower`), never left half done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from serve.engines.base import ReplicaConfig
from serve.replica.status import wait_for_app
from serve.serving import ServingConfig

__all__ = ["Roll", "SURGE", "STOP_THEN_START", "DEPLOY_MARGIN_S", "deploy_timeout_s", "needs_of", "fits",
           "plan_roll", "changed_replicas", "free_per_node", "await_engines"]

Roll = Literal["surge", "stop_then_start"]
SURGE: Roll = "surge"
STOP_THEN_START: Roll = "stop_then_start"
DEPLOY_MARGIN_S = 120.0  # Serve's own steps around the engine's start: placing, the replica's constructor, checks


def deploy_timeout_s(config: ServingConfig) -> float:
    """How long a deploy of `config` may take: its slowest engine's start on a cold node (`start_timeout_s` plus the
    engine's cold-start allowance: `serve.engines.waits`), the old engines' drain (a stop-then-start roll waits for
    it) and `DEPLOY_MARGIN_S`."""
    from serve.engines.waits import slowest_start_s
    from serve.replica.deployment import STOP_GRACE_S

    slowest = slowest_start_s(config.replicas().values())
    return slowest + 2 * STOP_GRACE_S + 5 + DEPLOY_MARGIN_S


def needs_of(options: dict[str, Any]) -> dict[str, float]:
    """The resources one replica with these `ray_actor_options` reserves on its node (zeros left out). Pure."""
    needs = {"CPU": float(options.get("num_cpus") or 0), "GPU": float(options.get("num_gpus") or 0),
             **{k: float(v) for k, v in (options.get("resources") or {}).items()}}
    return {k: v for k, v in needs.items() if v > 0}


def fits(needs: Sequence[dict[str, float]], free: Sequence[dict[str, float]]) -> bool:
    """Whether every replica of `needs` can be placed at once on the nodes' `free` resources, each replica on one
    node (first fit, largest first: a replica needing a whole node's GPUs is placed before small ones). Pure."""
    left = [dict(node) for node in free]
    for need in sorted(needs, key=lambda n: sorted(n.items(), key=lambda kv: -kv[1]), reverse=True):
        node = next((n for n in left if all(n.get(k, 0.0) + 1e-9 >= v for k, v in need.items())), None)
        if node is None:
            return False
        for k, v in need.items():
            node[k] = node.get(k, 0.0) - v
    return True


def changed_replicas(new: ServingConfig, running: ServingConfig | None) -> list[ReplicaConfig]:
    """The engines of `new` that differ from those `running` serves (each route's replica); all of them when nothing
    runs. Pure."""
    old = running.replicas() if running is not None else {}
    return [replica for route, replica in new.replicas().items() if old.get(route) != replica]


def plan_roll(new: ServingConfig, running: ServingConfig | None, num_replicas: int,
              free: Sequence[dict[str, float]], threads: int | None = None) -> Roll:
    """SURGE when a second copy of every engine that changes fits beside what runs now (or nothing runs: a first
    deploy replaces nothing), else STOP_THEN_START. Pure: `free` is each node's free resources now."""
    from serve.replica.placement import actor_options

    if running is None:
        return SURGE
    changed = changed_replicas(new, running)
    if threads is not None:
        changed = [r.model_copy(update={"threads": threads}) for r in changed]
    needs = [needs_of(actor_options(replica)) for replica in changed for _ in range(num_replicas)]
    return SURGE if fits(needs, free) else STOP_THEN_START


def free_per_node() -> list[dict[str, float]]:
    """Each alive node's free resources now, from the Ray this process is connected to."""
    from ray._private import state

    return [dict(resources) for resources in state.available_resources_per_node().values()]


def await_engines(app: str, deployments: Sequence[str], deadline_s: float,
                  done: Callable[[str | None], None]) -> None:
    """Poll the Serve controller until `deployments` of `app` are all HEALTHY, or for `deadline_s` at most (a roll
    that failed is the driver's to roll back), then call `done(None)`: the new ingress's gap ends. Runs on a
    thread of the ingress replica."""
    # a controller busy or restarting is asked again
    wait_for_app(app, deadline_s, lambda s: s.healthy(list(deployments)), retry_errors=True)
    done(None)
