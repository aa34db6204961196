"""The SGLang engine: its command line for the installed SGLang, on a GPU or a CPU, and the checks that run on the
replica's node before it starts (GPUs Ray gave the replica, driver, CUDA and host compilers, free GPU memory, SGLang's
own parser on the exact argv).

Facts this depends on (read from the 0.5.23 wheel, reference/sglang-0.5.23.md §11): the `sglang` console script is
the entry point and it lives next to the interpreter of the venv it was installed into, which is usually not on the
PATH of a Ray worker; `python -m sglang.launch_server` is the fallback. 0.5.23's torch is a CUDA 13 build, and every
start JIT-compiles CUDA kernels with nvcc and the host C++ compiler. NGRAM's trie is C++ JIT-compiled with the host
compiler on first use. SGLang never calls setsid, so killing the process group we start it in reaches its scheduler
and detokenizer children.

`device: cpu` runs SGLang's own server on a CPU machine from its own venv (`serve.engines.sglang.cpu`), with the CPU
flags of `sglang_cpu.launch`; `auto` means cuda where the cluster has GPUs. Settings SGLang would otherwise choose
differently for the baseline and for speculative trials are rendered explicitly, the same for both: the attention
backend and `max_running_requests` (unset, SGLang caps every speculative algorithm at 48 and leaves the baseline's
memory-derived limit). The backend is the study's (`engine.attention_backend`, filled at study start with what SGLang
0.5.23 picks on the node's GPU architecture for the widest tree of the search space: `serve.engines.sglang.backend`);
a config built without one gets, for the model's attention type, the backend whose verify applies the tree mask on
every architecture. A tree on a backend whose verify ignores
the tree mask is refused (INVALID) in `prepare`, from what SGLang's own resolution says it will run. Effective values
are read back from `/server_info` (`pinned_settings`, `effective_settings`). `--nccl-port` is drawn from a range no
SGLang process draws from itself (serve/ports.py): SGLang binds its HTTP port only after the model loads, and a
parallel trial's own NCCL draw could take it meanwhile.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from serve.engines.sglang import cpu as sglang_cpu
from serve.engines.base import ConfigRejected, Engine, ReplicaConfig
from serve.engines.spec_flags import UnsupportedSetting, render_spec
from serve.engines.phases import report_phase
from serve.model_store import cache_root
from serve.spec import SGLANG_ALGORITHMS
from serve.engines.sglang.check import (PREFLIGHT_TIMEOUT_S, Preflight, installed_version, run_preflight,  # noqa: F401
                                        server_arg_fields)
from serve.engines.sglang.backend import (AttentionKind, architecture_of, attention_kind,
                                          deterministic_problem, resolved_tree, tree_mask_problem, tree_of)
from serve.engines.sglang.cpu import launch as cpu_launch
from serve.engines.sglang.cpu.runtime import version_problem
from serve.engines.sglang.node import (GPU_FREE_WAIT_S, Device, busy_gpus, compiler_problems, cuda_compiler,  # noqa: F401
                                       draft_tp_problem, driver_cuda_version, host_compiler, local_model_config,
                                       node_gpu_arch, node_problems, ray_gpu_ids, wait_gpus_free)

DEFAULT_CPUS_PER_GPU = 2.0  # NGRAM drafts on the host: replicas must not share a core
# SGLang's own cap for every speculative algorithm when unset (arg_groups/speculative_hook.py): rendered for the
# baseline too, so baseline and trials run the same batch limit unless the study sets one.
DEFAULT_MAX_RUNNING_REQUESTS = 48
# On CPU the only backend the CPU runtime pieces support. On a GPU, for a config built without one (outside a study):
# for each attention type the backend whose verify applies a tree mask on every architecture (sglang_backend.py).
CPU_ATTENTION_BACKEND = "torch_native"
PORTABLE_ATTENTION_BACKEND = {"mha": "flashinfer", "mla": "triton"}
ADAPTIVE_CONFIG_FILE = "adaptive_config.json"  # a tuned adaptive config, beside the engine command that names it
# A node's first start of SGLang pays what later starts find cached: on a GPU the JIT-compiled kernels (SGLang's,
# flashinfer's: minutes at tp 8) and the model in the page cache (a 236B bf16 checkpoint is ~470 GB of reads); on a
# CPU the NGRAM trie's compile (~20 s on two cores). That start may take this much longer than start_timeout_s.
COLD_START_ALLOWANCE_S = {"cuda": 1200.0, "cpu": 300.0}
# Serve's health check asks /health every few seconds; by default SGLang answers it with a real 1-token generation,
# which would add prefills to a trial's measured batches. With this off, /health still answers 503 until SGLang is up.
HEALTH_ENV = {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}


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
        return [executable, "-m", "serve.engines.sglang.cpu", "serve"]
    script = Path(executable).parent / "sglang"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script), "serve"]
    return [executable, "-m", "sglang.launch_server"]


def attention_backend(config: ReplicaConfig, device: Device) -> str:
    """The backend the command line pins: the config's (a study's is decided at its start, `sglang_study`); without
    one, on a GPU the backend whose verify applies a tree mask on every architecture for the model's attention type
    (the same for any config of the model, whatever its tree or node); on a CPU torch_native."""
    if config.attention_backend:
        return config.attention_backend
    if device == "cpu":
        return CPU_ATTENTION_BACKEND
    return PORTABLE_ATTENTION_BACKEND[attention_kind(local_model_config(cpu_launch.model_folder(config.model)) or {})]


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
                device: Device | None = None, nccl_port: int | None = None,
                adaptive_config: str | None = None) -> list[str]:
    """Server flags (no launcher) for a ReplicaConfig; `available` = the installed ServerArgs fields (see
    `server_arg_fields`), None = SGLang 0.5.23's. Renders `model.dtype` (float32 on CPU unless given: SGLang's auto
    there is float16), the pinned attention backend and running-request cap, the CPU flags on a CPU, `nccl_port`
    when given, and `adaptive_config` (the path of the spec's tuned adaptive config, `write_adaptive_config`)."""
    device = device or resolve_device(config)
    model = cpu_launch.model_folder(config.model)
    dtype = "float32" if device == "cpu" and config.dtype == "auto" else config.dtype
    args = ["--model-path", model, "--host", host, "--port", str(port), "--tp-size", str(config.tp_size),
            "--dtype", dtype, "--attention-backend", attention_backend(config, device)]
    if nccl_port is not None:
        args += ["--nccl-port", str(nccl_port)]
    if adaptive_config is not None:
        args += ["--speculative-adaptive-config", adaptive_config]
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


def sglang_argv(config: ReplicaConfig, host: str, port: int, available: Iterable[str] | None = None,
                nccl_port: int | None = None, adaptive_config: str | None = None) -> list[str]:
    """The full command line: launcher + `sglang_args`."""
    device = resolve_device(config)
    python = python_for(device) if device == "cpu" else sys.executable
    return launcher(python, device) + sglang_args(config, host, port, available, device, nccl_port, adaptive_config)


def warm_marker(config: ReplicaConfig, device: Device) -> Path:
    """The file that says this node has started this SGLang version with this model (JIT and page caches warm)."""
    python = python_for(device) if device == "cpu" else None
    key = hashlib.sha256(f"{installed_version(python)}|{device}|{config.model}".encode()).hexdigest()[:16]
    return cache_root() / "warm-starts" / f"sglang-{key}"


def adaptive_document(config: ReplicaConfig) -> dict[str, Any] | None:
    """The spec's tuned adaptive config in SGLang's file format (`--speculative-adaptive-config`, read by
    `adaptive_spec_params._load_adaptive_config`): {"<batch size>": {"candidate_steps": [...]}}; None without one."""
    steps = getattr(config.spec, "adaptive_steps", None)
    if not steps:
        return None
    return {str(bucket): {"candidate_steps": list(candidates)} for bucket, candidates in sorted(steps.items())}


def write_adaptive_config(config: ReplicaConfig) -> str | None:
    """Write the spec's tuned adaptive config on this node (the replica's log folder, else the temp folder), named by
    its content; its path, None without one."""
    document = adaptive_document(config)
    if document is None:
        return None
    text = json.dumps(document, indent=2) + "\n"
    folder = Path(config.log_dir or tempfile.gettempdir())
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"adaptive_config-{hashlib.sha256(text.encode()).hexdigest()[:12]}.json"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return str(path)


def resolved_problem(resolved: Mapping[str, Any]) -> str | None:
    """Why a config SGLang's own resolution accepted must still not run (None: it may): SGLang turned adaptive off
    (`adaptive_unsupported_reason`, so the trial would measure a static config), or the tree it verifies would run
    on a backend whose verify ignores the tree mask (`serve.engines.sglang.backend`). `resolved`: the preflight's."""
    reason = resolved.get("adaptive_unsupported_reason")
    if reason:
        return (f"SGLang turns --speculative-adaptive off for this config ({reason}) and would run it static; "
                "fix: adaptive only with topk 1 (or unset)")
    if not resolved.get("speculative_algorithm") or not resolved.get("attention_backend"):
        return None
    kind: AttentionKind = "mla" if resolved.get("use_mla_backend") else "mha"
    # SGLang's resolved topk is what the backend's verify sees; NGRAM branches even where it resolves to 1
    tree = resolved_tree(str(resolved["speculative_algorithm"]), resolved.get("speculative_eagle_topk"))
    return tree_mask_problem(str(resolved["attention_backend"]), kind, tree)


def static_problem(config: ReplicaConfig, argv: list[str]) -> str | None:
    """What can be refused without SGLang: a draft whose heads do not split over tp_size, a tree on a backend whose
    verify ignores its mask (the model's attention type read from its config.json, where it is local)."""
    draft_path = getattr(config.spec, "draft_model", None)
    draft = local_model_config(draft_path)
    if draft is not None:
        problem = draft_tp_problem(draft, config.tp_size, f"the draft model {draft_path}")
        if problem:
            return problem
    if "--attention-backend" not in argv:
        return None
    model = local_model_config(cpu_launch.model_folder(config.model)) or {}
    backend = argv[argv.index("--attention-backend") + 1]
    return tree_mask_problem(backend, attention_kind(model), tree_of(config.spec, architecture_of(model)))


class SglangEngine(Engine):
    kind = "sglang"
    label = "SGLang"
    spec_details = True
    algorithms = frozenset(SGLANG_ALGORITHMS)

    def argv(self, config: ReplicaConfig, host: str, port: int) -> list[str]:
        """The command line this node starts: the NCCL port drawn here, a tuned adaptive config written here."""
        from serve.ports import free_port

        device = resolve_device(config)
        python = python_for(device) if device == "cpu" else None
        try:
            return sglang_argv(config, host, port, server_arg_fields(None, python), free_port(host, "nccl"),
                               write_adaptive_config(config))
        except UnsupportedSetting as exc:
            raise ConfigRejected(str(exc)) from None

    def command_argv(self, config: ReplicaConfig, host: str, port: int) -> list[str]:
        """As a user runs it: the tuned adaptive config named by its file name (it lies beside the command), the
        NCCL port left to SGLang."""
        device = resolve_device(config)
        python = python_for(device) if device == "cpu" else None
        adaptive = ADAPTIVE_CONFIG_FILE if adaptive_document(config) is not None else None
        try:
            return sglang_argv(config, host, port, server_arg_fields(None, python), adaptive_config=adaptive)
        except UnsupportedSetting as exc:
            raise ConfigRejected(str(exc)) from None

    def native_deploy_files(self, config: ReplicaConfig, host: str, port: int) -> dict[str, str]:
        document = adaptive_document(config)
        return {ADAPTIVE_CONFIG_FILE: json.dumps(document, indent=2) + "\n"} if document is not None else {}

    def start_timeout_s(self, config: ReplicaConfig, cold: bool | None = None) -> float:
        """`start_timeout_s`, plus the cold-cache allowance on a node that has not started this SGLang with this
        model before (`warm_marker`), or always when `cold` (a driver that cannot know the node)."""
        device = resolve_device(config)
        if cold is None:
            cold = not warm_marker(config, device).exists()
        return config.start_timeout_s + (COLD_START_ALLOWANCE_S[device] if cold else 0.0)

    def note_started(self, config: ReplicaConfig) -> None:
        marker = warm_marker(config, resolve_device(config))
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:  # an unwritable cache costs later starts the allowance, nothing else
            pass

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

    def deterministic_problem(self, config: ReplicaConfig) -> str | None:
        """Why SGLang would refuse the deterministic pass of `config` (its backend and model)."""
        if resolve_device(config) == "cpu":
            return None
        model = local_model_config(cpu_launch.model_folder(config.model)) or {}
        return deterministic_problem(attention_backend(config, "cuda"), attention_kind(model), architecture_of(model))

    def start_env(self, config: ReplicaConfig) -> dict[str, str]:
        """The engine's environment: health checks without generations, the CPU runtime on a CPU; the study's
        `engine.env` wins over both."""
        ours = dict(HEALTH_ENV)
        if resolve_device(config) == "cpu":
            ours.update(sglang_cpu.launch_env(config.threads))
        return super().start_env(config.model_copy(update={"env": {**ours, **config.env}}))

    def prepare(self, config: ReplicaConfig, argv: list[str]) -> dict[str, Any]:
        """SGLang's verdict on the exact argv first, resolved as this node's GPU would (it needs no GPU, and a
        refused config is INVALID on any node), then what SGLang accepts but must not run (`static_problem`,
        `resolved_problem`), then this node's prerequisites in the engine's own environment, then wait for the
        replica's GPUs to be free of an earlier engine."""
        device = resolve_device(config)
        python = python_for(device) if device == "cpu" else None
        arch = node_gpu_arch() if device == "cuda" else None
        found: dict[str, Any] = {"sglang_version": installed_version(python), "device": device,
                                 "sglang_python": python or sys.executable, "gpu_arch": arch}
        refused = static_problem(config, argv)
        if refused:
            raise ConfigRejected(refused)
        results = run_preflight([argv], python=python, gpu_arch=arch)
        if results is None:
            found["preflight"] = "skipped: sglang is not importable on this node"
        else:
            result = results[0]
            found["preflight"] = result.as_record()
            if result.rejected:
                raise ConfigRejected(f"SGLang rejected the flags at {result.stage}: {result.error}")
            refused = resolved_problem(result.resolved) if result.ok else None
            if refused:
                raise ConfigRejected(refused)
            if not result.ok:  # our side could not run SGLang's parser: no verdict on the config; the launch decides
                found["preflight_could_not_run"] = f"{result.stage}: {result.error}"
        verdict = found["preflight"]["ok"] if isinstance(found["preflight"], dict) else None
        said = " (SGLang's own parser accepted the flags: preflight ok)" if verdict else ""
        env = self.start_env(config)  # the compilers SGLang calls are the ones its own environment names
        if device == "cpu":
            problems = [p for p in [version_problem(found["sglang_version"], str(Path(python or "").parent.parent))]
                        if p]
            problems += compiler_problems(config, "cpu", env)
            if problems:
                raise RuntimeError("; ".join(problems) + said)
            return found
        gpu_ids = ray_gpu_ids()
        found["gpu_ids"] = gpu_ids
        problems = node_problems(config, gpu_ids, env=env)
        if problems:
            raise RuntimeError("; ".join(problems) + said)
        if gpu_ids:
            report_phase("waiting_for_gpus", GPU_FREE_WAIT_S)
            busy = wait_gpus_free(gpu_ids)
            if busy:
                raise RuntimeError(busy)
        return found
