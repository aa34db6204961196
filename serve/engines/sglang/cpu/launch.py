"""What SGLang needs to be told to run on a CPU, and the model folder it reads. Used by the SGLang adapter.

Flags (each for a measured reason, reference: SGLang 0.5.23 on CPU): `--device cpu`; `--disable-overlap-schedule
--sleep-on-idle` (else the idle scheduler spins a core at 100%); a bounded KV pool (`--max-total-tokens`, else SGLang
sizes it from host memory). NGRAM's trie capacity is the study's (`spec.capacity`, SGLang's default 10M nodes
preallocates ~1.7 GiB of host memory per engine: search spaces for small machines set less). The dtype default on CPU is float32: SGLang's `auto` picks float16, which torch
runs ~17x slower than float32 on a CPU without native fp16 matmuls.

SGLang reads a HuggingFace folder. For a model of the CPU engine's store (a known id or a .gguf) that is the folder
the store converts once (`serve.engines.cpu.models.resolve_model`), seen through a folder of links that leaves out
the CPU engine's own files (its GGUF-block cache is a second `*.safetensors` that SGLang's loader would read as
weights).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from serve.model_store import KNOWN_MODELS, cache_root, resolve_model

__all__ = ["CPU_MAX_TOTAL_TOKENS", "cpu_flags", "model_folder"]

CPU_MAX_TOTAL_TOKENS = 8192  # KV slots of the whole engine: fp32 SmolLM2-135M needs 45 KiB a token, 360 MiB
_NOT_FOR_SGLANG = {"gguf-blocks.safetensors", "specdec-source.json"}
_MARKER = ".specdec-sglang-links"


def cpu_flags(extra_flags: list[str]) -> list[str]:
    """The CPU-only flags, without any the user already gave in `engine.extra_flags` (theirs win)."""
    given = {flag.split("=", 1)[0] for flag in extra_flags if flag.startswith("--")}
    wanted = [("--device", "cpu"), ("--disable-overlap-schedule", None), ("--sleep-on-idle", None),
              ("--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS))]
    flags: list[str] = []
    for flag, value in wanted:
        if flag not in given:
            flags += [flag] if value is None else [flag, value]
    return flags


def model_folder(model: str) -> str:
    """The HF folder SGLang gets for `model`: a CPU-engine model (known id or .gguf) converted once and linked
    without the CPU engine's own files; anything else (an HF folder, an HF hub id) as given."""
    if model not in KNOWN_MODELS and not model.endswith(".gguf"):
        return model
    source = resolve_model(model)
    target = cache_root() / "hf-sglang" / source.name
    if (target / _MARKER).exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    for item in sorted(source.iterdir()):
        if item.name not in _NOT_FOR_SGLANG:
            (tmp / item.name).symlink_to(item.resolve())
    (tmp / _MARKER).write_text(str(source) + "\n")
    tmp.chmod(0o755)
    try:
        os.replace(tmp, target)
    except OSError:  # another process made it first (os.replace onto a non-empty folder fails)
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
