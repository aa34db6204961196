"""Up-front checks of the model and the engine install, part of `pipeline.preflight.check_study`: a model id no engine
knows (a typo: `smollm2-136m`), a model too big for the CPU SGLang would run on, an engine that is not installed.

The decisions are pure functions of the study's values and what was found (`*_problem`: None, or the problem in
words with the fix); `engine_problems` gathers the facts (files, the NVIDIA driver) and asks them.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from pipeline.config import StudyConfig
from serve.engines import engine_for
from serve.engines.base import ReplicaConfig
from serve.model_store import KNOWN_MODELS

__all__ = ["CPU_PARAMETER_LIMIT", "cpu_capacity_problem", "engine_install_problem", "engine_problems",
           "model_id_problem", "parameters_from_name"]

# The largest model of the bundled table (serve/engines/cpu/models.py: qwen2.5-coder-1.5b) is the largest the CPU
# engines are tested with; SGLang's CPU server decodes SmolLM2-135M at 17.7 tok/s on 2 cores (docs/benchmarks.md,
# "SGLang: 0.5.23 on this CPU"), so a 7B model would decode at well under 1 tok/s there.
CPU_PARAMETER_LIMIT = 2e9
_SIZE = re.compile(r"(?:(\d+)x)?(\d+(?:\.\d+)?)([bm])", re.IGNORECASE)


def _known_models() -> list[str]:
    return list(KNOWN_MODELS)


def parameters_from_name(model: str) -> float | None:
    """The parameter count a model's name states (`Qwen2.5-7B-Instruct` -> 7e9, `SmolLM2-135M` -> 1.35e8,
    `Mixtral-8x7B` -> 5.6e10); None when no part of the name is a size."""
    for part in re.split(r"[-_/ ]", Path(model.rstrip("/")).name):
        found = _SIZE.fullmatch(part)
        if found:
            experts = int(found.group(1) or 1)
            return experts * float(found.group(2)) * (1e9 if found.group(3).lower() == "b" else 1e6)
    return None


def _local(model: str) -> bool:
    return model.startswith(("/", "~", "./", "../")) or model.endswith(".gguf") or Path(model).expanduser().exists()


def model_id_problem(kind: str, model: str, where: str, known: list[str], remote: bool = False) -> str | None:
    """Why `model` names no model engine `kind` can load (None: it may; a missing local path is the engine's own
    check). cpu and llama_cpp load a bundled id or a file; SGLang also loads a Hub id, and a `remote` node (a Ray
    cluster) may hold paths this machine has not, so there only a near-miss of a bundled id (`smollm2-136m`) is
    refused. Pure apart from looking at the path."""
    engine = engine_for(kind)
    name = engine.model_name(model)
    if name in known or _local(name):
        return None
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    if (engine.loads_hub_ids or remote) and not close:
        return None  # a Hub id (Qwen/Qwen2.5-7B-Instruct, or a legacy one without an organisation), a node's path
    hint = f"did you mean {close[0]!r}? " if close else ""
    loads = engine.model_forms
    return (f"{where}: {model!r} is not a model engine {kind} knows: {hint}the bundled ids are {', '.join(known)}; "
            f"or give {loads}")


def cpu_capacity_problem(model: str, setting: str, where: str, known: list[str]) -> str | None:
    """Why SGLang on this machine's CPU (`engine.device` `setting`: auto without a GPU, or cpu) cannot run `model`
    as a study: its name states more than `CPU_PARAMETER_LIMIT` parameters, or, with `auto`, it is a Hub id outside
    the bundled table whose size is unknown here. Pure apart from looking at the path."""
    if model in known:
        return None
    parameters = parameters_from_name(model)
    if parameters is not None and parameters <= CPU_PARAMETER_LIMIT:
        return None
    if parameters is None and (setting != "auto" or _local(model)):
        return None
    size = (f"{parameters / 1e9:g}B parameters by its name" if parameters is not None
            else "a Hub id outside the bundled model table, of a size unknown here")
    why = "engine.device: auto, and no GPU here: nvidia-smi not found" if setting == "auto" else "engine.device: cpu"
    return (f"{where}: {model!r} ({size}) would run on this machine's CPU ({why}), where SGLang decodes SmolLM2-135M "
            f"at 17.7 tok/s on 2 cores (docs/benchmarks.md): a model over {CPU_PARAMETER_LIMIT / 1e9:g}B parameters "
            "is not a study there. Fix: run it on a GPU node (engine.device: cuda there, or --ray-address of a "
            f"cluster with GPUs), or study a bundled model on the CPU ({', '.join(known)})")


def engine_install_problem(kind: str, device: str, installed: Path | None) -> str | None:
    """Why the engine cannot start on this machine for want of an install (None: it is installed), given what
    `Engine.installed(device)` found. Pure. SGLang on a GPU is not checked: a dry run of a GPU study is often read on
    another machine than the GPU node it runs on."""
    return engine_for(kind).install_problem(device, installed)


def engine_problems(study: StudyConfig, install: bool = True) -> list[str]:
    """Every problem of the model ids, and, when the engines run on this machine (no `ray.address`), of the model's
    size for the CPU and of the engine's install (`install`)."""
    known = _known_models()
    kind = study.engine.kind
    named = [("model.target (--model)", study.model.target),
             *((f"model.drafts.{algorithm}", path) for algorithm, path in sorted(study.model.drafts.items()))]
    remote = study.ray.address is not None
    problems = [p for where, model in named if (p := model_id_problem(kind, model, where, known, remote))]
    if remote:
        return problems  # the engines run on the cluster's nodes: their devices and installs are theirs
    engine = engine_for(kind)
    config = ReplicaConfig(engine=kind, model=study.model.target, device=study.engine.device)
    device = engine.device(config)
    if engine.cpu_size_limited(config):
        problem = cpu_capacity_problem(study.model.target, study.engine.device, "model.target (--model)", known)
        problems += [problem] if problem else []
    if install:
        problem = engine_install_problem(kind, device, engine.installed(device))
        problems += [problem] if problem else []
    return problems
