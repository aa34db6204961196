"""Issue #60, point 1: a study for SGLang on a GPU gets GPU values for every key the user leaves unset (the model's own
dtype, an equivalence mode that holds under bf16, a serving node's workload and levels), and says which."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.config import StudyConfig, resolve_study
from pipeline.config.engine_defaults import GPU_DEFAULTS, apply_engine_defaults
from pipeline.errors import ConfigError
from pipeline.workloads import load_workload

SGLANG_CUDA = {"engine.kind": "sglang", "engine.device": "cuda", "model.target": "Qwen/Qwen2.5-7B-Instruct"}


def no_gpu() -> bool:
    return False


def gpu() -> bool:
    return True


def never_asked() -> bool:
    raise AssertionError("the GPU question is asked only for engine.device: auto on sglang")


def test_sglang_on_cuda_gets_every_gpu_default_and_names_them():
    study, applied = resolve_study(None, SGLANG_CUDA, has_gpu=never_asked)
    assert [d.key for d in applied] == [d.key for d in GPU_DEFAULTS]
    assert study.model.dtype == "auto"
    assert study.promotion.equivalence == "baseline-noise"
    assert study.concurrency == [8, 1]
    assert (study.workload.source, study.workload.warmup_prompts, study.workload.measure_prompts,
            study.workload.max_new_tokens) == ("code-edit", 16, 64, 256)
    cpu_demo = StudyConfig()  # what the issue saw: the CPU demo's values
    assert (cpu_demo.model.dtype, cpu_demo.promotion.equivalence, cpu_demo.concurrency) == ("float32", "exact", [1])


def test_the_gpu_workload_does_not_cycle_its_prompts():
    study, _ = resolve_study(None, SGLANG_CUDA, has_gpu=never_asked)
    w = study.workload
    loaded = load_workload(w.source, seed=0, n_warmup=w.warmup_prompts, n_measure=w.measure_prompts,
                           max_new_tokens=w.max_new_tokens)
    assert not loaded.cycled and not loaded.notes


def test_keys_the_user_set_are_kept_and_not_named():
    study, applied = resolve_study(None, {**SGLANG_CUDA, "model.dtype": "bfloat16", "promotion.equivalence":
                                          "deterministic", "concurrency": [4]}, has_gpu=never_asked)
    keys = {d.key for d in applied}
    assert not keys & {"model.dtype", "promotion.equivalence", "concurrency"}
    assert (study.model.dtype, study.promotion.equivalence, study.concurrency) == ("bfloat16", "deterministic", [4])
    assert study.workload.measure_prompts == 64  # the unset ones still come from the engine


def test_a_study_file_counts_as_set(tmp_path: Path):
    path = tmp_path / "study.yaml"
    path.write_text("engine: {kind: sglang, device: cuda}\nworkload: {measure_prompts: 32}\n")
    study, applied = resolve_study(path, None, has_gpu=never_asked)
    assert study.workload.measure_prompts == 32 and "workload.measure_prompts" not in {d.key for d in applied}


@pytest.mark.parametrize("has_gpu, expected", [(gpu, "auto"), (no_gpu, "float32")], ids=["gpu-here", "no-gpu"])
def test_device_auto_follows_the_gpu(has_gpu, expected):
    study, applied = resolve_study(None, {"engine.kind": "sglang"}, has_gpu=has_gpu)
    assert study.model.dtype == expected and bool(applied) == (expected == "auto")


@pytest.mark.parametrize("overrides", [{}, {"engine.kind": "llama_cpp"}, {"engine.kind": "sglang",
                                                                         "engine.device": "cpu"}])
def test_other_engines_and_sglang_on_cpu_keep_the_cpu_defaults(overrides):
    study, applied = resolve_study(None, overrides, has_gpu=never_asked)
    assert applied == () and study.model.dtype == "float32" and study.concurrency == [1]


def test_open_loop_gets_one_level():
    study, applied = resolve_study(None, {**SGLANG_CUDA, "workload.arrival": {"mode": "poisson", "rate_per_s": 2,
                                                                              "max_duration_s": 30}},
                                   has_gpu=never_asked)
    assert study.concurrency == [8] and "open-loop" in next(d.why for d in applied if d.key == "concurrency")


def test_a_section_that_is_not_a_mapping_is_still_refused_by_name():
    with pytest.raises(ConfigError, match="workload"):
        resolve_study(None, {**SGLANG_CUDA, "workload": "big"}, has_gpu=never_asked)


def test_the_merged_data_is_not_changed():
    data = {"engine": {"kind": "sglang", "device": "cuda"}}
    merged, _ = apply_engine_defaults(data, never_asked)
    assert data == {"engine": {"kind": "sglang", "device": "cuda"}} and merged["concurrency"] == [8, 1]
