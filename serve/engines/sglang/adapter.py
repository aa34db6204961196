"""SGLang as an engine kind: the replica's `SglangEngine` (`engine`) and what a study asks of the kind before anything
starts (its device, the settings one study's engines share, its verdict on the command lines, the deploy folder's
check: `study`). A subclass of its own because `study` builds on `engine`: the kind's one class sits above both."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from serve.engines.base import ReplicaConfig
from serve.engines.sglang import cpu as sglang_cpu
from serve.engines.sglang import study
from serve.engines.sglang.engine import SglangEngine, describe_device, pinned_settings, resolve_device

INSTALL_COMMAND = "bash infra/install-sglang-cpu.sh"


class SglangAdapter(SglangEngine):
    loads_hub_ids = True
    model_forms = "a local HF folder or a Hub id such as Qwen/Qwen2.5-7B-Instruct"
    context_limited = True
    # On the reference CPU (docs/benchmarks.md, "SGLang: 0.5.23 on this CPU"): started in 21-23 s, 3.20x slower than
    # the CPU engine per request.
    cpu_start_s = 22.0
    cpu_speed = 1 / 3.20
    cpu_basis = "SGLang's CPU server on SmolLM2-135M{size}"

    def device(self, config: ReplicaConfig) -> str:
        return resolve_device(config)

    def describe_device(self, config: ReplicaConfig) -> str | None:
        return describe_device(config)

    def gpu_study(self, device: str, gpu_here: Callable[[], bool]) -> bool:
        return device == "cuda" or (device == "auto" and gpu_here())

    def cpu_size_limited(self, config: ReplicaConfig) -> bool:
        return resolve_device(config) == "cpu"

    def installed(self, device: str) -> Path | None:
        # on a GPU nothing is checked: a dry run of a GPU study is often read elsewhere than on its GPU node
        return sglang_cpu.venv_python() if device == "cpu" else None

    def install_problem(self, device: str, installed: Path | None) -> str | None:
        if device != "cpu" or installed is not None:
            return None
        return (f"engine.kind sglang on the CPU needs SGLang's own venv, and {sglang_cpu.venv_dir()} has none. Fix: "
                f"{INSTALL_COMMAND} (or engine.kind: cpu, the embedded engine)")

    def pinned_settings(self, config: ReplicaConfig) -> dict[str, Any]:
        return pinned_settings(config)

    def node_facts(self, config: ReplicaConfig) -> study.NodeFacts:
        return study.node_facts(config)

    def shared_settings(self, config: ReplicaConfig, gpu_arch: str, widest: Any, probes: Any,
                        deterministic: bool) -> study.Shared | None:
        return study.shared_settings(config, gpu_arch, widest, probes, deterministic)

    def check_commands(self, configs: Sequence[ReplicaConfig], arch: str | None) -> list[Any] | None:
        return list(study.check_commands(configs, arch))

    def deploy_folder_report(self, folder: Path) -> str | None:
        return study.adaptive_report(folder)
