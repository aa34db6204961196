"""The SGLang engine's node checks (run in the replica, on the node that runs SGLang). nvidia-smi cannot run on a
machine without a GPU, so its output is given as text, and the compilers found are given as lookups; the parsers and
decisions are the real code."""

import pytest

from serve.engines.base import ReplicaConfig
from serve.engines.sglang.engine import (SglangEngine, busy_gpus, compiler_problems, cuda_compiler, driver_cuda_version,
                                  node_problems, ray_gpu_ids, wait_gpus_free)
from serve.spec import NgramSpec

NVCC = "/usr/local/cuda/bin/nvcc"

BANNER = """+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.65.06              Driver Version: 580.65.06      CUDA Version: {cuda}     |
+-----------------------------------------------------------------------------------------+"""
LIST = "GPU 0: NVIDIA H200 (UUID: GPU-1)\nGPU 1: NVIDIA H200 (UUID: GPU-2)\n"


def smi(cuda="13.0", query="0, 3, 143771\n1, 3, 143771\n"):
    def run(*args):
        if args == ("-L",):
            return LIST
        if args and args[0].startswith("--query-gpu"):
            return query
        return BANNER.format(cuda=cuda)
    return run


def nvcc13(nvcc, env):
    return "Cuda compilation tools, release 13.0, V13.0.88"


def has(*names):
    return lambda name: f"/usr/bin/{name}" if name in names else None


def files(*paths):
    return lambda path: path in paths


def test_driver_cuda_version_is_read_from_the_banner():
    assert driver_cuda_version(BANNER.format(cuda="13.0")) == (13, 0)
    assert driver_cuda_version(BANNER.format(cuda="12.8")) == (12, 8)
    assert driver_cuda_version("no banner") is None


def test_a_ready_node_has_no_problems():
    config = ReplicaConfig(engine="sglang", model="/m", tp_size=2, spec=NgramSpec())
    assert node_problems(config, ["0", "1"], smi(), has("nvidia-smi", "c++"), env={}, exists=files(NVCC),
                         banner=nvcc13) == []


def test_every_missing_prerequisite_is_named_at_once():
    config = ReplicaConfig(engine="sglang", model="/m", tp_size=4, spec=NgramSpec())
    problems = node_problems(config, ["0", "1"], smi(cuda="12.4"), has("nvidia-smi"), env={}, exists=files())
    text = " | ".join(problems)
    assert len(problems) == 4
    assert "tp_size=4 needs 4 GPU(s); Ray gave this replica 2" in text  # counted from Ray's assignment
    assert "CUDA 12.4" in text and "13.0 or newer" in text
    assert f"with {NVCC}" in text and "CUDA_HOME" in text
    assert "host C++ compiler 'c++'" in text and "apt-get install g++" in text


def test_no_driver_is_one_clear_problem():
    config = ReplicaConfig(engine="sglang", model="/m")
    (problem,) = node_problems(config, None, smi(), has(), env={}, exists=files())
    assert "no NVIDIA driver" in problem and "engine.kind: cpu" in problem and "engine.device: cpu" in problem


def test_outside_ray_the_gpus_are_counted_by_nvidia_smi():
    config = ReplicaConfig(engine="sglang", model="/m", tp_size=2)
    ready = dict(which=has("nvidia-smi", "c++"), env={}, exists=files(NVCC), banner=nvcc13)
    assert node_problems(config, None, smi(), **ready) == []
    assert node_problems(config.model_copy(update={"tp_size": 3}), None, smi(), **ready)


def test_busy_gpus_flags_only_the_replicas_gpus_holding_memory():
    query = "0, 70000, 143771\n1, 3, 143771\n2, 90000, 143771\n"
    assert busy_gpus(query, ["0", "1"]) == {"0": (70000, 143771)}
    assert busy_gpus(query, ["1"]) == {}


def test_waiting_for_free_gpus_ends_when_the_previous_engine_is_gone():
    answers = iter(["0, 70000, 143771\n", "0, 70000, 143771\n", "0, 4, 143771\n"])
    sleeps: list[float] = []
    assert wait_gpus_free(["0"], timeout_s=60, smi=lambda *a: next(answers), sleep=sleeps.append) is None
    assert len(sleeps) == 2


def test_gpus_that_stay_busy_are_a_problem_naming_the_memory():
    problem = wait_gpus_free(["0"], timeout_s=0, smi=lambda *a: "0, 70000, 143771\n", sleep=lambda s: None)
    assert problem is not None
    assert "GPU 0: 70000 of 143771 MiB in use" in problem and "did not exit" in problem


def test_replica_resources_reserve_host_cpus_for_ngram_drafting():
    engine = SglangEngine()
    gpu = dict(engine="sglang", model="/m", device="cuda")
    options = engine.actor_options(ReplicaConfig(**gpu, tp_size=2))
    assert options["num_gpus"] == 2 and options["num_cpus"] == 4.0
    pinned = ReplicaConfig(**gpu, replica_cpus=8, replica_resources={"gpu_node": 1})
    assert engine.actor_options(pinned)["num_cpus"] == 8 and engine.actor_options(pinned)["resources"] == {"gpu_node": 1}
    assert engine.concurrent_replicas(ReplicaConfig(**gpu, tp_size=2), {"GPU": 8}) == 4
    assert engine.concurrent_replicas(ReplicaConfig(**gpu, tp_size=2), {"GPU": 0}) == 1


def test_sglang_on_cpu_asks_ray_for_no_gpu_and_runs_one_replica_per_node():
    engine = SglangEngine()
    config = ReplicaConfig(engine="sglang", model="/m", device="cpu", tp_size=2)
    assert engine.actor_options(config) == {"num_cpus": 0.1, "num_gpus": 0, "resources": {}}
    assert engine.concurrent_replicas(config, {"GPU": 8, "CPU": 64}) == 1


def test_nvcc_is_looked_up_as_sglang_looks_it_up():
    # Defect 2.1: 0.5.23's toolchain.py: $CUDA_HOME or $CUDA_PATH, else nvcc on PATH, else /usr/local/cuda.
    assert cuda_compiler({"CUDA_HOME": "/opt/cuda-13"}, has()) == "/opt/cuda-13/bin/nvcc"
    assert cuda_compiler({"CUDA_PATH": "/opt/c"}, has()) == "/opt/c/bin/nvcc"
    assert cuda_compiler({}, lambda name: "/usr/local/cuda-13.0/bin/nvcc" if name == "nvcc" else None) == \
        "/usr/local/cuda-13.0/bin/nvcc"
    assert cuda_compiler({}, has()) == NVCC


def test_a_pip_only_gpu_node_without_nvcc_is_named_before_every_trial_fails_to_compile():
    config = ReplicaConfig(engine="sglang", model="/m")  # the baseline: no speculation, still JIT-compiles SiLU
    (problem,) = node_problems(config, ["0"], smi(), has("nvidia-smi", "c++"), env={"CUDA_HOME": "/opt/cuda"},
                               exists=files(NVCC), banner=nvcc13)
    assert "/opt/cuda/bin/nvcc" in problem and "does not exist on this node" in problem
    # $CXX is the host compiler SGLang hands host code to.
    (problem,) = node_problems(config, ["0"], smi(), has("nvidia-smi", "c++"), env={"CXX": "clang++-19"},
                               exists=files(NVCC), banner=nvcc13)
    assert "'clang++-19'" in problem


def test_on_cpu_only_ngram_needs_the_host_compiler():
    plain, ngram = ReplicaConfig(engine="sglang", model="/m"), ReplicaConfig(engine="sglang", model="/m", spec=NgramSpec())
    assert compiler_problems(plain, "cpu", {}, has(), files()) == []
    (problem,) = compiler_problems(ngram, "cpu", {}, has(), files())
    assert "NGRAM trie" in problem
    assert compiler_problems(ngram, "cpu", {}, has("c++"), files()) == []


class FakeRay:
    def __init__(self, initialized=True, error=None, ids=("3",)):
        self.initialized, self.error, self.ids = initialized, error, ids

    def is_initialized(self):
        return self.initialized

    def get_runtime_context(self):
        if self.error:
            raise self.error
        return self

    def get_accelerator_ids(self):
        return {"GPU": list(self.ids)}


def test_gpu_ids_ray_cannot_report_are_an_error_not_every_gpu_of_the_node():
    # Issue 32: a broad except used to return None here, and node_problems then counted every GPU nvidia-smi lists.
    assert ray_gpu_ids(FakeRay(ids=("3", "5"))) == ["3", "5"]
    assert ray_gpu_ids(FakeRay(initialized=False)) is None  # outside a Ray worker: nvidia-smi counts
    with pytest.raises(RuntimeError, match="could not read the GPUs Ray assigned.*AttributeError: no context"):
        ray_gpu_ids(FakeRay(error=AttributeError("no context")))
