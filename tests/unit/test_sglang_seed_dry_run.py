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
import yaml

from pipeline.tune import main
from serve.engines.sglang.engine import resolved_problem
from serve.engines.sglang.check import installed_version, run_preflight

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = 6


@pytest.mark.skipif(installed_version() is None, reason="sglang is not installed (bash infra/install-sglang-parser.sh)")
def test_the_seed_scenarios_dry_run_prints_argvs_sglang_accepts_with_one_backend(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the study names its model folder relative to the repository
    assert main(["--study", "examples/study-seed-mla.yaml", "--dry-run", "--samples", str(SAMPLES)]) == 0
    out = capsys.readouterr().out
    assert "# attention backend triton for the baseline and every trial (Blackwell RTX (sm120), MLA " \
           "DeepseekV2ForCausalLM, widest tree: NGRAM tree at topk 8" in out
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


BREADTH1_SAMPLES = 3


def breadth1_space(tmp_path: Path) -> Path:
    """The seed's ngram space with max_bfs_breadth fixed at 1 (min_bfs_breadth then 1 too)."""
    space = yaml.safe_load((ROOT / "search_spaces" / "ngram.yaml").read_text())
    branch = space["branches"]["ngram"]
    branch["max_bfs_breadth"] = {"type": "fixed", "value": 1}
    branch["min_bfs_breadth"] = {"type": "fixed", "value": 1, "when": {"match_type": ["BFS"]}}
    path = tmp_path / "ngram-breadth-1.yaml"
    path.write_text(yaml.safe_dump(space))
    return path


@pytest.mark.skipif(installed_version() is None, reason="sglang is not installed (bash infra/install-sglang-parser.sh)")
@pytest.mark.parametrize("arch, stock, why", [
    ("sm90", "fa3", "which applies the tree mask only at topk >= 2"),
    ("sm100", "flashinfer", "whose verify ignores the tree mask on MLA"),
])
def test_ngram_at_breadth_1_is_verified_with_its_mask(capsys, monkeypatch, tmp_path, arch, stock, why):
    # Issue 59: NGRAM at max_bfs_breadth 1 runs at topk 1 and still branches; SGLang's pick for the seed's MLA model
    # (fa3 on Hopper, FlashInferMLA on sm100) would verify it causally. The dry run pins triton and says why.
    monkeypatch.chdir(ROOT)
    assert main(["--study", "examples/study-seed-mla.yaml", "--search-space", str(breadth1_space(tmp_path)),
                 "--set", f"engine.gpu_arch={arch}", "--dry-run", "--samples", str(BREADTH1_SAMPLES)]) == 0
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("# attention backend ") and "for the baseline" in x]
    assert line.startswith("# attention backend triton for the baseline and every trial")
    assert f"SGLang 0.5.23 picks {stock} for it, {why}" in line and "NGRAM tree at topk 1" in line
    lines = out.splitlines()
    argvs = [shlex.split(x.split(maxsplit=1)[1]) for x in lines if x.startswith("  #") and " serve --model-path " in x]
    assert len(argvs) == BREADTH1_SAMPLES and "INVALID" not in out
    ngram = [a for a in argvs if "--speculative-algorithm" in a]
    assert ngram and all(a[a.index("--speculative-ngram-max-bfs-breadth") + 1] == "1" for a in ngram)
    # SGLang's own resolution of each printed line, asked again, and of each NGRAM line without --attention-backend
    stock_argvs = [a[:a.index("--attention-backend")] + a[a.index("--attention-backend") + 2:] for a in ngram]
    results = run_preflight(argvs + stock_argvs, gpu_arch=arch)
    assert results is not None
    for argv, result in zip(argvs, results):
        assert result.ok, (argv, result.error)
        assert result.resolved["attention_backend"] == "triton" and result.resolved["use_mla_backend"] is True
        if "--speculative-algorithm" in argv:
            assert result.resolved["speculative_eagle_topk"] == 1
            assert resolved_problem(result.resolved) is None
    for own in results[len(argvs):]:  # SGLang's pick would verify the same branching draft without its mask
        assert own.ok and own.resolved["attention_backend"] == stock and own.resolved["speculative_eagle_topk"] == 1
        assert "branches at every max_bfs_breadth" in (resolved_problem(own.resolved) or "")
