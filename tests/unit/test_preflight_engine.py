"""Issue #60, point 2: a model id no engine knows, a model too big for the CPU SGLang would run on, and a missing
engine install are refused before anything starts, each naming its fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import load_study
from pipeline.errors import PipelineError
from pipeline.preflight import check_study
from pipeline.preflight_engine import (
    cpu_capacity_problem, engine_install_problem, engine_problems, model_id_problem, parameters_from_name,
)
from serve.model_store import KNOWN_MODELS

KNOWN = list(KNOWN_MODELS)


@pytest.mark.parametrize("name, count", [
    ("Qwen/Qwen2.5-7B-Instruct", 7e9), ("HuggingFaceTB/SmolLM2-135M-Instruct", 1.35e8),
    ("Qwen/Qwen2.5-Coder-0.5B", 5e8), ("mistralai/Mixtral-8x7B-v0.1", 5.6e10), ("/models/llama-3-70b/", 7e10),
    ("gpt2", None), ("deepseek-ai/DeepSeek-V3", None),
])
def test_parameters_from_the_name(name, count):
    assert parameters_from_name(name) == count


def test_a_typo_of_a_bundled_id_names_the_close_match_and_the_known_ids():
    problem = model_id_problem("cpu", "smollm2-136m", "model.target (--model)", KNOWN)
    assert problem and "did you mean 'smollm2-135m'" in problem and all(k in problem for k in KNOWN)
    assert "model.target (--model)" in problem and "'smollm2-136m'" in problem


@pytest.mark.parametrize("kind, model", [
    ("cpu", "smollm2-135m"), ("llama_cpp", "smollm2-135m@f32"), ("cpu", "/models/x.gguf"),
    ("sglang", "Qwen/Qwen2.5-7B-Instruct"), ("sglang", "gpt2"),
])
def test_what_each_engine_loads_passes(kind, model):
    assert model_id_problem(kind, model, "model.target", KNOWN) is None


@pytest.mark.parametrize("kind, model", [("cpu", "Qwen/Qwen2.5-7B-Instruct"), ("llama_cpp", "gemma3-270"),
                                         ("sglang", "smollm2-136m")])
def test_what_the_engine_cannot_load_is_refused(kind, model):
    assert model_id_problem(kind, model, "model.target", KNOWN)


def test_a_cluster_node_may_hold_a_path_this_machine_has_not_but_a_typo_is_still_one():
    assert model_id_problem("cpu", "models/qwen-local", "model.target", KNOWN, remote=True) is None
    assert model_id_problem("cpu", "smollm2-136m", "model.target", KNOWN, remote=True)


@pytest.mark.parametrize("model, setting, refused", [
    ("Qwen/Qwen2.5-7B-Instruct", "auto", True), ("Qwen/Qwen2.5-7B-Instruct", "cpu", True),
    ("deepseek-ai/DeepSeek-V3", "auto", True),  # a Hub id outside the table, size unknown
    ("deepseek-ai/DeepSeek-V3", "cpu", False),  # asked for on the CPU explicitly: its size is not known here
    ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "auto", False), ("smollm2-135m", "auto", False),
    ("/models/my-own-model", "auto", False),
])
def test_too_big_for_the_cpu(model, setting, refused):
    problem = cpu_capacity_problem(model, setting, "model.target (--model)", KNOWN)
    assert bool(problem) == refused
    if problem:
        assert "GPU" in problem and "smollm2-135m" in problem and model in problem


def test_missing_installs_name_their_install_command():
    llama = engine_install_problem("llama_cpp", "cpu", None)
    assert llama and "bash infra/install-llama-cpp.sh" in llama
    sglang_cpu = engine_install_problem("sglang", "cpu", None)
    assert sglang_cpu and "bash infra/install-sglang-cpu.sh" in sglang_cpu
    assert engine_install_problem("llama_cpp", "cpu", Path("/bin/true")) is None
    assert engine_install_problem("sglang", "cpu", Path("/usr/bin/python3")) is None
    assert engine_install_problem("sglang", "cuda", None) is None  # the GPU node's, not the dry run's
    assert engine_install_problem("cpu", "cpu", None) is None


def test_check_study_refuses_a_typo(tmp_path):
    study = load_study(None, {"output_dir": str(tmp_path / "out"), "model.target": "smollm2-136m"})
    with pytest.raises(PipelineError, match="did you mean 'smollm2-135m'"):
        check_study(study)
    assert not (tmp_path / "out").exists()


def test_device_auto_without_a_gpu_refuses_a_7b(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi: no GPU on this machine, as the engine decides it
    study = load_study(None, {"output_dir": str(tmp_path / "out"), "engine.kind": "sglang",
                              "model.target": "Qwen/Qwen2.5-7B-Instruct"})
    with pytest.raises(PipelineError, match="would run on this machine's CPU"):
        check_study(study)


def test_a_cluster_study_checks_ids_only(tmp_path):
    study = load_study(None, {"output_dir": str(tmp_path / "out"), "engine.kind": "llama_cpp",
                              "ray.address": "ray://head:10001"})
    assert engine_problems(study) == []  # llama-server is the nodes' to have, not this machine's
