"""The SGLang command line the adapter renders, for a GPU and for a CPU (issue 27 defects 2.2, 2.5, 2.6, 2.7 and the
CPU launch). Pure rendering: the real SGLang reads these back in tests/engines/test_sglang_contract_cpu.py and
test_sglang_study.py."""

from pathlib import Path

import pytest

from pipeline.config import load_study
from pipeline.errors import ConfigError
from pipeline.trial.replica_config import replica_config
from pipeline.config import TrialConfig
from serve.engines import engine_for
from serve.engines.sglang import cpu as sglang_cpu
from serve.engines.base import ReplicaConfig
from serve.engines.spec_flags import effective_diff, effective_settings
from serve.engines.sglang.engine import SglangEngine, describe_device, resolve_device, sglang_args, sglang_argv
from serve.engines.sglang.cpu.launch import CPU_MAX_TOTAL_TOKENS
from serve.spec import EagleSpec, NgramSpec

GPU = dict(engine="sglang", model="/m", device="cuda")
TREE_SPECS = [NgramSpec(num_draft_tokens=8, max_bfs_breadth=4),
              EagleSpec(draft_model="/d", num_steps=3, topk=4, num_draft_tokens=8)]


def flag(argv, name):
    return argv[argv.index(name) + 1] if name in argv else None


def test_baseline_and_tree_trials_get_the_same_attention_backend_and_running_request_cap():
    # 2.2: SGLang would pick fa3 on Hopper for the baseline and flashinfer for topk > 1; 2.5: it caps speculative
    # algorithms at 48 and leaves the baseline's memory-derived limit. Both are rendered, the same for all.
    argvs = [sglang_args(ReplicaConfig(**GPU, spec=s), "h", 1) for s in [None, *TREE_SPECS] if s is not None]
    argvs.insert(0, sglang_args(ReplicaConfig(**GPU), "h", 1))
    assert {(flag(a, "--attention-backend"), flag(a, "--max-running-requests")) for a in argvs} == {("flashinfer", "48")}


def test_a_studys_attention_backend_and_cap_are_rendered_for_every_trial(tmp_path):
    study = load_study(None, {"engine.kind": "sglang", "engine.device": "cuda", "engine.attention_backend": "fa3",
                              "model.target": str(tmp_path)})
    for trial in (TrialConfig(), TrialConfig(spec=TREE_SPECS[0], max_running_requests=16)):
        argv = sglang_args(replica_config(study, trial, tmp_path), "h", 1)
        assert flag(argv, "--attention-backend") == "fa3"
        assert flag(argv, "--max-running-requests") == str(trial.max_running_requests or 48)


def test_the_studys_dtype_reaches_sglang():
    # 2.6: --dtype is engine-owned (refused in extra_flags) and used never to be rendered: SGLang ran --dtype auto.
    assert flag(sglang_args(ReplicaConfig(**GPU), "h", 1), "--dtype") == "float32"
    assert flag(sglang_args(ReplicaConfig(**GPU, dtype="bfloat16"), "h", 1), "--dtype") == "bfloat16"
    assert flag(sglang_args(ReplicaConfig(**GPU, dtype="auto"), "h", 1), "--dtype") == "auto"
    # On CPU SGLang's auto means float16, ~17x slower there than float32: auto renders float32.
    cpu = ReplicaConfig(engine="sglang", model="/m", device="cpu", dtype="auto")
    assert flag(sglang_args(cpu, "h", 1), "--dtype") == "float32"


def test_dtypes_the_cpu_engine_lacks_are_refused_naming_the_field():
    assert load_study(None, {"engine.kind": "sglang", "model.dtype": "auto"}).model.dtype == "auto"
    with pytest.raises(ConfigError, match="model.dtype='float16' is not a dtype of the cpu engine"):
        load_study(None, {"model.dtype": "float16"})
    with pytest.raises(ConfigError, match="engine.attention_backend='fa3' applies to engine.kind sglang only"):
        load_study(None, {"engine.attention_backend": "fa3"})
    with pytest.raises(ConfigError, match="--attention-backend"):
        load_study(None, {"engine.kind": "sglang", "engine.extra_flags": ["--attention-backend", "fa3"]})


def test_trial_engines_answer_health_checks_without_a_generation():
    # 2.7: Serve's health check every 5 s would otherwise add a 1-token prefill to a trial's measured batches.
    env = SglangEngine().start_env(ReplicaConfig(**GPU))
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
    assert "SPECDEC_SGLANG_CPU" not in env  # nothing of the CPU runtime on a GPU
    mine = SglangEngine().start_env(ReplicaConfig(**GPU, env={"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "true"}))
    assert mine["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "true"  # the study's engine.env wins


def test_a_backend_or_cap_sglang_changed_is_a_diff():
    config = ReplicaConfig(**GPU, spec=TREE_SPECS[1])
    pinned = engine_for(config.engine).pinned_settings(config)
    assert pinned == {"attention_backend": "flashinfer", "max_running_requests": 48, "dtype": "float32"}
    reported = {"speculative_algorithm": "EAGLE", "attention_backend": "fa3", "max_running_requests": 48,
                "dtype": "float32"}
    assert effective_diff(config.spec, None, reported, pinned) == {"attention_backend": ("flashinfer", "fa3")}
    info = {**reported, "internal_states": [{"effective_max_running_requests_per_dp": 48}]}
    assert effective_settings(info)["effective_max_running_requests_per_dp"] == 48


def test_the_cpu_launch_runs_sglang_from_its_venv_with_the_cpu_flags(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    monkeypatch.setenv("SPECDEC_SGLANG_CPU_VENV", str(venv))
    config = ReplicaConfig(engine="sglang", model="/m", device="cpu", spec=NgramSpec(), threads=1)
    argv = sglang_argv(config, "h", 1)
    assert argv[:4] == [str(venv / "bin" / "python"), "-m", "serve.engines.sglang.cpu", "serve"]
    assert flag(argv, "--device") == "cpu" and flag(argv, "--attention-backend") == "torch_native"
    assert flag(argv, "--max-total-tokens") == str(CPU_MAX_TOTAL_TOKENS)
    assert flag(argv, "--speculative-ngram-capacity") == str(NgramSpec().capacity)  # the study's, never changed
    assert "--disable-overlap-schedule" in argv and "--sleep-on-idle" in argv
    # The study's own flags win over the CPU defaults (rendered once, theirs).
    theirs = config.model_copy(update={"extra_flags": ["--max-total-tokens", "2048"]})
    assert sglang_argv(theirs, "h", 1).count("--max-total-tokens") == 1
    env = SglangEngine().start_env(config)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["SPECDEC_SGLANG_CPU"] == "1" and env["OMP_NUM_THREADS"] == "1"
    assert str(sglang_cpu.SITE_DIR) in env["PYTHONPATH"].split(":")


def test_without_the_cpu_venv_the_start_fails_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_SGLANG_CPU_VENV", str(tmp_path / "none"))
    with pytest.raises(RuntimeError, match="bash infra/install-sglang-cpu.sh"):
        SglangEngine().argv(ReplicaConfig(engine="sglang", model="/m", device="cpu"), "h", 1)


def test_device_auto_is_cuda_only_where_there_are_gpus():
    auto = ReplicaConfig(engine="sglang", model="/m")
    assert resolve_device(auto, has_gpus=lambda: True) == "cuda"
    assert resolve_device(auto, has_gpus=lambda: False) == "cpu"
    assert resolve_device(auto, has_gpus=lambda: None, which=lambda name: "/usr/bin/nvidia-smi") == "cuda"
    assert resolve_device(auto, has_gpus=lambda: None, which=lambda name: None) == "cpu"
    assert resolve_device(ReplicaConfig(engine="sglang", model="/m", device="cuda"), has_gpus=lambda: False) == "cuda"
    assert "engine.device: cuda" in describe_device(ReplicaConfig(**GPU))


def test_production_serves_with_the_cap_and_backend_the_trials_ran(tmp_path):
    # 2.5 carried into production: the served replica is the measured one, and the adapter renders its cap and
    # backend as it did for the trial (48 when the search set none).
    from serve.serving import Provenance, engine_argv, serving_config

    study = load_study(None, {"engine.kind": "sglang", "engine.device": "cuda", "model.target": str(tmp_path)})
    measured = replica_config(study, TrialConfig(spec=TREE_SPECS[0]), tmp_path)
    served = serving_config(measured, Provenance(study="s", decision="promote", source="final-0", workload="w",
                                                 workload_digest="0" * 16, medians={}))
    trial_argv, served_argv = sglang_args(measured, "h", 1), engine_argv(served)
    for name in ("--max-running-requests", "--attention-backend", "--dtype"):
        assert flag(served_argv, name) == flag(trial_argv, name)
    assert flag(served_argv, "--max-running-requests") == "48"


def test_sglang_reads_the_converted_model_through_links_without_the_cpu_engines_own_files(tmp_path, monkeypatch):
    from serve.model_store import SOURCE_MARKER, hf_dir_for
    from serve.engines.sglang.cpu.launch import model_folder

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    converted = hf_dir_for(str(gguf))  # as the model store leaves a conversion
    converted.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "gguf-blocks.safetensors", SOURCE_MARKER):
        (converted / name).write_text(name)
    folder = model_folder(str(gguf))
    assert sorted(p.name for p in Path(folder).iterdir() if not p.name.startswith(".")) == \
        ["config.json", "model.safetensors", "tokenizer.json"]  # a second *.safetensors would be read as weights
    assert (Path(folder) / "model.safetensors").resolve() == converted / "model.safetensors"
    assert model_folder(str(gguf)) == folder  # made once
    assert model_folder("/models/My-HF-Dir") == "/models/My-HF-Dir"


def test_the_deterministic_mode_is_sglangs_flag_on_a_gpu_and_refused_on_a_cpu():
    engine = SglangEngine()
    on_gpu = ReplicaConfig(engine="sglang", model="m", device="cuda")
    assert engine.deterministic_flags(on_gpu) == ["--enable-deterministic-inference"]
    assert engine.deterministic_flags(on_gpu.model_copy(update={"device": "cpu"})) is None
    study = {"engine.kind": "sglang", "engine.device": "cuda", "model.dtype": "auto",
             "promotion.equivalence": "deterministic", "workload.measure_prompts": 16}
    assert load_study(None, study).promotion.equivalence == "deterministic"
    with pytest.raises(ConfigError, match="deterministic"):
        load_study(None, {**study, "engine.device": "cpu", "model.dtype": "float32"})


def test_another_venv_of_the_same_base_python_is_read_for_its_own_sglang(tmp_path: Path) -> None:
    # A venv's bin/python is a symlink to the base interpreter, as this venv's is: resolving both gave one binary,
    # so the SGLang CPU venv's 0.5.23 was read from this venv (where a fresh install has none) and the replica refused.
    import os
    import sys

    from serve.engines.sglang.engine import installed_version

    venv = tmp_path / "side-venv"
    (venv / "bin").mkdir(parents=True)
    os.symlink(os.path.realpath(sys.executable), venv / "bin" / "python")
    (venv / "lib" / "python3.11" / "site-packages" / "sglang-9.9.9.dist-info").mkdir(parents=True)
    assert installed_version(str(venv / "bin" / "python")) == "9.9.9"
    assert installed_version(str(tmp_path / "empty" / "bin" / "python")) is None
