"""The SGLang engine: its command line for the installed SGLang, on a GPU or a CPU, and the checks that run on the
replica's node before it starts (GPUs Ray gave the replica, driver, CUDA and host compilers, free GPU memory, SGLang's
own parser on the exact argv).

Facts this depends on (read from the 0.5.23 wheel, reference/sglang-0.5.23.md §11): the `sglang` console script is
the entry point and it lives next to the interpreter of the venv it was installed into, which is usually not on the
PATH of a Ray worker; `python -m sglang.launch_server` is the fallback. 0.5.23's torch is a CUDA 13 build, and every
start JIT-compiles CUDA kernels with nvcc and the host C++ compiler. NGRAM's trie is C++ JIT-compiled with the host
compiler on first use. SGLang never calls setsid, so killing the process group we start it in reaches its scheduler
and detokenizer children.

`device: cpu` runs SGLang's own server on a CPU machine from its own venv (`serve.engines.sglang_cpu`), with the CPU
flags of `sglang_cpu.launch`; `auto` means cuda where the cluster has GPUs. Settings SGLang would otherwise choose
differently for the baseline and for speculative trials are rendered explicitly, the same for both: the attention
backend (SGLang picks fa3 on Hopper only without speculation or with topk 1) and `max_running_requests` (unset,
SGLang caps every speculative algorithm at 48 and leaves the baseline's memory-derived limit). Their effective values
are read back from `/server_info` (`pinned_settings`, `effective_settings`).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable

from serve.engines import sglang_cpu
from serve.engines.base import ConfigRejected, Engine, ReplicaConfig, child_env
from serve.engines.settings import UnsupportedSetting, effective_diff, render_spec
from serve.engines.phases import report_phase
from serve.engines.sglang_cpu import launch as cpu_launch
from serve.engines.sglang_cpu.runtime import version_problem
from serve.engines.sglang_node import (GPU_FREE_WAIT_S, Device, busy_gpus, compiler_problems, cuda_compiler,  # noqa: F401
                                       driver_cuda_version, host_compiler, node_problems, ray_gpu_ids, wait_gpus_free)

PREFLIGHT_TIMEOUT_S = 300.0
DEFAULT_CPUS_PER_GPU = 2.0  # NGRAM drafts on the host: replicas must not share a core
# SGLang's own cap for every speculative algorithm when unset (arg_groups/speculative_hook.py): rendered for the
# baseline too, so baseline and trials run the same batch limit unless the study sets one.
DEFAULT_MAX_RUNNING_REQUESTS = 48
# The backend SGLang itself picks for speculative trees (topk > 1) on Hopper and Blackwell; the baseline gets it too.
# On CPU the only backend the CPU runtime pieces support.
DEFAULT_ATTENTION_BACKEND = {"cuda": "flashinfer", "cpu": "torch_native"}
# Serve's health check asks /health every few seconds; by default SGLang answers it with a real 1-token generation,
# which would add prefills to a trial's measured batches. With this off, /health still answers 503 until SGLang is up.
HEALTH_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}


def installed_version(python: str | None = None) -> str | None:
    """SGLang's version for `python` (None = this interpreter), None when it has none. Interpreters are told apart by
    their environment (the folder above `bin/`), not by what their symlinks resolve to: every venv of one base Python
    resolves to the same binary."""
    if python is None or Path(python).absolute().parent.parent == Path(sys.prefix).absolute():
        try:
            return metadata.version("sglang")
        except metadata.PackageNotFoundError:
            return None
    site = Path(python).parent.parent / "lib"
    found = sorted(site.glob("python3*/site-packages/sglang-*.dist-info"))
    return found[-1].name[len("sglang-"):-len(".dist-info")] if found else None


def _cluster_has_gpus() -> bool | None:
    """Whether the Ray cluster this process is connected to has GPUs (None outside Ray). Never imports Ray: a process
    that has not imported it is connected to no cluster, and importing it here (a study file's validation asks)
    would fix Ray's settings before the command line set its environment (`pipeline.tune.quiet_libraries`)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return float(ray.cluster_resources().get("GPU", 0)) > 0


def resolve_device(config: ReplicaConfig, has_gpus: Callable[[], bool | None] = _cluster_has_gpus,
                   which: Callable[[str], str | None] = shutil.which) -> Device:
    """`engine.device`, with auto = cuda where the Ray cluster has GPUs (outside Ray: where this machine has an
    NVIDIA driver), else cpu. The same answer in the trial (resources) and in the replica (command line)."""
    if config.device != "auto":
        return config.device
    gpus = has_gpus()
    if gpus is None:
        gpus = which("nvidia-smi") is not None
    return "cuda" if gpus else "cpu"


def describe_device(config: ReplicaConfig) -> str:
    """One line for the dry run: where SGLang would run, and why when it was chosen automatically."""
    device = resolve_device(config)
    if config.device != "auto":
        return f"sglang runs on {device} (engine.device: {device})"
    reason = "an NVIDIA driver (nvidia-smi) is present" if device == "cuda" else "no GPU here (nvidia-smi not found)"
    where = f", with {sglang_cpu.venv_dir()}" if device == "cpu" else ""
    return f"sglang runs on {device} (engine.device: auto, {reason}{where})"


def python_for(device: Device) -> str:
    """The interpreter that runs SGLang: this one on a GPU node (the venv of `pip install -e .[gpu]`), the SGLang
    CPU venv's on a CPU. A missing CPU venv is a RuntimeError with the install command."""
    if device == "cuda":
        return sys.executable
    python = sglang_cpu.venv_python()
    if python is None:
        raise RuntimeError(f"SGLang on CPU needs its own venv, and {sglang_cpu.venv_dir()} has none: run "
                           "bash infra/install-sglang-cpu.sh (or set engine.kind: cpu)")
    return str(python)


def launcher(executable: str = sys.executable, device: Device = "cuda") -> list[str]:
    """How to start SGLang with the SGLang installed for `executable`: the console script beside it, else the module;
    on a CPU, our launcher module (it refuses another SGLang version, then runs `sglang serve`). Never a bare
    `sglang` looked up on PATH: Ray workers and `.venv/bin/python -m ...` do not put the venv on it."""
    if device == "cpu":
        return [executable, "-m", "serve.engines.sglang_cpu", "serve"]
    script = Path(executable).parent / "sglang"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script), "serve"]
    return [executable, "-m", "sglang.launch_server"]


def attention_backend(config: ReplicaConfig, device: Device) -> str:
    return config.attention_backend or DEFAULT_ATTENTION_BACKEND[device]


def pinned_settings(config: ReplicaConfig, device: Device | None = None) -> dict[str, Any]:
    """What the command line fixes beyond the speculative table, under SGLang's `/server_info` names: compared with
    what SGLang reports after deploy (`settings.effective_diff(..., pinned=...)`)."""
    device = device or resolve_device(config)
    pinned: dict[str, Any] = {"attention_backend": attention_backend(config, device),
                              "max_running_requests": config.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS}
    if config.dtype != "auto":
        pinned["dtype"] = config.dtype
    return pinned


def sglang_args(config: ReplicaConfig, host: str, port: int, available: Iterable[str] | None = None,
                device: Device | None = None) -> list[str]:
    """Server flags (no launcher) for a ReplicaConfig; `available` = the installed ServerArgs fields (see
    `server_arg_fields`), None = SGLang 0.5.23's. Renders `model.dtype` (float32 on CPU unless given: SGLang's auto
    there is float16), the pinned attention backend and running-request cap, the CPU flags on a CPU."""
    device = device or resolve_device(config)
    model = cpu_launch.model_folder(config.model)
    dtype = "float32" if device == "cpu" and config.dtype == "auto" else config.dtype
    args = ["--model-path", model, "--host", host, "--port", str(port), "--tp-size", str(config.tp_size),
            "--dtype", dtype, "--attention-backend", attention_backend(config, device)]
    if device == "cpu":
        args += cpu_launch.cpu_flags(list(config.extra_flags))
    cpu_python = sglang_cpu.venv_python() if device == "cpu" else None
    version = installed_version(str(cpu_python)) if cpu_python else installed_version()
    name = f"the installed SGLang ({version or 'unknown version'})"
    cap = config.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
    spec = config.spec
    draft = getattr(spec, "draft_model", None)
    if draft:  # a draft of the CPU engine's store reads from the same converted folder as a target would
        spec = spec.model_copy(update={"draft_model": cpu_launch.model_folder(draft)})
    return args + render_spec(spec, cap, available, name) + list(config.extra_flags)


def sglang_argv(config: ReplicaConfig, host: str, port: int, available: Iterable[str] | None = None) -> list[str]:
    """The full command line: launcher + `sglang_args`."""
    device = resolve_device(config)
    python = python_for(device) if device == "cpu" else sys.executable
    return launcher(python, device) + sglang_args(config, host, port, available, device)


def _preflight_process(request: dict[str, Any], timeout_s: float, sglang_path: str | None,
                       python: str | None = None) -> subprocess.CompletedProcess | str:
    """Run serve.engines.sglang_preflight with `python` (default this interpreter) and SGLang importable from
    `sglang_path` (a `pip install --target` dir) or that interpreter's environment. No GPU: CUDA_VISIBLE_DEVICES=""
    keeps SGLang's resolution from touching the replica's GPUs. With another interpreter (the SGLang CPU venv's),
    SGLang resolves as its CPU platform does at launch (SGLANG_USE_CPU_ENGINE=1)."""
    extra = {"CUDA_VISIBLE_DEVICES": ""}
    if python is not None:
        extra["SGLANG_USE_CPU_ENGINE"] = "1"
    env = child_env(extra)
    if sglang_path:
        env["PYTHONPATH"] = os.pathsep.join([sglang_path, env["PYTHONPATH"]])
    try:
        return subprocess.run([python or sys.executable, "-m", "serve.engines.sglang_preflight"],
                              input=json.dumps(request), capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return f"SGLang preflight took longer than {timeout_s:.0f} s"


def _last_json(done: subprocess.CompletedProcess) -> dict[str, Any] | None:
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else None


@functools.lru_cache(maxsize=8)
def server_arg_fields(sglang_path: str | None = None, python: str | None = None) -> frozenset[str] | None:
    """The `ServerArgs` field names of the SGLang importable here (or from `sglang_path`, or by `python`); None when
    it is absent. Flags are rendered from these, so a setting the installed version lacks is refused before launch."""
    if sglang_path is None and installed_version(python) is None:
        return None
    done = _preflight_process({"fields": True}, PREFLIGHT_TIMEOUT_S, sglang_path, python)
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
                  sglang_path: str | None = None, python: str | None = None) -> list[Preflight] | None:
    """SGLang's own parser (and, unless parse_only, resolution + checks) on each server-flag list, in one subprocess
    of `python` (default this interpreter). Argvs may include a launcher prefix. None when SGLang is absent there."""
    if sglang_path is None and installed_version(python) is None:
        return None
    request = {"argvs": [_strip_launcher(a) for a in argvs], "parse_only": parse_only}
    done = _preflight_process(request, timeout_s, sglang_path, python)
    if isinstance(done, str):
        return [Preflight(False, "timeout", done)] * len(argvs)
    data = _last_json(done)
    if not data or "results" not in data:
        return [Preflight(False, "crash", f"preflight exited {done.returncode}: {done.stderr[-2000:]}")] * len(argvs)
    return [Preflight(r["ok"], r["stage"], r["error"], r.get("resolved") or {}) for r in data["results"]]


def _strip_launcher(argv: list[str]) -> list[str]:
    return argv[argv.index("--model-path"):] if "--model-path" in argv else argv


class SglangEngine(Engine):
    kind = "sglang"
    label = "SGLang"
    spec_details = True
    algorithms = frozenset({"none", "ngram", "eagle", "eagle3", "standalone"})

    def argv(self, config: ReplicaConfig, host: str, port: int) -> list[str]:
        device = resolve_device(config)
        python = python_for(device) if device == "cpu" else None
        try:
            return sglang_argv(config, host, port, server_arg_fields(None, python))
        except UnsupportedSetting as exc:
            raise ConfigRejected(str(exc)) from None

    def actor_options(self, config: ReplicaConfig) -> dict[str, Any]:
        if resolve_device(config) == "cpu":  # like the CPU engine: the engine uses the node's cores, the actor proxies
            cpus = config.replica_cpus if config.replica_cpus is not None else 0.1
            return {"num_cpus": cpus, "num_gpus": 0, "resources": dict(config.replica_resources)}
        cpus = config.replica_cpus if config.replica_cpus is not None else DEFAULT_CPUS_PER_GPU * config.tp_size
        return {"num_cpus": cpus, "num_gpus": config.tp_size, "resources": dict(config.replica_resources)}

    def concurrent_replicas(self, config: ReplicaConfig, cluster_resources: dict[str, float]) -> int:
        """GPU groups: more replicas than fit would stay pending until their trials time out. On CPU one per node
        that can host it (two would time-share its cores and measure noise)."""
        fits = [cluster_resources.get(k, 0) // v for k, v in config.replica_resources.items() if v > 0]
        if resolve_device(config) == "cpu":
            return max(1, int(min(fits))) if fits else 1
        fits.append(cluster_resources.get("GPU", 0) // config.tp_size)
        return max(1, int(min(fits)))

    def deterministic_flags(self, config: ReplicaConfig) -> list[str] | None:
        """SGLang's batch-invariant mode on a GPU (its attention kernels and reductions fixed per request). Not on a
        CPU: the torch-native path has no such mode in 0.5.23, so the `deterministic` equivalence mode is refused
        there: use `exact` or `baseline-noise`."""
        return None if resolve_device(config) == "cpu" else ["--enable-deterministic-inference"]

    def start_env(self, config: ReplicaConfig) -> dict[str, str]:
        """The engine's environment: health checks without generations, the CPU runtime on a CPU; the study's
        `engine.env` wins over both."""
        ours = dict(HEALTH_ENV)
        if resolve_device(config) == "cpu":
            ours.update(sglang_cpu.launch_env(config.threads))
        return super().start_env(config.model_copy(update={"env": {**ours, **config.env}}))

    def prepare(self, config: ReplicaConfig, argv: list[str]) -> dict[str, Any]:
        """SGLang's verdict on the exact argv first (it needs no GPU, and a refused config is INVALID on any node),
        then this node's prerequisites, then wait for the replica's GPUs to be free of an earlier engine."""
        device = resolve_device(config)
        python = python_for(device) if device == "cpu" else None
        found: dict[str, Any] = {"sglang_version": installed_version(python), "device": device,
                                 "sglang_python": python or sys.executable}
        results = run_preflight([argv], python=python)
        if results is None:
            found["preflight"] = "skipped: sglang is not importable on this node"
        else:
            result = results[0]
            found["preflight"] = result.as_record()
            if result.rejected:
                raise ConfigRejected(f"SGLang rejected the flags at {result.stage}: {result.error}")
            if not result.ok:  # our side could not run SGLang's parser: no verdict on the config; the launch decides
                found["preflight_could_not_run"] = f"{result.stage}: {result.error}"
        verdict = found["preflight"]["ok"] if isinstance(found["preflight"], dict) else None
        said = " (SGLang's own parser accepted the flags: preflight ok)" if verdict else ""
        if device == "cpu":
            problems = [p for p in [version_problem(found["sglang_version"], str(Path(python or "").parent.parent))]
                        if p]
            problems += compiler_problems(config, "cpu", os.environ)
            if problems:
                raise RuntimeError("; ".join(problems) + said)
            return found
        gpu_ids = ray_gpu_ids()
        found["gpu_ids"] = gpu_ids
        problems = node_problems(config, gpu_ids)
        if problems:
            raise RuntimeError("; ".join(problems) + said)
        if gpu_ids:
            report_phase("waiting_for_gpus", GPU_FREE_WAIT_S)
            busy = wait_gpus_free(gpu_ids)
            if busy:
                raise RuntimeError(busy)
        return found
