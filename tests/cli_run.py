"""`python -m pipeline.tune` as a user runs it from a shell: a subprocess with a clean environment (only PATH, the
locale, a new HOME without ~/.ray, and the model and engine caches), to its decision. Library-level studies miss what
the command line's process sets up itself (its Ray auth mode, its library settings); these do not. Used by the
end-to-end tier (the CPU engine: tests/end_to_end/test_study_resume.py's interrupted and resumed study) and the
engines tier (the SGLang-on-CPU and llama-server studies: tests/engines/test_sglang_study.py,
test_llama_cpp_study.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from serve.model_store import cache_root
from serve.engines.llama_cpp.models import install_root

REPO = Path(__file__).resolve().parents[1]
# small and fast: two measured prompts of 8 tokens, no re-runs, every trial a launch
QUICK = ["--trials", "2", "--set", "workload.warmup_prompts=1", "--set", "workload.measure_prompts=2",
         "--set", "workload.max_new_tokens=8", "--set", "promotion.finalists=0", "--set", "search.strategy=tpe",
         "--set", "engine.threads=1",
         "--set", "workload.remeasure=0"]


def clean_env(home: Path) -> dict[str, str]:
    """A new HOME, with the machine's caches of what is built once per machine: the models, llama-server, and
    SGLang's caches, its JIT-compiled kernels among them (its NGRAM worker compiles one, 10 s alone and more beside
    another test, into `$SGLANG_JIT_CACHE_DIR`, else ~/.cache/sglang/jit under HOME: SGLang 0.5.23 does not derive
    it from `$SGLANG_CACHE_DIR`)."""
    home.mkdir(parents=True, exist_ok=True)
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": str(home),
            "SPECDEC_CACHE": str(cache_root()), "SPECDEC_LLAMA_CPP_HOME": str(install_root()),
            "SGLANG_CACHE_DIR": os.environ.get("SGLANG_CACHE_DIR") or os.path.expanduser("~/.cache/sglang"),
            "SGLANG_JIT_CACHE_DIR": os.environ.get("SGLANG_JIT_CACHE_DIR") or os.path.expanduser("~/.cache/sglang/jit"),
            "PYTHONUNBUFFERED": "1"}


def tune(engine: str, tmp_path: Path, *extra: str, timeout_s: float = 1200) -> subprocess.CompletedProcess[str]:
    """Run the study to its end; the caller checks its exit code and its lines."""
    args = [sys.executable, "-m", "pipeline.tune", "--engine", engine, "--name", f"cli-{engine.replace('_', '-')}",
            "--output", str(tmp_path / "out"), *QUICK, *extra]
    env = clean_env(tmp_path / "home")
    assert not Path(env["HOME"], ".ray").exists()
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)


def check_decided(result: subprocess.CompletedProcess[str], first_line: str = "[trial 1/2]") -> None:
    """Exit 0, the baseline's trial line (`first_line`; "" for a resumed run, which measured it before), a decision,
    and no sign of the Ray auth-mode mismatch."""
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    assert not first_line or (first_line in result.stdout and "(the baseline)" in result.stdout), out[-6000:]
    assert "decision: " in result.stdout, out[-6000:]
    assert "InvalidAuthToken" not in out and "Failed to start GCS" not in out, out[-6000:]
