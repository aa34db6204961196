"""The draft replay against real SGLang 0.5.23 STANDALONE on this CPU, differentially: SmolLM2-135M drafting for
itself, greedy, one request at a time; each request's verify steps and tokens from SGLang's `meta_info` against the
replay of SGLang's own plain answers through the draft model (`serve.engines.cpu.draft_replay`).

SGLang 0.5.23 cannot run STANDALONE on a CPU through our adapter: the adapter starts it with `--attention-backend
torch_native` (the no-AMX CPU path; `intel_amx` also needs the CPU build of sgl-kernel, which is not on PyPI), and
the EAGLE-family draft worker that STANDALONE runs (`standalone_worker_v2.py` -> `eagle_worker_v2.py`
`init_attention_backend`) builds its draft attention from `speculative/draft_utils.py`
`DraftBackendFactory.create_decode_backend` / `create_draft_extend_backend`, whose backend tables have no
`torch_native` entry: the scheduler dies at start with "EAGLE is not supported in decode attention backend
torch_native". The test tries the launch and, when it fails that way, skips with the file and lines of the installed
wheel that say so; the day a launch starts, the comparison runs. Skipped without SGLang's CPU venv."""

from __future__ import annotations

import ast
from pathlib import Path

import httpx
import pytest

from pipeline.search.draft_replay import tables_of
from pipeline.simulate.replay import Answer, ClosedLoop, Phase, replay
from serve.engines.sglang import cpu as sglang_cpu
from serve.engines.base import ReplicaConfig
from serve.engines.cpu.convert import load_tokenizer
from serve.engines.cpu.draft_replay import replay_answers
from serve.model_store import resolve_model
from serve.engines.cpu.runner import ModelRunner
from serve.spec import NoSpec, StandaloneSpec
from tests.sglang_servers import needs_sglang_cpu, owned_engine

pytestmark = [pytest.mark.integration, pytest.mark.engines, needs_sglang_cpu]

MODEL = "smollm2-135m"
SPEC = StandaloneSpec(draft_model=MODEL, num_steps=3, topk=2, num_draft_tokens=5)
PROMPTS = ["def fib(n):\n    if n < 2:\n        return n\n", "List the days of the week: Monday, Tuesday,",
           "The history of the printing press begins"]
NEW_TOKENS = 16
REFUSAL = "EAGLE is not supported in decode attention backend"


def draft_backend_tables(python: Path) -> str:
    """Where the installed wheel's draft attention tables are, with the backends each lists."""
    site = next(python.parent.parent.glob("lib/python*/site-packages"))
    path = site / "sglang" / "srt" / "speculative" / "draft_utils.py"
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name in ("create_decode_backend", "create_draft_extend_backend"):
            for item in ast.walk(node):
                if isinstance(item, ast.Dict) and item.keys:
                    keys = [str(k.value) for k in item.keys if isinstance(k, ast.Constant)]
                    lines.append(f"{path}:{item.lineno}-{item.end_lineno} ({node.name}: {', '.join(keys)})")
    return "; ".join(lines)


def generate(url: str, prompt: str) -> tuple[list[int], dict]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0}}
    data = httpx.post(f"{url}/generate", json=body, timeout=600).json()
    return data["output_ids"], data["meta_info"]


def test_replayed_accept_lengths_match_sglang_standalone_on_cpu(tmp_path):
    python = sglang_cpu.venv_python()
    assert python is not None
    config = ReplicaConfig(engine="sglang", device="cpu", model=MODEL, spec=SPEC, threads=1, start_timeout_s=600,
                           log_dir=str(tmp_path))
    try:
        with owned_engine(config) as engine:
            drafted = [generate(engine.url, p) for p in PROMPTS]
    except pytest.fail.Exception as failed:
        if REFUSAL not in str(failed) and not any(REFUSAL in f.read_text(errors="replace")
                                                   for f in tmp_path.glob("*.log")):
            raise
        pytest.skip(f"SGLang 0.5.23 cannot run STANDALONE on this CPU: its draft worker refused "
                    f"--attention-backend torch_native at start ({REFUSAL} torch_native); the wheel's draft "
                    f"attention tables list no torch_native: {draft_backend_tables(python)}")
    plain_config = config.model_copy(update={"spec": NoSpec(), "log_dir": str(tmp_path / "plain")})
    with owned_engine(plain_config) as engine:
        plain = [generate(engine.url, p) for p in PROMPTS]
    tokenizer = load_tokenizer(resolve_model(MODEL))  # SGLang tokenizes `text` with the same tokenizer files
    answers = [Answer(tuple(tokenizer.encode(p)), tuple(ids)) for p, (ids, _) in zip(PROMPTS, plain)]
    runner = ModelRunner.from_dir(resolve_model(MODEL), "float32", "fp32")
    ranks = replay_answers(runner, [(a.prompt_ids, a.output_ids) for a in answers], [SPEC.topk or 1],
                           SPEC.num_steps or 1)
    tables = tables_of(MODEL, answers, SPEC.num_steps or 1,
                       {"answers": [{str(k): v for k, v in per.items()} for per in ranks]})
    replayed = replay(SPEC, [Phase("measure", tuple(answers), ClosedLoop(1))], drafts=tables).requests
    assert [ids for ids, _ in drafted] == [ids for ids, _ in plain]
    assert [(m["spec_verify_ct"], m["completion_tokens"]) for _, m in drafted] == [
        (r.spec_verify_ct, r.completion_tokens) for r in replayed]

