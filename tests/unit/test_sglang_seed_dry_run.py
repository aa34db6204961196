"""Issue 40 acceptance: `python -m pipeline.tune --dry-run` on the seed scenario's study file (examples/study-seed-mla
.yaml: a 236B-class MLA model in DeepSeek-V2 layout, tp 8, the ngram space, an sm120 node) prints, for each sampled
trial, an SGLang command line that SGLang 0.5.23's own parser, `resolve_once()` and `check_server_args()` accept
(resolved as an sm120 GPU would, the device faked with SGLang's `override_platform`), with one attention backend for
the baseline and every trial. Each printed command line is then given to SGLang again here, independently of the
dry run's own report."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from pipeline.tune import main
from serve.engines.sglang import resolved_problem
from serve.engines.sglang_check import installed_version, run_preflight

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = 6


@pytest.mark.skipif(installed_version() is None, reason="sglang is not installed (bash infra/install-sglang-parser.sh)")
def test_the_seed_scenarios_dry_run_prints_argvs_sglang_accepts_with_one_backend(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the study names its model folder relative to the repository
    assert main(["--study", "examples/study-seed-mla.yaml", "--dry-run", "--samples", str(SAMPLES)]) == 0
    out = capsys.readouterr().out
    assert "# attention backend triton for the baseline and every trial (Blackwell RTX (sm120), MLA " \
           "DeepseekV2ForCausalLM, widest tree: NGRAM tree width 8" in out
    lines = out.splitlines()
    argvs = [shlex.split(line.split(maxsplit=1)[1]) for line in lines
             if line.startswith("  #") and " serve --model-path " in line]
    assert len(argvs) == SAMPLES  # every sampled config is valid in this space: each has its command line
    verdicts = [line.strip() for line in lines if line.startswith("         ")]
    assert len(verdicts) == SAMPLES and all(v.startswith("SGLang accepts it: attention_backend=triton") for v in verdicts)
    assert "# attention backend SGLang resolved: triton (the same for every engine)" in out
    assert sum("--speculative-algorithm" not in a for a in argvs) == 1  # trial 0, the baseline
    for argv in argvs:
        assert argv[argv.index("--attention-backend") + 1] == "triton"
        assert argv[argv.index("--tp-size") + 1] == "8"
    results = run_preflight(argvs, gpu_arch="sm120")
    assert results is not None
    for argv, result in zip(argvs, results):
        assert result.ok, (argv, result.error)
        assert result.resolved["attention_backend"] == "triton" and result.resolved["use_mla_backend"] is True
        assert result.resolved["tp_size"] == 8
        assert resolved_problem(result.resolved) is None  # its tree is verified with the mask
