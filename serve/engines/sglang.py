"""The SGLang engine: its command line for the installed SGLang, and the checks that run on the replica's node before
it starts (GPUs Ray gave the replica, driver, compiler, free GPU memory, SGLang's own parser on the exact argv).

Facts this depends on (read from the 0.5.23 wheel, reference/sglang-0.5.23.md §11): the `sglang` console script is
the entry point and it lives next to the interpreter of the venv it was installed into, which is usually not on the
PATH of a Ray worker; `python -m sglang.launch_server` is the fallback. 0.5.23's torch is a CUDA 13 build. NGRAM's
trie is C++ JIT-compiled with the system `g++` on first use. SGLang never calls setsid, so killing the process group
we start it in reaches its scheduler and detokenizer children.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable

from serve.engines.base import ConfigRejected, Engine, ReplicaConfig, child_env
from serve.engines.settings import UnsupportedSetting, effective_diff, render_spec

PREFLIGHT_TIMEOUT_S = 300.0
MIN_DRIVER_CUDA = (13, 0)  # sglang 0.5.23 pins torch 2.14.1 built for CUDA 13
GPU_FREE_WAIT_S = 120.0
DEFAULT_CPUS_PER_GPU = 2.0  # NGRAM drafts on the host: replicas must not share a core


def installed_version() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def launcher(executable: str = sys.executable) -> list[str]:
    """How to start SGLang with the SGLang installed for `executable`: the console script beside it, else the module.
    Never a bare `sglang` looked up on PATH: Ray workers and `.venv/bin/python -m ...` do not put the venv on it."""
    script = Path(executable).parent / "sglang"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script), "serve"]
    return [executable, "-m", "sglang.launch_server"]


def sglang_args(config: ReplicaConfig, host: str, port: int, available: Iterable[str] | None = None) -> list[str]:
    """Server flags (no launcher) for a ReplicaConfig; `available` = the installed ServerArgs fields (see
    `server_arg_fields`), None = SGLang 0.5.23's."""
    args = ["--model-path", config.model, "--host", host, "--port", str(port), "--tp-size", str(config.tp_size)]
    name = f"the installed SGLang ({installed_version() or 'unknown version'})"
    return args + render_spec(config.spec, config.max_running_requests, available, name) + list(config.extra_flags)


def sglang_argv(config: ReplicaConfig, host: str, port: int, available: Iterable[str] | None = None) -> list[str]:
    """The full command line: launcher + `sglang_args`."""
    return launcher() + sglang_args(config, host, port, available)


def _preflight_process(request: dict[str, Any], timeout_s: float,
                       sglang_path: str | None) -> subprocess.CompletedProcess | str:
    """Run serve.engines.sglang_preflight with SGLang importable from `sglang_path` (a `pip install --target` dir) or
    the environment. No GPU: CUDA_VISIBLE_DEVICES="" keeps SGLang's resolution from touching the replica's GPUs."""
    extra = {"CUDA_VISIBLE_DEVICES": ""}
    env = child_env(extra)
    if sglang_path:
        env["PYTHONPATH"] = os.pathsep.join([sglang_path, env["PYTHONPATH"]])
    try:
        return subprocess.run([sys.executable, "-m", "serve.engines.sglang_preflight"], input=json.dumps(request),
                              capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"SGLang preflight took longer than {timeout_s:.0f} s"


def _last_json(done: subprocess.CompletedProcess) -> dict[str, Any] | None:
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


@functools.lru_cache(maxsize=8)
def server_arg_fields(sglang_path: str | None = None) -> frozenset[str] | None:
    """The `ServerArgs` field names of the SGLang importable here (or from `sglang_path`); None when it is absent.
    Flags are rendered from these, so a setting the installed version lacks is refused before launch."""
    if sglang_path is None and installed_version() is None:
        return None
    done = _preflight_process({"fields": True}, PREFLIGHT_TIMEOUT_S, sglang_path)
    data = None if isinstance(done, str) else _last_json(done)
    if not data or "fields" not in data:
        return None
    return frozenset(data["fields"])


@dataclass(frozen=True)
class Preflight:
    """What SGLang itself said about an argv: accepted or not (its error verbatim), and what it resolved.
    `stage` is parse/resolve/check for SGLang's verdicts, import/crash/timeout when the preflight could not run."""

    ok: bool
    stage: str
    error: str | None
    resolved: dict[str, Any] = field(default_factory=dict)

    @property
    def rejected(self) -> bool:
        return not self.ok and self.stage in ("parse", "resolve", "check")

    def diffs(self, config: ReplicaConfig) -> dict[str, tuple[object, object]]:
        """{setting: (requested, resolved)} where SGLang changed what was asked (e.g. the topk=1 draft rewrite)."""
        return effective_diff(config.spec, config.max_running_requests, self.resolved) if self.ok else {}

    def as_record(self) -> dict[str, Any]:
        return {"ok": self.ok, "stage": self.stage, "error": self.error, "resolved": self.resolved}


def run_preflight(argvs: list[list[str]], *, parse_only: bool = False, timeout_s: float = PREFLIGHT_TIMEOUT_S,
                  sglang_path: str | None = None) -> list[Preflight] | None:
    """SGLang's own parser (and, unless parse_only, resolution + checks) on each server-flag list, in one subprocess.
    Argvs may include a launcher prefix. Returns None when SGLang is not installed here."""
    if sglang_path is None and installed_version() is None:
        return None
    request = {"argvs": [_strip_launcher(a) for a in argvs], "parse_only": parse_only}
    done = _preflight_process(request, timeout_s, sglang_path)
    if isinstance(done, str):
        return [Preflight(False, "timeout", done)] * len(argvs)
    data = _last_json(done)
    if not data or "results" not in data:
        return [Preflight(False, "crash", f"preflight exited {done.returncode}: {done.stderr[-2000:]}")] * len(argvs)
    return [Preflight(r["ok"], r["stage"], r["error"], r.get("resolved") or {}) for r in data["results"]]


def _strip_launcher(argv: list[str]) -> list[str]:
    return argv[argv.index("--model-path"):] if "--model-path" in argv else argv


# --- prerequisites on the replica's node (pure parsers + thin probes) ---

def driver_cuda_version(nvidia_smi_header: str) -> tuple[int, int] | None:
    """'... CUDA Version: 13.0 ...' from `nvidia-smi`'s banner -> (13, 0)."""
    found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", nvidia_smi_header)
    return (int(found.group(1)), int(found.group(2))) if found else None


def busy_gpus(query_csv: str, gpu_ids: Iterable[str]) -> dict[str, tuple[int, int]]:
    """From `nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits`: {id: (used, total
    MiB)} for the given GPUs that hold more than a fresh CUDA context would (max(1 GiB, 5%)): a previous engine that
    has not exited yet, or someone else's process."""
    wanted, busy = {str(g) for g in gpu_ids}, {}
    for line in query_csv.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0] in wanted and parts[1].isdigit() and parts[2].isdigit():
            used, total = int(parts[1]), int(parts[2])
            if used > max(1024, total // 20):
                busy[parts[0]] = (used, total)
    return busy


def _nvidia_smi(*args: str) -> str:
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30, check=True).stdout


def _ray_gpu_ids() -> list[str] | None:
    """GPU ids Ray assigned to this process (None outside a Ray worker)."""
    try:
        import ray

        if not ray.is_initialized():
            return None
        return [str(g) for g in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]
    except Exception:  # noqa: BLE001 - outside Ray (tests, EngineProcess used directly)
        return None


def node_problems(config: ReplicaConfig, gpu_ids: list[str] | None, smi: Callable[..., str] = _nvidia_smi,
                  which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """Why this node cannot run `config` (empty: it can). Every prerequisite is checked, so one start-up failure
    names every missing piece at once."""
    problems = []
    if which("nvidia-smi") is None:
        return [f"SGLang needs {config.tp_size} GPU(s) per replica and this node has no NVIDIA driver (nvidia-smi "
                f"not found); run on a GPU node (infra/README.md) or set engine.kind: cpu"]
    count = len(gpu_ids) if gpu_ids is not None else sum(1 for l in smi("-L").splitlines() if l.startswith("GPU "))
    if count < config.tp_size:
        problems.append(f"engine.tp_size={config.tp_size} needs {config.tp_size} GPU(s); Ray gave this replica {count}")
    cuda = driver_cuda_version(smi())
    if cuda is not None and cuda < MIN_DRIVER_CUDA:
        problems.append(f"the NVIDIA driver supports CUDA {cuda[0]}.{cuda[1]}; sglang 0.5.23's torch needs CUDA "
                        f"{MIN_DRIVER_CUDA[0]}.{MIN_DRIVER_CUDA[1]} or newer: upgrade the driver (infra/README.md)")
    if config.spec.algorithm == "ngram" and which("g++") is None:
        problems.append("NGRAM compiles SGLang's C++ trie with g++ on first use and this node has none: "
                        "apt-get install g++ (infra/README.md)")
    return problems


def wait_gpus_free(gpu_ids: list[str], timeout_s: float = GPU_FREE_WAIT_S, smi: Callable[..., str] = _nvidia_smi,
                   sleep: Callable[[float], None] = time.sleep) -> str | None:
    """Wait until the replica's GPUs hold no other process's memory; the problem after `timeout_s`, else None."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = busy_gpus(smi("--query-gpu=index,memory.used,memory.total", "--format=csv,noheader,nounits"), gpu_ids)
        if not busy:
            return None
        if time.monotonic() >= deadline:
            held = ", ".join(f"GPU {g}: {u} of {t} MiB in use" for g, (u, t) in sorted(busy.items()))
            return (f"GPU memory still in use after {timeout_s:.0f} s ({held}): an earlier engine did not exit or "
                    f"another process holds the GPU; `nvidia-smi` on this node shows which")
        sleep(2.0)


class SglangEngine(Engine):
    kind = "sglang"
    label = "SGLang"
    algorithms = frozenset({"none", "ngram", "eagle", "eagle3", "standalone"})

    def argv(self, config: ReplicaConfig, host: str, port: int) -> list[str]:
        try:
            return sglang_argv(config, host, port, server_arg_fields())
        except UnsupportedSetting as exc:
            raise ConfigRejected(str(exc)) from None

    def actor_options(self, config: ReplicaConfig) -> dict[str, Any]:
        cpus = config.replica_cpus if config.replica_cpus is not None else DEFAULT_CPUS_PER_GPU * config.tp_size
        return {"num_cpus": cpus, "num_gpus": config.tp_size, "resources": dict(config.replica_resources)}

    def concurrent_replicas(self, config: ReplicaConfig, cluster_resources: dict[str, float]) -> int:
        """GPU groups: more replicas than fit would stay pending until their trials time out."""
        fits = [cluster_resources.get("GPU", 0) // config.tp_size]
        fits += [cluster_resources.get(k, 0) // v for k, v in config.replica_resources.items() if v > 0]
        return max(1, int(min(fits)))

    def prepare(self, config: ReplicaConfig, argv: list[str]) -> dict[str, Any]:
        """SGLang's verdict on the exact argv first (it needs no GPU, and a refused config is INVALID on any node),
        then this node's prerequisites, then wait for the replica's GPUs to be free of an earlier engine."""
        found: dict[str, Any] = {"sglang_version": installed_version()}
        results = run_preflight([argv])
        if results is None:
            found["preflight"] = "skipped: sglang is not importable on this node"
        else:
            result = results[0]
            found["preflight"] = result.as_record()
            if result.rejected:
                raise ConfigRejected(f"SGLang rejected the flags at {result.stage}: {result.error}")
            if not result.ok:  # our side could not run SGLang's parser: no verdict on the config; the launch decides
                found["preflight_could_not_run"] = f"{result.stage}: {result.error}"
        gpu_ids = _ray_gpu_ids()
        found["gpu_ids"] = gpu_ids
        problems = node_problems(config, gpu_ids)
        if problems:
            verdict = found["preflight"]["ok"] if isinstance(found["preflight"], dict) else None
            said = {True: " (SGLang's own parser accepted the flags: preflight ok)", False: "", None: ""}[verdict]
            raise RuntimeError("; ".join(problems) + said)
        if gpu_ids:
            busy = wait_gpus_free(gpu_ids)
            if busy:
                raise RuntimeError(busy)
        return found
