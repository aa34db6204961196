"""The SGLang engine: argv for the installed version, preflight with SGLang's own parser, GPU presence check.

The process lifecycle (free port, process group, log capture, readiness on `/health`, teardown) is shared with the
CPU engine in `serve/replica.py::EngineProcess`; SGLang differs only in its command line and in needing GPUs.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from serve.engines.base import child_env
from serve.engines.flags import ALGORITHM_NAMES, FlagTable, render_spec, table_for

PREFLIGHT_TIMEOUT_S = 300.0


def installed_version() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def sglang_argv(config: Any, host: str, port: int, table: FlagTable | None = None) -> list[str]:
    """`sglang serve ...` for a ReplicaConfig, with the flag names of the installed SGLang version."""
    table = table or table_for(installed_version())
    argv = ["sglang", "serve", "--model-path", config.model, "--host", host, "--port", str(port),
            "--tp-size", str(config.tp_size)]
    return argv + render_spec(config.spec, config.max_running_requests, table) + list(config.extra_flags)


def gpu_problem(tp_size: int) -> str | None:
    """Why this machine cannot run an SGLang replica, or None. Cheap: no CUDA import."""
    if shutil.which("nvidia-smi") is None:
        return (f"the sglang engine needs {tp_size} GPU(s) per replica and this machine has no NVIDIA driver "
                f"(nvidia-smi not found); run on a GPU node (infra/README.md) or set engine.kind: cpu")
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed: {exc}"
    count = sum(1 for line in listed.splitlines() if line.startswith("GPU "))
    if count < tp_size:
        return f"the sglang engine needs tp_size={tp_size} GPU(s) per replica; this machine shows {count}"
    return None


@dataclass(frozen=True)
class Preflight:
    """What SGLang itself said about an argv: accepted or not (its error verbatim), and what it resolved."""

    ok: bool
    stage: str
    error: str | None
    resolved: dict[str, Any] = field(default_factory=dict)

    def diffs(self, spec: Any, max_running_requests: int | None) -> dict[str, tuple[object, object]]:
        """{setting: (requested, resolved)} where SGLang changed what was asked (e.g. topk=1 draft adjustment)."""
        wanted: dict[str, object] = {"speculative_algorithm": ALGORITHM_NAMES.get(spec.algorithm)}
        for name in ("num_steps", "num_draft_tokens"):
            if getattr(spec, name, None) is not None:
                wanted[f"speculative_{name}"] = getattr(spec, name)
        if getattr(spec, "topk", None) is not None:
            wanted["speculative_eagle_topk"] = spec.topk
        if max_running_requests is not None:
            wanted["max_running_requests"] = max_running_requests
        return {k: (v, self.resolved.get(k)) for k, v in wanted.items() if self.resolved.get(k) != v}


def _engine_args(argv: list[str]) -> list[str]:
    return argv[2:] if argv[:2] == ["sglang", "serve"] else argv


def run_preflight(argvs: list[list[str]], *, parse_only: bool = False,
                  timeout_s: float = PREFLIGHT_TIMEOUT_S) -> list[Preflight] | None:
    """SGLang's own parser (and, unless parse_only, resolution + checks) on each argv, in one subprocess.

    Returns None when SGLang is not installed here (the caller records that preflight was skipped).
    """
    if installed_version() is None:
        return None
    request = json.dumps({"argvs": [_engine_args(a) for a in argvs], "parse_only": parse_only})
    try:
        done = subprocess.run([sys.executable, "-m", "serve.engines.sglang_preflight"], input=request,
                              capture_output=True, text=True, timeout=timeout_s, env=child_env())
    except subprocess.TimeoutExpired:
        return [Preflight(False, "timeout", f"SGLang preflight took longer than {timeout_s:.0f} s")] * len(argvs)
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"results"')]
    if not lines:
        return [Preflight(False, "crash", f"preflight exited {done.returncode}: {done.stderr[-2000:]}")] * len(argvs)
    return [Preflight(r["ok"], r["stage"], r["error"], r.get("resolved") or {})
            for r in json.loads(lines[-1])["results"]]


def preflight(argv: list[str], timeout_s: float = PREFLIGHT_TIMEOUT_S) -> Preflight | None:
    """One argv through SGLang's parser, resolution and checks; None when SGLang is not installed."""
    results = run_preflight([argv], timeout_s=timeout_s)
    return results[0] if results else None
