"""Defaults that depend on where the study runs. The typed defaults (`StudyConfig()`) are sized for the CPU demo: fp32,
`exact` equivalence, 4 measured prompts x 24 tokens at concurrency 1. A study for SGLang on a GPU gets the values
of `examples/study-gpu.yaml` for every key the study file and the command line leave unset, and the dry run names
each of them. Pure: the caller says whether this machine (or the Ray cluster it is connected to) has a GPU."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.config.engine import EngineSettings
from serve.engines import engine_for

__all__ = ["GPU_DEFAULTS", "EngineDefault", "apply_engine_defaults", "gpu_study", "is_set"]


@dataclass(frozen=True)
class EngineDefault:
    key: str  # dotted study key
    value: Any
    why: str


GPU_DEFAULTS: tuple[EngineDefault, ...] = (
    EngineDefault("model.dtype", "auto", "the checkpoint's own dtype (bf16 for most), not the CPU demo's float32"),
    EngineDefault("promotion.equivalence", "baseline-noise",
                  "bf16 under continuous batching is not bit-exact, not even the baseline against itself, so exact "
                  "would refuse lossless configs (docs/configuration.md, Equivalence)"),
    EngineDefault("workload.source", "code-edit", "83 prompts: 16 + 64 fit without cycling a prompt"),
    EngineDefault("workload.warmup_prompts", 16, "the warm-up split trials draw their warmup_requests from"),
    EngineDefault("workload.measure_prompts", 64, "enough requests to keep 8 in flight for 8 rounds"),
    EngineDefault("workload.max_new_tokens", 256, "decode-dominated requests, as served"),
    EngineDefault("concurrency", [8, 1],
                  "trials searched at 8 in flight; the finalists and the baseline re-measured at 8 and at 1"),
)


def is_set(data: Mapping[str, Any], dotted: str) -> bool:
    """Whether the merged study file + command line names `dotted` (a.b.c) itself."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def _get(data: Mapping[str, Any], dotted: str, default: Any) -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def gpu_study(data: Mapping[str, Any], gpu_here: Callable[[], bool]) -> bool:
    """A study whose engine runs on a GPU (`Engine.gpu_study`; SGLang: `engine.device: cuda`, or `auto` where
    `gpu_here()` says there is one, asked only then)."""
    try:
        engine = engine_for(_get(data, "engine.kind", EngineSettings.model_fields["kind"].default))
    except (ValueError, TypeError):  # not a kind: the validation of the merged study says so, with the fix
        return False
    return engine.gpu_study(_get(data, "engine.device", "auto"), gpu_here)


def apply_engine_defaults(data: Mapping[str, Any], gpu_here: Callable[[], bool],
                          ) -> tuple[dict[str, Any], tuple[EngineDefault, ...]]:
    """(`data` with the GPU defaults for every key it leaves unset, the defaults applied). `data` is the merged
    study file and command line (dotted keys already nested); it is not changed."""
    merged = copy.deepcopy(dict(data))
    if not gpu_study(merged, gpu_here):
        return merged, ()
    applied = []
    for default in GPU_DEFAULTS:
        if is_set(merged, default.key):
            continue
        parent, _, leaf = default.key.rpartition(".")
        node: Any = merged
        for part in parent.split(".") if parent else ():
            node = node.setdefault(part, {}) if isinstance(node, dict) else None
        if isinstance(node, dict):  # else the file gives a section a value that is not a mapping: validation says so
            if default.key == "concurrency" and _get(merged, "workload.arrival.mode", "closed") == "poisson":
                # open loop measures at a rate: one level, the warm-up's concurrency
                default = EngineDefault("concurrency", default.value[:1], "open-loop arrivals: one level, the "
                                        "warm-up's closed-loop concurrency")
            node[leaf] = copy.deepcopy(default.value)
            applied.append(default)
    return merged, tuple(applied)
