"""Issue 40 on a GPU: the attention backend a study decides on this node (`pipeline.study.backend.decide_backend`:
SGLang 0.5.23's pick for the widest tree on this architecture and attention type), read back from `/server_info`
for the baseline and for an NGRAM breadth-4 trial, and the trial's greedy outputs equal to the baseline's under that
backend (both with SGLang's deterministic inference, so only the tree verify can make them differ). Run all of it,
within 10 minutes on one GPU with a 0.5B model, with

    SPECDEC_GPU_MODEL=/models/Qwen2.5-0.5B-Instruct bash tests/gpu/check_gpu.sh

`SPECDEC_GPU_MLA_MODEL` (an MLA model that fits the GPU, e.g. DeepSeek-V2-Lite) adds the same checks on MLA, where
SGLang's own pick on sm100 (flashinfer) would verify the tree without its mask. Skipped without a GPU, SGLang or a
model path. The same decisions are checked on a CPU in tests/unit/test_sglang_backend_table.py with the device faked.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.decide.equivalence import judge
from pipeline.measure.load import requests_of, run_phase
from pipeline.search.space import SearchSpace
from pipeline.study.backend import decide_backend
from pipeline.trial.engine_pass import flush
from pipeline.trial.replica_config import replica_config
from pipeline.workloads import load_workload
from serve.engines.sglang.engine import installed_version
from serve.engines.sglang.backend import attention_kind, deterministic_problem
from serve.engines.sglang.node import local_model_config
from serve.replica.deployment import EngineProcess
from serve.spec import NgramSpec, NoSpec

MODELS = [m for m in (os.environ.get("SPECDEC_GPU_MODEL"), os.environ.get("SPECDEC_GPU_MLA_MODEL")) if m]
PROMPTS, NEW_TOKENS = 16, 64
TREE = NgramSpec(num_draft_tokens=8, max_bfs_breadth=4, min_bfs_breadth=2)
SPACE = SearchSpace.model_validate({"name": "tree", "algorithms": ["none", "ngram"], "branches": {"ngram": {
    "num_draft_tokens": {"type": "fixed", "value": 8}, "max_bfs_breadth": {"type": "fixed", "value": 4}}}})
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="no GPU (nvidia-smi not found)"),
    pytest.mark.skipif(installed_version() is None, reason="sglang is not installed"),
    pytest.mark.skipif(not MODELS, reason="set SPECDEC_GPU_MODEL to a local model directory"),
]


def measured(study, spec, tmp_path: Path, flags: list[str]) -> tuple[dict, list]:
    """One engine of the study's for `spec`: its /server_info and its greedy outputs at concurrency 1."""
    engine = study.engine.model_copy(update={"extra_flags": [*study.engine.extra_flags, *flags]})
    config = replica_config(study.model_copy(update={"engine": engine}), TrialConfig(spec=spec), tmp_path)
    workload = load_workload("code-edit", seed=0, n_warmup=0, n_measure=PROMPTS, max_new_tokens=NEW_TOKENS)
    process = EngineProcess(config)
    try:
        process.wait_ready()
        with httpx.Client(base_url=process.url, timeout=60) as client:
            info = client.get("/server_info").json()
            assert flush(client) is None
        records = run_phase(process.url, list(requests_of(workload.measure, study.model.target)), phase="measure",
                            concurrency=1, temperature=0.0, timeout_s=600)
    finally:
        process.stop()
    return info, records


@pytest.mark.parametrize("model", MODELS)
def test_the_decided_backend_runs_and_a_breadth_4_tree_keeps_the_baselines_greedy_outputs(model, tmp_path):
    study = load_study(None, {"engine.kind": "sglang", "engine.device": "cuda", "model.target": model,
                              "model.dtype": "auto", "engine.start_timeout_s": 600})
    decided = decide_backend(study, SPACE)  # this node's GPU and the model's config.json, as a study decides
    study, backend = decided.study, decided.study.engine.attention_backend
    print(f"\n{decided.line}")
    config = local_model_config(model) or {}
    assert backend is not None and decided.arch is not None
    refusal = deterministic_problem(backend, attention_kind(config), str((config.get("architectures") or [""])[0]))
    flags = [] if refusal else ["--enable-deterministic-inference"]
    base_info, base = measured(study, NoSpec(), tmp_path / "base", flags)
    tree_info, tree = measured(study, TREE, tmp_path / "tree", flags)
    # What SGLang runs with, read back: the study's backend for both, the tree 4 wide.
    assert base_info["attention_backend"] == tree_info["attention_backend"] == backend
    assert tree_info["speculative_eagle_topk"] == 4 and tree_info["speculative_algorithm"] == "NGRAM"
    assert all(r.error is None for r in base + tree)
    assert sum(r.spec_num_correct_drafts or 0 for r in tree) > 0, "the tree never accepted a draft: nothing verified"
    verdict = judge("exact", base, [tree])
    assert verdict.passed, f"NGRAM breadth 4 on {backend} vs the baseline (deterministic: {not refusal}): " \
                           f"{verdict.reason}"
