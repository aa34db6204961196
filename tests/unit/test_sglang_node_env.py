"""Issue 40 items 6 and 7: what the replica checks on its node before SGLang starts.

6: the compilers SGLang will call are looked up, and nvcc's version read, in the engine's own environment
(`Engine.start_env`: the study's `engine.env` sets CUDA_HOME, CXX, PATH), not the replica's; 0.5.23's torch is a
CUDA 13 build, so an older nvcc is named. The nvcc here is a real executable (a script printing a release banner),
run by the real probe.
7: a draft model whose heads do not split over tp_size (SGLang 0.5.23 runs the draft at the target's tp and asserts
after the target has loaded) is INVALID with the reason, read from its config.json before anything starts.
"""

from __future__ import annotations

import functools
import json
import stat
from pathlib import Path

import pytest

import serve.engines.sglang.engine as sglang
from serve.engines.base import ConfigRejected, ReplicaConfig
from serve.engines.sglang.node import compiler_problems, draft_tp_problem, node_problems, nvcc_version
from serve.spec import Eagle3Spec, NgramSpec, StandaloneSpec

# Qwen2.5-0.5B-Instruct's config.json head counts (the draft the issue names): 14 query heads, 2 KV heads.
QWEN_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
            "num_attention_heads": 14, "num_key_value_heads": 2, "num_hidden_layers": 24, "vocab_size": 151936}


def fake_nvcc(folder: Path, release: str) -> Path:
    """A CUDA toolkit folder whose bin/nvcc prints `release`'s banner, as `nvcc --version` does."""
    nvcc = folder / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.0'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    return nvcc


def test_nvcc_version_is_read_from_its_banner():
    assert nvcc_version("Cuda compilation tools, release 13.0, V13.0.88") == (13, 0)
    assert nvcc_version("Cuda compilation tools, release 12.8, V12.8.93") == (12, 8)
    assert nvcc_version("no banner") is None


def test_the_engines_environment_names_the_compilers_and_an_old_nvcc_is_a_problem(tmp_path):
    config = ReplicaConfig(engine="sglang", model="/m", device="cuda", spec=NgramSpec())
    old, new = fake_nvcc(tmp_path / "cuda-12.4", "12.4"), fake_nvcc(tmp_path / "cuda-13.0", "13.0")
    cxx = {"CXX": "/bin/sh"}  # a host compiler that exists
    (problem,) = compiler_problems(config, "cuda", {"CUDA_HOME": str(old.parents[1]), **cxx})
    assert str(old) in problem and "CUDA 12.4" in problem and "13.0 or newer" in problem
    assert compiler_problems(config, "cuda", {"CUDA_HOME": str(new.parents[1]), **cxx}) == []
    # nvcc found on the engine's PATH (no CUDA_HOME), not the replica's
    assert compiler_problems(config, "cuda", {"PATH": str(new.parent), **cxx}) == []


def test_prepare_checks_the_compilers_of_the_engines_environment_not_the_replicas(tmp_path, monkeypatch):
    # The replica's own environment has no CUDA_HOME; the study's engine.env points at a CUDA 12 toolkit: the check
    # must name that one (it used to look at the replica's os.environ and pass or fail on the wrong toolkit).
    old = fake_nvcc(tmp_path / "cuda-12.4", "12.4")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(sglang, "run_preflight", lambda *a, **k: None)
    monkeypatch.setattr(sglang, "node_gpu_arch", lambda: "sm90")
    monkeypatch.setattr(sglang, "ray_gpu_ids", lambda: None)
    # nvidia-smi cannot run here: its answers are given, everything else is the real check
    smi = lambda *a: "GPU 0: H200\n" if a == ("-L",) else "CUDA Version: 13.0"  # noqa: E731
    monkeypatch.setattr(sglang, "node_problems", functools.partial(node_problems, smi=smi))
    monkeypatch.setattr("serve.engines.sglang.node.shutil.which",
                        lambda name, path=None: "/usr/bin/nvidia-smi" if name == "nvidia-smi" else None)
    config = ReplicaConfig(engine="sglang", model=str(tmp_path), device="cuda",
                           env={"CUDA_HOME": str(old.parents[1]), "CXX": "/bin/sh"})
    with pytest.raises(RuntimeError) as info:
        sglang.SglangEngine().prepare(config, ["--model-path", str(tmp_path)])
    assert str(old) in str(info.value) and "CUDA 12.4" in str(info.value)


def test_draft_heads_that_do_not_split_over_tp_are_named():
    problem = draft_tp_problem(QWEN_05B, 8, "the draft model /models/qwen0.5b")
    assert problem is not None and "14 attention heads" in problem and "tp_size=8" in problem
    assert draft_tp_problem(QWEN_05B, 2) is None  # 14 % 2 == 0 and 2 KV heads split over 2
    assert draft_tp_problem(QWEN_05B, 1) is None
    assert draft_tp_problem({"num_attention_heads": 32, "num_key_value_heads": 8}, 8) is None
    assert draft_tp_problem({"num_attention_heads": 32, "num_key_value_heads": 3}, 8) is not None  # 8 % 3 != 0
    assert draft_tp_problem({}, 8) is None  # nothing said: SGLang decides


@pytest.mark.parametrize("spec_type", [Eagle3Spec, StandaloneSpec])
def test_a_draft_that_cannot_run_at_the_targets_tp_is_refused_before_anything_starts(tmp_path, monkeypatch, spec_type):
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(QWEN_05B))
    monkeypatch.setattr(sglang, "run_preflight", lambda *a, **k: pytest.fail("refused before SGLang is asked"))
    monkeypatch.setattr(sglang, "node_gpu_arch", lambda: "sm120")
    spec = spec_type(draft_model=str(draft), num_steps=3, topk=1, num_draft_tokens=4)
    config = ReplicaConfig(engine="sglang", model=str(tmp_path), device="cuda", tp_size=8, spec=spec,
                           attention_backend="triton")
    with pytest.raises(ConfigRejected) as info:
        sglang.SglangEngine().prepare(config, ["--model-path", str(tmp_path), "--attention-backend", "triton"])
    assert "14 attention heads" in info.value.reason and "no draft-tp setting" in info.value.reason
    assert info.value.reason in str(info.value) and ConfigRejected.MARKER in str(info.value)  # -> INVALID
