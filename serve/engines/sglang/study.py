"""What one study's SGLang engines share, decided once before its first trial, and SGLang's verdict on a study's
command lines (the dry run's report). Reached through the kind's `Engine` methods (`SglangAdapter.shared_settings`,
`check_commands`, `node_facts`); the pipeline passes the widest and narrowest configs its search space can propose
and where to ask for the node's facts.

The attention backend (`serve.engines.sglang.backend.choose_backend`) needs the GPU architecture (`engine.gpu_arch`,
else what a node says: `node_facts`, asked on this machine, then on a GPU node of the Ray cluster) and the model's
config.json (a local folder or the Hugging Face cache, here or on that node). The decision is written into the
study's `engine.attention_backend` and `engine.gpu_arch`, so the baseline, every trial, the deterministic and
finalist passes and the served config render the same `--attention-backend`. A backend the study names is kept; a
`deterministic` study whose backend SGLang refuses to run deterministically is refused with the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serve.engines.base import ReplicaConfig
from serve.engines.sglang.engine import resolve_device, resolved_problem, sglang_argv, static_problem
from serve.engines.sglang.backend import (BASELINE_TREE, GpuArch, architecture_of, attention_kind, choose_backend,
                                          deterministic_problem, tree_of)
from serve.engines.sglang.check import run_preflight
from serve.engines.sglang.cpu.launch import model_folder
from serve.engines.sglang.node import local_model_config, node_gpu_arch
from serve.errors import UserError
from serve.spec import SpecConfig

__all__ = ["NodeFacts", "Shared", "node_facts", "shared_settings", "CommandCheck", "check_commands"]


@dataclass(frozen=True)
class NodeFacts:
    """What a node says about itself: its GPU architecture, the model's config.json as it reads it there."""

    gpu_arch: GpuArch | None = None
    model_config: dict[str, Any] | None = None


def model_config_of(model: str) -> dict[str, Any] | None:
    """The model's config.json as this machine can read it: a local folder, else the Hugging Face cache (no
    download). None where neither has it."""
    found = local_model_config(model_folder(model))
    if found is not None or Path(model).expanduser().is_absolute():
        return found
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model, "config.json")
    except Exception:  # noqa: BLE001 - not a hub id, or no hub client: nothing cached to read
        return None
    return local_model_config(str(Path(cached).parent)) if isinstance(cached, str) else None


def node_facts(config: ReplicaConfig) -> NodeFacts:
    """This node's facts (runs where it is called: the driver, or a Ray task on a GPU node)."""
    return NodeFacts(node_gpu_arch(), model_config_of(config.model))


@dataclass(frozen=True)
class Shared:
    """The decision: engine settings to set on the study (`update`), the line that says what and why, the GPU
    architecture it is for (None: unknown here, nothing decided)."""

    update: dict[str, Any] = field(default_factory=dict)
    line: str = ""
    arch: GpuArch | None = None


def shared_settings(config: ReplicaConfig, gpu_arch: str, widest: Sequence[SpecConfig],
                    probes: Sequence[Callable[[ReplicaConfig], NodeFacts]], deterministic: bool) -> Shared | None:
    """The attention backend of a study's engines (module docstring); None off a GPU. `widest`: the widest and
    narrowest configs the search space can propose (a backend may apply the tree mask only above some topk);
    `probes`: where to ask for the node's facts, in order; `deterministic`: the study compares outputs on
    deterministic-inference engines. Undecided (the architecture or the model's config unknown),
    every engine renders the adapter's backend, the same for any config of the model (`sglang.attention_backend`)."""
    if resolve_device(config) != "cuda":
        return None
    arch: GpuArch | None = None if gpu_arch == "auto" else gpu_arch  # type: ignore[assignment]
    model: dict[str, Any] | None = None
    for probe in probes:
        if arch is not None and model is not None:
            break
        facts = probe(config)
        arch, model = arch or facts.gpu_arch, model or facts.model_config
    if config.attention_backend is None and (arch is None or model is None):
        missing = "the GPU architecture" if arch is None else f"the config.json of {config.model!r}"
        line = (f"attention backend: not decided here ({missing} cannot be read here), so every engine runs the "
                "one whose verify applies the tree mask on any GPU (flashinfer for MHA, triton for MLA models); for "
                "SGLang's own pick set engine.gpu_arch (sm80, sm90, sm100, sm120) and give model.target as a local "
                "folder, or set engine.attention_backend")
        return Shared(line=line, arch=arch)
    model = model or {}
    kind, architecture = attention_kind(model), architecture_of(model)
    if config.attention_backend is not None:
        backend, line = config.attention_backend, f"attention backend {config.attention_backend} (engine.attention_backend)"
    elif arch is not None:
        choice = choose_backend(arch, kind, architecture,
                                [BASELINE_TREE, *(tree_of(spec, architecture) for spec in widest)])
        backend, line = choice.backend, choice.describe()
    else:
        return None
    problem = deterministic_problem(backend, kind, architecture) if deterministic else None
    if problem:
        raise UserError(f"promotion.equivalence: deterministic: {problem}, so the baseline's deterministic pass would "
                        "be refused and no trial could be compared. Fix: set engine.attention_backend to one it runs "
                        "(triton runs everywhere), or use promotion.equivalence: baseline-noise")
    return Shared(update={"attention_backend": backend, **({"gpu_arch": arch} if arch else {})}, line=line, arch=arch)


@dataclass(frozen=True)
class CommandCheck:
    """One engine command line and SGLang's verdict: `problem` (INVALID, SGLang's refusal), or what it resolved."""

    argv: list[str]
    ok: bool | None  # None: SGLang could not be asked here
    problem: str | None = None
    resolved: dict[str, Any] = field(default_factory=dict)
    unanswered: str | None = None  # why the preflight gave no verdict (it crashed, timed out): the launch decides


def check_commands(configs: Sequence[ReplicaConfig], arch: str | None) -> list[CommandCheck]:
    """Each config's command line with SGLang's own verdict on it (its parser, `resolve_once()` and
    `check_server_args()`, resolved as a GPU of `arch` would), plus what SGLang accepts but must not run
    (`static_problem`, `resolved_problem`)."""
    argvs = [sglang_argv(config, "127.0.0.1", 30000) for config in configs]
    verdicts = run_preflight(argvs, gpu_arch=arch) if argvs else []
    out = []
    for k, (config, argv) in enumerate(zip(configs, argvs)):
        verdict = verdicts[k] if verdicts is not None else None
        problem = static_problem(config, argv)
        if verdict is None:
            out.append(CommandCheck(argv, None if problem is None else False, problem))
        elif verdict.rejected or (problem and not verdict.ok):
            out.append(CommandCheck(argv, False, problem or f"SGLang refuses it at {verdict.stage}: {verdict.error}"))
        elif not verdict.ok:  # no verdict on the config (a Hub id looked up offline, a stub): not INVALID
            out.append(CommandCheck(argv, None, unanswered=f"{verdict.stage}: {verdict.error}"))
        else:
            problem = problem or resolved_problem(verdict.resolved)
            out.append(CommandCheck(argv, problem is None, problem, verdict.resolved))
    return out


def adaptive_report(folder: Path) -> str | None:
    """SGLang's own loader on the tuned adaptive config a deploy folder holds (None: it holds none)."""
    from serve.engines.sglang.engine import ADAPTIVE_CONFIG_FILE
    from serve.engines.sglang.check import check_adaptive_config

    path = folder / ADAPTIVE_CONFIG_FILE
    if not path.exists():
        return None
    verdict = check_adaptive_config(str(path))
    if verdict is None:
        return f"tuned adaptive config: {path} (SGLang is not importable here to load it)"
    if verdict["ok"]:
        return (f"tuned adaptive config: {path}, loaded by SGLang's own loader: candidate steps per batch size "
                f"{verdict['buckets']}")
    return f"tuned adaptive config: {path} was refused by SGLang's loader: {verdict['error']}"
