"""Issue #60, points 1 and 2, as a user types them: `python -m pipeline.tune ... --dry-run` in a fresh process shows
an SGLang GPU study's engine defaults, and exits non-zero, naming the fix, for a study that cannot run (a space the
engine does not implement, a typo of a model id, a 7B model on this CPU); it shows the workload's notes and the
launches and time of the strategy that will run."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

from tests.cli_run import REPO, clean_env

# A Qwen2.5-7B-Instruct's config.json: SGLang's own checks of the command lines read it, with no Hub to ask
QWEN_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
    "vocab_size": 152064, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
}


def dry_run(tmp_path: Path, *args: str, path: str | None = None,
            env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = clean_env(tmp_path / "home")
    env["HF_HUB_OFFLINE"] = "1"  # nothing here may wait on the Hub
    env.update(env_extra or {})
    if path is not None:
        env["PATH"] = path
    return subprocess.run([sys.executable, "-m", "pipeline.tune", "--dry-run", "--output", str(tmp_path / "out"),
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def test_llama_cpp_with_the_default_space_exits_non_zero_naming_its_space(tmp_path):
    result = dry_run(tmp_path, "--engine", "llama_cpp")
    assert result.returncode == 2, result.stderr
    assert "--search-space search_spaces/llama-cpp-ngram.yaml" in result.stderr
    assert "engine launches for tpe" in result.stdout and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_sglang_on_this_cpu_without_its_venv_names_the_install_command(tmp_path):
    result = dry_run(tmp_path, "--engine", "sglang", "--set", "engine.device=cpu", "--samples", "2",
                     env_extra={"SPECDEC_SGLANG_CPU_VENV": str(tmp_path / "no-venv")})
    assert result.returncode == 2
    assert "bash infra/install-sglang-cpu.sh" in result.stderr and "# resolved study" in result.stdout


def test_a_typo_of_the_model_id_exits_non_zero_naming_the_close_match(tmp_path):
    result = dry_run(tmp_path, "--model", "smollm2-136m")
    assert result.returncode == 2
    assert "did you mean 'smollm2-135m'" in result.stderr and "gemma3-270m" in result.stderr


def test_the_default_study_shows_simulate_first_launches_and_an_estimate(tmp_path):
    result = dry_run(tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "# engine launches for simulate-first: 8" in out
    assert "if the search ran these configs" not in out  # the fallback's plan is not the one that runs
    assert "# time, an estimate: 2 min to 4 min" in out and "docs/benchmarks.md" in out


def test_a_two_prompt_workload_shows_the_loaders_warning(tmp_path):
    prompts = tmp_path / "two.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Write a function number {i}."}) + "\n" for i in range(2)))
    result = dry_run(tmp_path, "--workload", str(prompts))
    assert result.returncode == 0, result.stderr
    assert "# WARNING workload:" in result.stdout and "flatters n-gram" in result.stdout


def test_a_7b_hub_model_with_device_auto_and_no_gpu_stops(tmp_path):
    no_gpu = str(Path(sys.executable).parent)  # a PATH without nvidia-smi: no GPU, as the engine decides it
    result = dry_run(tmp_path, "--engine", "sglang", "--model", "Qwen/Qwen2.5-7B-Instruct", path=no_gpu)
    assert result.returncode == 2
    assert "would run on this machine's CPU" in result.stderr and "engine.device: cuda" in result.stderr


def test_sglang_on_cuda_gets_the_gpu_defaults_and_says_which(tmp_path):
    model = tmp_path / "Qwen2.5-7B-Instruct"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN_7B_CONFIG))
    result = dry_run(tmp_path, "--engine", "sglang", "--model", str(model), "--set", "engine.device=cuda",
                     "--samples", "1")
    out = result.stdout
    assert "# defaults from the engine (sglang on a GPU)" in out
    for line in ("#   model.dtype: auto", "#   promotion.equivalence: baseline-noise", "#   concurrency: [8, 1]",
                 "#   workload.measure_prompts: 64", "#   workload.max_new_tokens: 256"):
        assert line in out, out
    assert "dtype: float32" not in out and "equivalence: exact" not in out
    assert "# engine launches for simulate-first: 9" in out and "time: not estimated" in out
    assert result.returncode == 0, result.stderr
    if importlib.util.find_spec("sglang") is not None:
        assert "--dtype auto" in out  # the command line SGLang's own parser checked
