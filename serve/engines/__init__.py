"""Engine kinds. `engine_for(kind)` is the one place a kind string becomes behaviour (docs/design.md, "Engines")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # not at run time: `python -m serve.engines.watchdog` starts every engine and needs
    # nothing of this package (pydantic alone is 0.1 s of each start)
    from serve.engines.base import Engine


def engine_for(kind: str) -> Engine:
    """The `Engine` for a config's `engine` value ("cpu" | "sglang" | "llama_cpp")."""
    if kind == "cpu":
        from serve.engines.cpu.adapter import CpuEngine

        return CpuEngine()
    if kind == "sglang":
        from serve.engines.sglang import SglangEngine

        return SglangEngine()
    if kind == "llama_cpp":
        from serve.engines.llama_cpp.adapter import LlamaCppEngine

        return LlamaCppEngine()
    raise ValueError(f"engine kind {kind!r} is unknown: use 'cpu' (embedded, no GPU), 'sglang' (a GPU node, or a CPU "
                     "with bash infra/install-sglang-cpu.sh) or "
                     "'llama_cpp' (llama.cpp's llama-server; bash infra/install-llama-cpp.sh)")


def pinned_settings(config: Any) -> dict[str, Any]:
    """What `config`'s command line fixes beyond the speculative table, by `/server_info` name (SGLang: attention
    backend, running-request cap, dtype), for `settings.effective_diff(..., pinned=...)`; {} for other engines."""
    if config.engine != "sglang":
        return {}
    from serve.engines.sglang import pinned_settings as sglang_pinned

    return sglang_pinned(config)


def describe_device(config: Any) -> str | None:
    """For the dry run: where an SGLang config would run and why (None for engines without a device choice)."""
    if config.engine != "sglang":
        return None
    from serve.engines.sglang import describe_device as sglang_device

    return sglang_device(config)


def node_facts(config: Any) -> Any:
    """What this node says about itself for `config`'s engine kind (SGLang: its GPU architecture and the model's
    config.json; `serve.engines.sglang_study.NodeFacts`); runs where it is called. None for other kinds."""
    if config.engine != "sglang":
        return None
    from serve.engines.sglang_study import node_facts as sglang_facts

    return sglang_facts(config)


def shared_settings(config: Any, gpu_arch: str, widest: Any, probes: Any, deterministic: bool) -> Any:
    """Engine settings one study's engines share, decided once before its first trial (SGLang on a GPU: the
    attention backend, `serve.engines.sglang_study.shared_settings`); None where the kind decides nothing."""
    if config.engine != "sglang":
        return None
    from serve.engines.sglang_study import shared_settings as sglang_shared

    return sglang_shared(config, gpu_arch, widest, probes, deterministic)


def check_commands(configs: list[Any], arch: str | None) -> list[Any] | None:
    """The engines' command lines for `configs` with the engine's own verdict on each
    (`serve.engines.sglang_study.CommandCheck`); None for kinds without one."""
    if not configs or configs[0].engine != "sglang":
        return None
    from serve.engines.sglang_study import check_commands as sglang_check

    return sglang_check(configs, arch)


def deploy_folder_report(kind: str, folder: Any) -> str | None:
    """The engine's own check of the files a deploy folder holds for it (SGLang: its loader on a tuned adaptive
    config); None when there is nothing to say."""
    if kind != "sglang":
        return None
    from serve.engines.sglang_study import adaptive_report

    return adaptive_report(folder)


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

    from serve.engines.cpu.models import KNOWN_MODELS, resolve_model

    if model in KNOWN_MODELS or model.endswith(".gguf") or Path(model).expanduser().is_dir():
        from serve.engines.cpu.convert import load_tokenizer

        return load_tokenizer(resolve_model(model))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)
