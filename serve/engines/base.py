"""The engine contract: what a replica is told (`ReplicaConfig`) and how it becomes an engine command line.

Both engines are separate processes that speak one HTTP protocol (DESIGN §3): SGLang's native `/generate`,
`/health`, `/server_info`, `/flush_cache`, and the OpenAI routes. So one replica class, one load generator and one
record format serve both. Speculative flags are rendered with SGLang 0.5.23's exact names for both engines; the CPU
engine accepts the same names on purpose.
"""

from __future__ import annotations

import sys
from typing import Literal

from pathlib import Path

from pydantic import Field

from serve.engines.flags import ALGORITHM_NAMES, render_spec
from serve.spec import FrozenModel, NoSpec, SpecConfig

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for our own `python -m serve...` subprocesses: they must import this project even when the
    caller's working directory is elsewhere (Tune runs trials in their own folders) and it is not pip-installed."""
    import os

    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


class ReplicaConfig(FrozenModel):
    """Everything one engine replica needs to start. Trials and the production endpoint both build one."""

    engine: Literal["cpu", "sglang"] = "cpu"
    model: str = Field(description="cpu: model id, HF dir or .gguf; sglang: model path or HF id")
    dtype: Literal["float32", "bfloat16"] = "float32"
    spec: SpecConfig = Field(default_factory=NoSpec)
    max_running_requests: int | None = Field(None, ge=1)
    threads: int | None = Field(None, ge=1, description="cpu engine torch threads")
    tp_size: int = Field(1, ge=1, description="GPUs per replica (sglang)")
    extra_flags: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    start_timeout_s: float = Field(600.0, gt=0)
    log_dir: str | None = Field(None, description="where the engine log goes; None = a temp dir")


def cpu_engine_argv(config: ReplicaConfig, host: str, port: int) -> list[str]:
    """The embedded CPU engine's command line (`python -m serve.engines.cpu`)."""
    argv = [sys.executable, "-m", "serve.engines.cpu", "--model-path", config.model, "--host", host,
            "--port", str(port), "--dtype", config.dtype]
    if config.threads is not None:
        argv += ["--threads", str(config.threads)]
    return argv + render_spec(config.spec, config.max_running_requests) + list(config.extra_flags)


def engine_argv(config: ReplicaConfig, host: str, port: int) -> list[str]:
    """Command line for the configured engine."""
    if config.engine == "cpu":
        return cpu_engine_argv(config, host, port)
    from serve.engines.sglang import sglang_argv  # version-aware flag table; imports nothing heavy

    return sglang_argv(config, host, port)


# /server_info keys (SGLang names) that must read back as requested, per spec field.
EFFECTIVE_KEYS = {
    "num_draft_tokens": "speculative_num_draft_tokens",
    "max_bfs_breadth": "speculative_ngram_max_bfs_breadth",
    "min_bfs_breadth": "speculative_ngram_min_bfs_breadth",
    "match_type": "speculative_ngram_match_type",
    "max_trie_depth": "speculative_ngram_max_trie_depth",
    "capacity": "speculative_ngram_capacity",
    "num_steps": "speculative_num_steps",
    "topk": "speculative_eagle_topk",
}


def effective_diff(config: ReplicaConfig, server_info: dict) -> dict[str, tuple[object, object]]:
    """{field: (requested, effective)} for every speculative setting the engine changed. Pure.

    Auto params (None) and NGRAM's derived steps/topk are not requested, so they are not diffs; they are recorded
    with the server info. `max_running_requests` counts only when it was requested.
    """
    diffs: dict[str, tuple[object, object]] = {}
    algorithm = server_info.get("speculative_algorithm")
    wanted = ALGORITHM_NAMES.get(config.spec.algorithm)
    if (algorithm or None) != wanted:
        diffs["algorithm"] = (wanted, algorithm)
    for field, key in EFFECTIVE_KEYS.items():
        requested = getattr(config.spec, field, None)
        if requested is None or key not in server_info:
            continue
        if server_info[key] != requested:
            diffs[field] = (requested, server_info[key])
    if config.max_running_requests is not None:
        effective = server_info.get("max_running_requests")
        if effective != config.max_running_requests:
            diffs["max_running_requests"] = (config.max_running_requests, effective)
    return diffs
