"""The SGLang engine's node checks (run in the replica, on the node that runs SGLang). nvidia-smi cannot run on a
machine without a GPU, so its output is given as text; the parsers and decisions are the real code."""

from serve.engines.base import ReplicaConfig
from serve.engines.sglang import SglangEngine, busy_gpus, driver_cuda_version, node_problems, wait_gpus_free
from serve.spec import NgramSpec

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


def has(*names):
    return lambda name: f"/usr/bin/{name}" if name in names else None


def test_driver_cuda_version_is_read_from_the_banner():
    assert driver_cuda_version(BANNER.format(cuda="13.0")) == (13, 0)
    assert driver_cuda_version(BANNER.format(cuda="12.8")) == (12, 8)
    assert driver_cuda_version("no banner") is None


def test_a_ready_node_has_no_problems():
    config = ReplicaConfig(engine="sglang", model="/m", tp_size=2, spec=NgramSpec())
    assert node_problems(config, ["0", "1"], smi(), has("nvidia-smi", "g++")) == []


def test_every_missing_prerequisite_is_named_at_once():
    config = ReplicaConfig(engine="sglang", model="/m", tp_size=4, spec=NgramSpec())
    problems = node_problems(config, ["0", "1"], smi(cuda="12.4"), has("nvidia-smi"))
    text = " | ".join(problems)
    assert len(problems) == 3
    assert "tp_size=4 needs 4 GPU(s); Ray gave this replica 2" in text  # counted from Ray's assignment
    assert "CUDA 12.4" in text and "13.0 or newer" in text
    assert "g++" in text


def test_no_driver_is_one_clear_problem():
    config = ReplicaConfig(engine="sglang", model="/m")
    (problem,) = node_problems(config, None, smi(), has())
    assert "no NVIDIA driver" in problem and "engine.kind: cpu" in problem


def test_outside_ray_the_gpus_are_counted_by_nvidia_smi():
    config = ReplicaConfig(engine="sglang", model="/m", tp_size=2)
    assert node_problems(config, None, smi(), has("nvidia-smi")) == []
    assert node_problems(config.model_copy(update={"tp_size": 3}), None, smi(), has("nvidia-smi"))


def test_busy_gpus_flags_only_the_replicas_gpus_holding_memory():
    query = "0, 70000, 143771\n1, 3, 143771\n2, 90000, 143771\n"
    assert busy_gpus(query, ["0", "1"]) == {"0": (70000, 143771)}
    assert busy_gpus(query, ["1"]) == {}


def test_waiting_for_free_gpus_ends_when_the_previous_engine_is_gone():
    answers = iter(["0, 70000, 143771\n", "0, 70000, 143771\n", "0, 4, 143771\n"])
    sleeps = []
    assert wait_gpus_free(["0"], timeout_s=60, smi=lambda *a: next(answers), sleep=sleeps.append) is None
    assert len(sleeps) == 2


def test_gpus_that_stay_busy_are_a_problem_naming_the_memory():
    problem = wait_gpus_free(["0"], timeout_s=0, smi=lambda *a: "0, 70000, 143771\n", sleep=lambda s: None)
    assert "GPU 0: 70000 of 143771 MiB in use" in problem and "did not exit" in problem


def test_replica_resources_reserve_host_cpus_for_ngram_drafting():
    engine = SglangEngine()
    options = engine.actor_options(ReplicaConfig(engine="sglang", model="/m", tp_size=2))
    assert options["num_gpus"] == 2 and options["num_cpus"] == 4.0
    pinned = ReplicaConfig(engine="sglang", model="/m", replica_cpus=8, replica_resources={"gpu_node": 1})
    assert engine.actor_options(pinned)["num_cpus"] == 8 and engine.actor_options(pinned)["resources"] == {"gpu_node": 1}
    assert engine.concurrent_replicas(ReplicaConfig(engine="sglang", model="/m", tp_size=2), {"GPU": 8}) == 4
    assert engine.concurrent_replicas(ReplicaConfig(engine="sglang", model="/m", tp_size=2), {"GPU": 0}) == 1
