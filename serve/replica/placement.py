"""What a trial's process needs to know about a replica without importing Ray Serve (whose import costs the first
trial ~0.6 s before its engine can start): the actor options of the replica that owns a config's engine, whether any
node can host it, the engine log's tail and the marker of a start past its timeout. Pure but for reading a log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from serve.engines import engine_for
from serve.engines.base import ReplicaConfig

START_TIMEOUT_MARKER = "engine not ready after"  # a start past its timeout: the trial's TIMEOUT
LOG_TAIL_BYTES = 8000


def actor_options(config: ReplicaConfig) -> dict[str, Any]:
    """`ray_actor_options` of the replica that owns `config`'s engine (its engine kind decides), for a caller that
    holds a config only (the production roll, the replica itself, the driver's standby); a trial asks the engine it
    holds (`Engine.actor_options`)."""
    return engine_for(config.engine).actor_options(config)


def unplaceable(options: dict[str, Any], nodes: list[dict[str, float]]) -> str | None:
    """Why no node of the cluster could ever host a replica with these `ray_actor_options` (None: one can).

    Ray would keep such a replica pending until the trial's deploy timeout (minutes for big models): an SGLang
    replica on a cluster without GPUs is the usual case. `nodes` are the alive nodes' total resources. Pure."""
    needs = {"CPU": float(options.get("num_cpus") or 0), "GPU": float(options.get("num_gpus") or 0),
             **{k: float(v) for k, v in (options.get("resources") or {}).items()}}
    needs = {k: v for k, v in needs.items() if v > 0}
    if any(all(node.get(k, 0) >= v for k, v in needs.items()) for node in nodes):
        return None
    offered = "; ".join(", ".join(f"{k}={v:g}" for k, v in sorted(n.items()) if k in needs or k in ("CPU", "GPU"))
                        or "nothing" for n in nodes) or "no nodes"
    wanted = ", ".join(f"{k}={v:g}" for k, v in sorted(needs.items()))
    return (f"no Ray node can host this replica: it needs {wanted} on one node, and the nodes offer: {offered}. "
            f"For SGLang run the study on a cluster with GPU nodes (infra/README.md) or set engine.kind: cpu; check "
            f"engine.tp_size, engine.replica_cpus and engine.replica_resources")


def log_tail(path: str | Path, limit: int = LOG_TAIL_BYTES) -> str:
    try:
        data = Path(path).read_bytes()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", "replace")
