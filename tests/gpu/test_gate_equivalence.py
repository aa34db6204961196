"""The equivalence modes on real bf16 batching: what only a GPU shows. Runs on a GPU node with SGLang installed:

    SPECDEC_GPU_MODEL=/models/Qwen2.5-0.5B-Instruct python -m pytest -q -s tests/gpu/test_gate_equivalence.py

Skipped elsewhere (no nvidia-smi, no sglang, or no model path). Each engine launch measures several passes (flush,
then the measurement split at a concurrency), the way the tuner shares launches. Checked here:
- the baseline against itself at concurrency 8 and across levels: the engine's own divergence, printed (-s) as the
  figures the study records (`baseline_self_*`), with the sign test's verdict on the baseline's third pass;
- `baseline-noise`: a lossless NGRAM config passes against the baseline's own noise at the same level;
- `deterministic`: with deterministic inference (`Engine.deterministic_flags`, SGLang's
  `--enable-deterministic-inference`) the baseline's outputs are the same at every level and the NGRAM config's
  equal them token for token.
`SPECDEC_GATE_ENGINE=cpu SPECDEC_GPU_MODEL=smollm2-135m` runs the same checks on the CPU engine (no GPU needed): a
check of this file, not of a GPU.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

import pytest

from pipeline.decide.equivalence import judge
from pipeline.decide.noise import run_outputs, self_divergence
from pipeline.measure.load import requests_of, run_phase
from pipeline.measure.summary import RequestRecord
from pipeline.trial.engine_pass import flush
from pipeline.workloads import load_workload
from serve.engines import engine_for
from serve.engines.base import ReplicaConfig
from serve.engines.sglang.engine import installed_version
from serve.replica.deployment import EngineProcess
from serve.spec import NgramSpec, NoSpec

ENGINE = os.environ.get("SPECDEC_GATE_ENGINE", "sglang")
MODEL = os.environ.get("SPECDEC_GPU_MODEL")
PROMPTS, NEW_TOKENS = 32, 128
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ENGINE == "sglang" and shutil.which("nvidia-smi") is None, reason="no GPU (nvidia-smi)"),
    pytest.mark.skipif(ENGINE == "sglang" and installed_version() is None, reason="sglang is not installed"),
    pytest.mark.skipif(not MODEL, reason="set SPECDEC_GPU_MODEL to a local model directory"),
]
LOSSLESS = NgramSpec(num_draft_tokens=8, max_bfs_breadth=4)


@pytest.fixture(scope="module")
def requests():
    workload = load_workload("code-edit", seed=0, n_warmup=0, n_measure=PROMPTS, max_new_tokens=NEW_TOKENS)
    return requests_of(workload.measure, MODEL or "")


def passes(tmp_path, spec, levels: Sequence[int], requests, flags: Sequence[str] = ()) -> list[list[RequestRecord]]:
    """One engine launch measuring the split once per entry of `levels` (flush before each)."""
    import httpx

    config = ReplicaConfig(engine=ENGINE, model=MODEL or "", spec=spec, start_timeout_s=1800,
                           extra_flags=list(flags), log_dir=str(tmp_path))
    process = EngineProcess(config)
    out = []
    try:
        process.wait_ready()
        for level in levels:
            with httpx.Client(base_url=process.url, timeout=60) as client:
                assert flush(client) is None
            out.append(run_phase(process.url, list(requests), phase="measure", concurrency=level, temperature=0.0,
                                 timeout_s=600))
    finally:
        process.stop()
    return out


def deterministic_flags() -> list[str]:
    config = ReplicaConfig(engine=ENGINE, model=MODEL or "")
    flags = engine_for(ENGINE).deterministic_flags(config)
    # SGLang's flag, until its Engine says it (the hook is `Engine.deterministic_flags`)
    return list(flags) if flags is not None else ["--enable-deterministic-inference"]


def test_baseline_noise_accepts_a_lossless_config_at_the_same_level(tmp_path, requests):
    base = passes(tmp_path / "base", NoSpec(), [8, 8, 8, 1], requests)
    figures = self_divergence(8, [run_outputs(r) for r in base[:3]])
    across = self_divergence(0, [run_outputs(base[0]), run_outputs(base[3])])
    print(f"\nbaseline vs itself at c=8: {figures.model_dump_json()}\nbaseline c=8 vs c=1: {across.model_dump_json()}")
    own = judge("baseline-noise", base[0], [base[2]], baseline_others=[base[1]])
    assert own.passed, own.reason  # the baseline's third pass is just more of its noise
    ngram = passes(tmp_path / "ngram", LOSSLESS, [8], requests)
    verdict = judge("baseline-noise", base[0], ngram, baseline_others=[base[1]])
    print(f"NGRAM vs the baseline at c=8: {verdict.reason}")
    assert verdict.passed, verdict.reason


def test_deterministic_inference_makes_outputs_level_and_speculation_independent(tmp_path, requests):
    flags = deterministic_flags()
    base = passes(tmp_path / "base", NoSpec(), [8, 1], requests, flags)
    levels = judge("exact", base[0], [base[1]])
    assert levels.passed, f"deterministic baseline, c=8 vs c=1: {levels.reason}"
    ngram = passes(tmp_path / "ngram", LOSSLESS, [8], requests, flags)
    verdict = judge("deterministic", base[0], ngram)
    assert verdict.passed, f"deterministic NGRAM vs baseline at c=8: {verdict.reason}"
