"""The SGLang engine's prerequisites on the replica's node, pure parsers + thin probes: the GPUs Ray gave the replica
and their architecture, the NVIDIA driver's CUDA version, the CUDA and host compilers SGLang JIT-compiles with (found
and versioned in the engine's own environment, `Engine.start_env`: the study's `engine.env` sets CUDA_HOME and CXX),
free GPU memory, and whether a draft model's heads split over the replica's GPUs. Every check names the missing piece
and the fix; `node_problems` names all of them at once."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Mapping

from serve.engines.base import ReplicaConfig
from serve.engines.sglang.backend import GpuArch, arch_of

MIN_DRIVER_CUDA = (13, 0)  # sglang 0.5.23 pins torch 2.14.1 built for CUDA 13
MIN_NVCC = (13, 0)  # its JIT kernels compile against that torch: an older toolkit's nvcc fails on its headers
GPU_FREE_WAIT_S = 120.0
Device = Literal["cpu", "cuda"]


def driver_cuda_version(nvidia_smi_header: str) -> tuple[int, int] | None:
    """'... CUDA Version: 13.0 ...' from `nvidia-smi`'s banner -> (13, 0)."""
    found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", nvidia_smi_header)
    return (int(found.group(1)), int(found.group(2))) if found else None


def nvcc_version(text: str) -> tuple[int, int] | None:
    """'Cuda compilation tools, release 13.0, V13.0.48' from `nvcc --version` -> (13, 0)."""
    found = re.search(r"release\s+(\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _nvcc_banner(nvcc: str, env: Mapping[str, str]) -> str | None:
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30, env=dict(env)).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def node_gpu_arch(smi: Callable[..., str] | None = None) -> GpuArch | None:
    """This node's GPU architecture (its first GPU's compute capability); None without a readable driver."""
    try:
        text = (smi or _nvidia_smi)("--query-gpu=compute_cap", "--format=csv,noheader")
    except (OSError, subprocess.SubprocessError):
        return None
    lines = text.strip().splitlines()
    return arch_of(lines[0]) if lines else None


def local_model_config(path: str | None) -> dict[str, Any] | None:
    """The config.json of a model given as a local folder (None for a hub id, a missing folder or a bad file)."""
    if not path:
        return None
    file = Path(path).expanduser() / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def draft_tp_problem(draft: Mapping[str, Any], tp_size: int, where: str = "the draft model") -> str | None:
    """Why `draft` (its config.json) cannot run split over `tp_size` GPUs. SGLang 0.5.23 has no draft-tp setting:
    the draft runs at the target's tp, and its attention asserts `total_num_heads % tp_size == 0` and that KV heads
    divide or are divided by tp (`models/qwen2.py` ~167, `models/llama.py` ~183) after the target has loaded. None:
    it can, or the config does not say."""
    text = draft.get("text_config") or draft
    heads, kv = text.get("num_attention_heads"), text.get("num_key_value_heads")
    if not isinstance(heads, int) or tp_size <= 1:
        return None
    kv = kv if isinstance(kv, int) and kv > 0 else heads
    if heads % tp_size == 0 and (kv % tp_size == 0 if kv >= tp_size else tp_size % kv == 0):
        return None
    return (f"{where} has {heads} attention heads and {kv} KV heads, which do not split over tp_size={tp_size} "
            f"GPUs (SGLang runs the draft at the target's tp and has no draft-tp setting; it would fail its "
            f"head-count assertion after the target loads). Fix: a draft whose head counts tp_size divides, or a "
            f"smaller engine.tp_size")


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


def ray_gpu_ids(ray_module: Any = None) -> list[str] | None:
    """GPU ids Ray assigned to this process; None outside a Ray worker (Ray absent or not initialized). Inside one,
    ids that cannot be read are an error with Ray's reason: counting every GPU of the node instead would let the
    tp_size check pass with GPUs Ray gave to other replicas."""
    if ray_module is None:
        try:
            import ray as ray_module
        except ImportError:
            return None
    if not ray_module.is_initialized():
        return None
    try:
        ids = ray_module.get_runtime_context().get_accelerator_ids().get("GPU", [])
    except Exception as exc:  # noqa: BLE001 - any failure of Ray's API is reported with its own words
        raise RuntimeError(f"could not read the GPUs Ray assigned to this SGLang replica ({type(exc).__name__}: "
                           f"{exc}); the tp_size check needs them: check the replica's Ray version and resources")
    return [str(g) for g in ids]


def cuda_compiler(env: Mapping[str, str], which: Callable[[str], str | None] = shutil.which) -> str:
    """The nvcc SGLang 0.5.23 JIT-compiles with (`kernels/jit/utils/compile/toolchain.py`): $CUDA_HOME or
    $CUDA_PATH /bin/nvcc, else the nvcc on PATH, else /usr/local/cuda/bin/nvcc."""
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home is None:
        on_path = which("nvcc")
        home = os.path.dirname(os.path.dirname(on_path)) if on_path else "/usr/local/cuda"
    return os.path.join(home, "bin", "nvcc")


def host_compiler(env: Mapping[str, str]) -> str:
    """The host C++ compiler of SGLang's JIT builds (CUDA kernels and the NGRAM trie): $CXX, else `c++`."""
    return env.get("CXX") or "c++"


def _which_in(env: Mapping[str, str]) -> Callable[[str], str | None]:
    return lambda name: shutil.which(name, path=env.get("PATH"))


def compiler_problems(config: ReplicaConfig, device: Device, env: Mapping[str, str],
                      which: Callable[[str], str | None] | None = None,
                      exists: Callable[[str], bool] = os.path.exists,
                      banner: Callable[[str, Mapping[str, str]], str | None] = _nvcc_banner) -> list[str]:
    """The compilers SGLang will call on this node, looked up in `env` (the engine's environment, `start_env`) as
    SGLang looks them up, that are missing or too old (each problem names the lookup and the fix). `which`
    defaults to a PATH search in `env`."""
    which = which or _which_in(env)
    problems = []
    if device == "cuda":
        nvcc = cuda_compiler(env, which)
        if not exists(nvcc):
            problems.append(
                f"SGLang 0.5.23 JIT-compiles CUDA kernels at every start (the baseline's SiLU-and-mul, every greedy "
                f"tree verify) with {nvcc} ($CUDA_HOME or $CUDA_PATH, else nvcc on PATH, else /usr/local/cuda), "
                "which does not exist on this node: install the CUDA 13 toolkit (a -devel CUDA image, or NVIDIA's "
                "cuda-toolkit package) and set CUDA_HOME (infra/README.md)")
        else:
            version = nvcc_version(banner(nvcc, env) or "")
            if version is None or version < MIN_NVCC:
                found = f"CUDA {version[0]}.{version[1]}" if version else "a version it does not report"
                problems.append(
                    f"{nvcc} is {found}; SGLang 0.5.23's torch is a CUDA 13 build and its JIT kernels need nvcc "
                    f"{MIN_NVCC[0]}.{MIN_NVCC[1]} or newer: install the CUDA 13 toolkit and point CUDA_HOME at it "
                    "(engine.env or the node's environment; infra/README.md)")
    compiler = host_compiler(env)
    needs = "its JIT kernels" if device == "cuda" else ("the NGRAM trie" if config.spec.algorithm == "ngram" else "")
    if needs and which(compiler) is None and not exists(compiler):
        problems.append(f"SGLang compiles {needs} with the host C++ compiler {compiler!r} ($CXX, else c++) and this "
                        "node has none: apt-get install g++ (or set CXX) (infra/README.md)")
    return problems


def node_problems(config: ReplicaConfig, gpu_ids: list[str] | None, smi: Callable[..., str] = _nvidia_smi,
                  which: Callable[[str], str | None] | None = None, env: Mapping[str, str] | None = None,
                  exists: Callable[[str], bool] = os.path.exists,
                  banner: Callable[[str, Mapping[str, str]], str | None] = _nvcc_banner) -> list[str]:
    """Why this node cannot run `config` on a GPU (empty: it can). Every prerequisite is checked, so one start-up
    failure names every missing piece at once. `env`: the engine's environment (compilers are looked up there)."""
    env = os.environ if env is None else env
    problems = []
    if (which or shutil.which)("nvidia-smi") is None:
        return [f"SGLang needs {config.tp_size} GPU(s) per replica and this node has no NVIDIA driver (nvidia-smi "
                f"not found); run on a GPU node (infra/README.md), set engine.device: cpu, or set engine.kind: cpu"]
    count = len(gpu_ids) if gpu_ids is not None else sum(1 for l in smi("-L").splitlines() if l.startswith("GPU "))
    if count < config.tp_size:
        problems.append(f"engine.tp_size={config.tp_size} needs {config.tp_size} GPU(s); Ray gave this replica {count}")
    cuda = driver_cuda_version(smi())
    if cuda is not None and cuda < MIN_DRIVER_CUDA:
        problems.append(f"the NVIDIA driver supports CUDA {cuda[0]}.{cuda[1]}; sglang 0.5.23's torch needs CUDA "
                        f"{MIN_DRIVER_CUDA[0]}.{MIN_DRIVER_CUDA[1]} or newer: upgrade the driver (infra/README.md)")
    return problems + compiler_problems(config, "cuda", env, which, exists, banner)


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
