"""Issue 40 item 2: the `deterministic` equivalence mode fails closed. On DeepSeek-family MLA models SGLang refuses
deterministic inference unless the backend is fa3/fa4/triton (`attention_hook.py` ~641-647): the baseline's
deterministic pass is then refused, every search trial ends COMPLETE "not compared", and the finalists used to be
marked equivalent by assumption ("checked in the search"). Now a finalist is equivalent only where the baseline has
its deterministic pass; and a study whose backend SGLang would refuse so is refused before it starts.

The finalists' judgement runs for real against MLflow on SQLite (the baseline trial's run, with or without its
deterministic pass); SGLang's own refusal is checked with its resolution (serve/engines/sglang/preflight.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.errors import PipelineError
from pipeline.measure.measurement import Measurement
from pipeline.measure.summary import RequestRecord, records_json
from pipeline.records.tracking import Tracker
from pipeline.search.space import load_space
from pipeline.study.backend import decide_backend
from pipeline.study.finalists import Pass, judge_level
from pipeline.trial.gate import DETERMINISTIC_ARTIFACT, effective_mode
from pipeline.trial.lifecycle import Checked
from pipeline.vocabulary.outcome import Outcome
from serve.engines.sglang.engine import sglang_argv
from serve.engines.sglang.check import installed_version, run_preflight
from serve.spec import NgramSpec

ROOT = Path(__file__).resolve().parents[2]
MLA = ROOT / "examples" / "models" / "deepseek-v2-236b"


def record(i: int, tokens: tuple[int, ...]) -> RequestRecord:
    return RequestRecord(request_id=f"r{i}", phase="measure", prompt_index=i, concurrency=1, start_s=0.0, ttft_s=0.1,
                         e2e_s=0.5, prompt_tokens=3, completion_tokens=len(tokens), finish_reason="length",
                         output_ids=tokens)


OUTPUTS = [record(i, (i, i + 1, i + 2)) for i in range(4)]


def study_on_gpu(**extra):
    return load_study(None, {"engine.kind": "sglang", "engine.device": "cuda", "model.target": str(MLA),
                             "model.dtype": "auto", "promotion.equivalence": "deterministic",
                             "workload.measure_prompts": 4, **extra})


def context(tmp_path: Path, with_pass: bool):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "s", artifact_dir=tmp_path / "artifacts")
    parent = tracker.start_study("s", "name: s\n", resume=False)
    texts = {DETERMINISTIC_ARTIFACT: records_json(OUTPUTS)} if with_pass else {}
    tracker.log_trial(parent, study_name="s", run_name="baseline", kind="trial", config={"spec": {"algorithm": "none"}},
                      outcome=Outcome.COMPLETE, reason="" if with_pass else "its equivalence pass failed", metrics={},
                      requests=None, texts=texts)
    return SimpleNamespace(study=study_on_gpu(), tracker=tracker, parent_run_id=parent)


def passes(config: TrialConfig) -> list[Pass]:
    checked = Checked(Measurement(records=list(OUTPUTS)), Outcome.COMPLETE, "")
    return [Pass("run0", 1, config, checked, 0.0)]


@pytest.mark.parametrize("with_pass", [True, False])
def test_a_finalist_is_equivalent_only_where_the_baseline_had_its_deterministic_pass(tmp_path, with_pass):
    ctx = context(tmp_path, with_pass)
    assert effective_mode(ctx.study) == "deterministic"
    finalist = TrialConfig(spec=NgramSpec(num_draft_tokens=4, max_bfs_breadth=1))
    ((passed, reason, _),) = judge_level(ctx, finalist, passes(finalist), passes(TrialConfig()))
    if with_pass:
        assert passed is True and "checked in the search" in reason
    else:  # the search compared nothing: no promotion
        assert passed is False and "no deterministic-inference pass" in reason


def test_a_deterministic_study_whose_backend_sglang_refuses_is_refused_before_it_starts():
    space = load_space(ROOT / "search_spaces" / "ngram.yaml")
    # sm100, DeepSeek-V2 layout, no tree wider than 1 would keep SGLang's flashinfer: refused for deterministic.
    with pytest.raises(PipelineError, match="deterministic.*flashinfer.*triton"):
        decide_backend(study_on_gpu(**{"engine.gpu_arch": "sm100", "engine.attention_backend": "flashinfer"}), space)
    # The backend the study picks on sm120 (triton) runs deterministically: the study goes on.
    decided = decide_backend(study_on_gpu(**{"engine.gpu_arch": "sm120"}), space)
    assert decided.study.engine.attention_backend == "triton"


@pytest.mark.skipif(installed_version() is None, reason="sglang is not installed")
def test_sglang_itself_refuses_the_deterministic_pass_the_study_refuses(tmp_path):
    model = tmp_path / "mla"
    model.mkdir()
    shutil.copy(MLA / "config.json", model / "config.json")
    study = load_study(None, {"engine.kind": "sglang", "engine.device": "cuda", "model.target": str(model),
                              "model.dtype": "auto"})
    from pipeline.trial.replica_config import replica_config

    argvs = []
    for backend in ("flashinfer", "triton"):
        engine = study.engine.model_copy(update={"attention_backend": backend,
                                                 "extra_flags": ["--enable-deterministic-inference"]})
        config = replica_config(study.model_copy(update={"engine": engine}), TrialConfig(), tmp_path)
        argvs.append(sglang_argv(config, "127.0.0.1", 30000))
    refused, accepted = run_preflight(argvs, gpu_arch="sm100") or []
    assert not refused.ok and "absorbed-MLA" in (refused.error or ""), refused
    assert accepted.ok, accepted.error
    assert json.dumps(accepted.resolved.get("enable_deterministic_inference")) == "true"
