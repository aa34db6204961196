"""llama-server's command line from a `ReplicaConfig`: the one place llama.cpp flag names are written. Pure.

Flags are llama-server 11434's full names (`llama-server --help` of the pinned build). The shim adds `--host`,
`--port` (its private port) and, for `llama_ngram_cache` with `dynamic_cache`, `--lookup-cache-dynamic <file>` with a
fresh file per engine start; everything else is here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from serve.spec import (LlamaDraftSpec, LlamaNgramCacheSpec, LlamaNgramMapK4vSpec, LlamaNgramMapKSpec, LlamaNgramModSpec,
                        LlamaNgramSimpleSpec, NoSpec)

# our algorithm -> llama-server --spec-type
SPEC_TYPES = {
    "llama_ngram_simple": "ngram-simple", "llama_ngram_map_k": "ngram-map-k", "llama_ngram_map_k4v": "ngram-map-k4v",
    "llama_ngram_mod": "ngram-mod", "llama_ngram_cache": "ngram-cache", "llama_draft": "draft-simple",
}
_LOOKUP_PREFIX = {LlamaNgramSimpleSpec: "--spec-ngram-simple", LlamaNgramMapKSpec: "--spec-ngram-map-k",
                  LlamaNgramMapK4vSpec: "--spec-ngram-map-k4v"}
# Flags the tuner renders: a user's extra flags must not set them, or the engine would run something unrecorded.
OWNED_FLAGS = frozenset({"-m", "--model", "--host", "--port", "-t", "--threads", "-np", "--parallel", "--spec-type",
                         "-md", "--model-draft", "--spec-draft-model", "--lookup-cache-static", "-lcs",
                         "--lookup-cache-dynamic", "-lcd", "--metrics", "-a", "--alias"})


def spec_flags(spec: Any, draft_gguf: Path | None = None) -> list[str]:
    """`--spec-*` flags for one spec (none for the baseline). `draft_gguf`: the resolved draft file (llama_draft)."""
    if isinstance(spec, NoSpec):
        return []
    flags = ["--spec-type", SPEC_TYPES[spec.algorithm]]
    if type(spec) in _LOOKUP_PREFIX:
        prefix = _LOOKUP_PREFIX[type(spec)]
        flags += [f"{prefix}-size-n", str(spec.size_n), f"{prefix}-size-m", str(spec.size_m),
                  f"{prefix}-min-hits", str(spec.min_hits)]
    elif isinstance(spec, LlamaNgramModSpec):
        flags += ["--spec-ngram-mod-n-match", str(spec.n_match), "--spec-ngram-mod-n-min", str(spec.n_min),
                  "--spec-ngram-mod-n-max", str(spec.n_max)]
    elif isinstance(spec, LlamaNgramCacheSpec):
        if spec.static_cache:
            flags += ["--lookup-cache-static", str(Path(spec.static_cache).expanduser())]
    elif isinstance(spec, LlamaDraftSpec):
        if draft_gguf is None:
            raise ValueError("spec.draft_model: llama_draft needs the draft GGUF resolved before rendering")
        flags += ["--spec-draft-model", str(draft_gguf), "--spec-draft-n-max", str(spec.draft_n_max),
                  "--spec-draft-n-min", str(spec.draft_n_min), "--spec-draft-p-min", str(spec.p_min),
                  "--spec-draft-p-split", str(spec.p_split)]
    else:
        raise ValueError(f"spec.algorithm={spec.algorithm!r} is not a llama.cpp algorithm; use one of "
                         f"none, {', '.join(SPEC_TYPES)}")
    return flags


def server_argv(binary: Path, gguf: Path, spec: Any, threads: int | None, parallel: int | None,
                extra_flags: list[str], draft_gguf: Path | None = None, alias: str | None = None) -> list[str]:
    """llama-server's argv without host/port. `threads`: the spec's, else the study's; `parallel`: slots
    (= max_running_requests; None = llama-server's auto); `alias`: the model name `/v1/models` reports."""
    bad = [f for f in extra_flags if f.split("=", 1)[0] in OWNED_FLAGS]
    if bad:
        raise ValueError(f"engine.extra_flags: {bad} set flags the tuner renders for llama-server; remove them and set "
                         "the study key or search-space parameter instead")
    # --no-repack: on the development VM (AMD EPYC advertising AMX) the GGML_NATIVE build's AMX path
    # (ggml_backend_amx_mul_mat, reached through weight repacking's extra buffers) segfaults at llama-server's first
    # decode; without repacking Q4_1 and F32 run the AVX-512 kernels. `engine.extra_flags: [--repack]` turns it back on.
    argv = [str(binary), "--model", str(gguf), "--metrics", "--slots", "--no-repack"]
    if alias:
        argv += ["--alias", alias]
    threads = getattr(spec, "threads", None) or threads
    if threads is not None:
        argv += ["--threads", str(threads)]
    if parallel is not None:
        argv += ["--parallel", str(parallel)]
    return argv + spec_flags(spec, draft_gguf) + list(extra_flags)


def needs_dynamic_cache(spec: Any) -> bool:
    return isinstance(spec, LlamaNgramCacheSpec) and spec.dynamic_cache
