"""Issue #63 item 9: a prompt longer than the target's context is refused before any launch (the dry run and the
real run's start), naming its row and its token count."""

from __future__ import annotations

import json

import pytest

from pipeline.config import load_study
from pipeline.errors import PipelineError
from pipeline.tune import main
from pipeline.workloads.context import (
    SPECIAL_MARGIN, check_prompt_context, context_flag, context_problem, model_context, surely_fits,
)
from serve.model_store import resolve_model

TARGET = "smollm2-135m"


def test_context_flag_and_model_context():
    assert context_flag(["--context-length", "512"]) == 512
    assert context_flag(["--threads", "2", "--context-length=256"]) == 256
    assert context_flag(["--context-length"]) is None and context_flag([]) is None
    assert model_context({"max_position_embeddings": 8192}) == 8192
    assert model_context({"text_config": {"max_position_embeddings": 32768}}) == 32768
    assert model_context({}) == 4096


def test_the_problem_counts_the_answer_too():
    assert context_problem("w", "m", 100, "its config.json", [("a", 1, 60, 40)]) is None
    line = context_problem("w", "m", 100, "its config.json", [("a", 1, 60, 40), ("b", 2, 90, 11)])
    assert line is not None and "\n" not in line
    assert line.startswith("workload 'w': prompt 'b' (row 2) has 90 tokens") and "needs 101" in line
    assert "100-token context of m (its config.json)" in line


def test_only_a_prompt_that_could_overflow_is_tokenized():
    assert surely_fits("x" * 10, 8, 10 + 8 + SPECIAL_MARGIN, chat=False)
    assert not surely_fits("x" * 11, 8, 10 + 8 + SPECIAL_MARGIN, chat=False)
    assert not surely_fits("é" * 5, 8, 10 + 8 + SPECIAL_MARGIN - 1, chat=False)  # bytes, not characters
    assert not surely_fits("x", 1, 10_000, chat=True)


@pytest.fixture(scope="module")
def model_here():
    resolve_model(TARGET)  # the smallest model's files, as the CPU engine fetches them


def workload(tmp_path, rows):
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_prompt_over_the_context_is_refused_naming_its_row(tmp_path, model_here):
    source = workload(tmp_path, [{"prompt": "short"}, {"id": "big", "prompt": "word " * 80}, {"prompt": "also short"}])
    study = load_study(None, {"workload.source": source, "workload.warmup_prompts": 1,
                              "workload.measure_prompts": 2, "engine.extra_flags": ["--context-length", "64"]})
    with pytest.raises(PipelineError) as caught:
        check_prompt_context(study)
    message = str(caught.value)
    assert "prompt 'big' (row 2) has 8" in message and "64-token context" in message
    assert "--context-length 64 in engine.extra_flags" in message
    roomy = study.model_copy(update={"engine": study.engine.model_copy(update={"extra_flags": []})})
    assert check_prompt_context(roomy) is None  # 8192 tokens in its config.json: it fits


def test_the_dry_run_refuses_it(tmp_path, model_here, capsys):
    source = workload(tmp_path, [{"prompt": "short"}, {"prompt": "word " * 9000}])
    code = main(["--dry-run", "--workload", source, "--set", "workload.warmup_prompts=1",
                 "--set", "workload.measure_prompts=1", "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "(row 2) has 9,001 tokens" in err and "8,192-token context of smollm2-135m" in err
    assert not (tmp_path / "out").exists()


def test_a_model_not_on_this_machine_is_not_checked(tmp_path):
    study = load_study(None, {"engine.kind": "sglang", "model.target": "org/not-here", "engine.device": "cuda"})
    assert "not checked here" in (check_prompt_context(study) or "")
    assert check_prompt_context(load_study(None, {"engine.kind": "llama_cpp"})) is None
