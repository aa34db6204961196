"""What a served config was tuned on, for its provenance (`serve.serving.Provenance.engine` / `.hardware`): the engine
kind and version its trial's engine reported (`server_info.json` of the trial run: `/server_info`'s `version`), and
the node that engine ran on (GPUs by count and name, CPU model and count), read on that node by a Ray task pinned to
it, since a study's engines may run on other machines than its driver. Never fails the study: what cannot be read
is left unknown (None)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from pipeline.measure.server_info import ServerInfo
from pipeline.records.trial_runs import run_server_info


def machine() -> dict[str, Any]:
    """This machine's CPU model and count, and its GPUs' names (`nvidia-smi`; none without it)."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpus: list[str] = []
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            done = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                                  timeout=30)
            gpus = [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []
        except (OSError, subprocess.SubprocessError):
            gpus = []
    return {"cpu": cpu, "cpus": os.cpu_count() or 0, "gpus": gpus}


def hardware_text(found: dict[str, Any]) -> str:
    """`2 x NVIDIA H100 80GB HBM3; AMD EPYC 9654, 192 CPUs` (GPUs first, when there are any). Pure."""
    gpus = list(found.get("gpus") or [])
    parts = [f"{gpus.count(name)} x {name}" for name in dict.fromkeys(gpus)]
    parts.append(f"{found.get('cpu') or 'unknown CPU'}, {found.get('cpus') or '?'} CPUs")
    return "; ".join(parts)


def engine_text(kind: str, server_info: ServerInfo | None) -> str:
    """`sglang 0.5.2`: the engine kind and the version its `/server_info` reported (`version unknown` without). Pure."""
    version = server_info.version if server_info is not None else None
    return f"{kind} {version}" if version else f"{kind} (version unknown)"


def node_hardware(node_id: str | None) -> str | None:
    """`hardware_text` of the Ray node `node_id` (this machine when it is None or Ray is not connected); None when
    it cannot be read."""
    ray = sys.modules.get("ray")
    try:
        if node_id and ray is not None and ray.is_initialized():
            # lazy: Ray takes seconds to import; only the paths that use the cluster pay for it
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            task = ray.remote(num_cpus=0)(machine).options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False))
            return hardware_text(ray.get(task.remote(), timeout=60))
        return hardware_text(machine())
    except Exception:  # noqa: BLE001 - provenance must not lose the study's result
        return None


def tuned_on(tracker: Any, run_id: str | None, kind: str) -> tuple[str, str | None]:
    """(engine, hardware) of the trial run `run_id` (its `server_info.json`)."""
    info: ServerInfo | None = None
    if run_id:
        try:
            info = run_server_info(tracker, run_id)
        except Exception:  # noqa: BLE001 - an unreadable record leaves the version unknown
            info = None
    return engine_text(kind, info), node_hardware(info.replica_node_id if info is not None else None)
