"""Chat workloads (OpenAI messages JSONL/Parquet, ShareGPT JSON), the reasoning workload, traffic capture rows and
parts (sampling, the row bound, merge into a workload), and corpus files for trials. Pure parts and local files."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from fastapi.responses import Response, StreamingResponse

from pipeline.config import TrialConfig
from pipeline.trial.corpus import WARMUP_CORPUS, corpus_documents, corpus_for_trial, corpus_record, write_corpus
from pipeline.measure.load import LoadRequest, requests_of
from pipeline.workloads import WorkloadError, load_workload, read_prompts
from serve.closed_loop.capture import Capture, CaptureSettings, merge_parts, row_of
from serve.production.settings import ProductionSettings
from serve.spec import NgramSpec

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- chat workloads -------------------------------------------------------------------------------------------

def test_messages_jsonl_gives_chat_prompts_with_readable_text(tmp_path):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT, "id": "a", "output": "Blue."},
                                            {"prompt": "plain", "id": "b"}])
    chat, plain = read_prompts(path)[0]
    assert chat.messages == (("system", "Be brief."), ("user", "Name a colour.")) and chat.output == "Blue."
    assert chat.text == "system: Be brief.\nuser: Name a colour."
    assert plain.messages is None and plain.text == "plain"


@pytest.mark.parametrize("row, needle", [
    ({"messages": CHAT, "prompt": "x"}, "either 'prompt' (plain text) or 'messages' (chat), not both"),
    ({"messages": []}, "field 'messages' must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role must be one of"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content must be a string"),
    ({"messages": [*CHAT, {"role": "assistant", "content": "Red."}]}, "the last message must be the user's"),
    ({"messages": CHAT, "output": 5}, "field 'output' must be a string"),
])
def test_bad_chat_rows_name_the_line_and_field(tmp_path, row, needle):
    path = _jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(WorkloadError) as err:
        read_prompts(path)
    assert needle in str(err.value) and "bad.jsonl:1" in str(err.value)


def test_sharegpt_json_becomes_chat_prompts_with_recorded_answers(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([
        {"id": "c1", "conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q1"},
                                        {"from": "gpt", "value": "A1"}, {"from": "human", "value": "Q2"},
                                        {"from": "gpt", "value": "A2"}]},
        {"conversations": [{"from": "human", "value": "only a question"}]},
    ]))
    first, second = read_prompts(path)[0]
    assert first.id == "c1" and first.output == "A2"
    assert first.messages == (("system", "S"), ("user", "Q1"), ("assistant", "A1"), ("user", "Q2"))
    assert second.id == "sg:2" and second.output is None


def test_sharegpt_with_an_unknown_speaker_is_refused(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"conversations": [{"from": "bot", "value": "x"}]}]))
    with pytest.raises(WorkloadError, match="conversation 1: conversations\\[0\\] must be"):
        read_prompts(path)


def test_chat_prompts_change_the_workload_digest(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"messages": CHAT, "id": i} for i in range(4)])
    b = _jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "user", "content": "system: Be brief.\nuser: Name a "
                                                     "colour."}], "id": i} for i in range(4)])
    kw = dict(seed=0, n_warmup=1, n_measure=2)
    assert load_workload(a, **kw).digest != load_workload(b, **kw).digest


def test_reasoning_workload_asks_for_long_step_by_step_answers():
    prompts, _ = read_prompts("reasoning", max_new_tokens=256)
    assert len(prompts) >= 40 and all(p.max_new_tokens == 256 for p in prompts)
    assert all("step" in p.text.lower() or "line" in p.text.lower() for p in prompts)


class _Tok:
    """A stand-in tokenizer with a chat template: one id per character (enough to check what is sent)."""

    chat_template = "x"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens):
        assert add_special_tokens is False  # the template already holds the special tokens
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_chat_prompts_are_sent_as_rendered_ids_and_plain_ones_as_text(tmp_path):
    path = _jsonl(tmp_path / "mix.jsonl", [{"messages": CHAT}, {"prompt": "plain"}])
    chat, plain = requests_of(read_prompts(path)[0], tokenizer=_Tok())
    assert _Tok().decode(chat.input_ids) == "<system>Be brief.<user>Name a colour.<assistant>"
    assert plain.input_ids is None and plain.text == "plain"


def test_chat_prompts_without_a_target_are_refused(tmp_path):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}])
    with pytest.raises(ValueError, match="need the target model"):
        requests_of(read_prompts(path)[0])


# --- capture --------------------------------------------------------------------------------------------------

def test_capture_rows_follow_the_workload_schema():
    chat = row_of("/v1/chat/completions", {"messages": CHAT, "max_tokens": 9}, "Blue.", 2048)
    assert chat is not None
    assert json.loads(chat["messages"]) == CHAT and chat["prompt"] is None and chat["max_new_tokens"] == 9
    plain = row_of("/v1/completions", {"prompt": "Once"}, " upon", 16)
    assert plain is not None
    assert plain["prompt"] == "Once" and plain["max_new_tokens"] == 16 and plain["output"] == " upon"
    assert row_of("/v1/completions", {"prompt": [1, 2, 3]}, "x", 16) is None  # token ids: not replayable
    assert row_of("/v1/chat/completions", {"messages": [*CHAT, {"role": "assistant", "content": "x"}]}, "", 8) \
        is None


def test_capture_settings_from_the_command_line():
    by_dir = ProductionSettings.model_validate({"capture": "/tmp/cap"}).capture
    assert by_dir is not None and by_dir.dir == "/tmp/cap"
    parsed = ProductionSettings.model_validate({"capture": '{"dir": "/tmp/cap", "sample_rate": 1}'}).capture
    assert parsed is not None and parsed.sample_rate == 1.0
    assert ProductionSettings().capture is None  # opt-in
    with pytest.raises(ValueError, match="sample_rate"):
        CaptureSettings.model_validate({"dir": "/tmp/cap", "sample_rate": 0})


def _observe(capture, route, body, response):
    return asyncio.run(capture.observe(route, body, response))  # the request as the ingress parsed it


async def _drain(response):
    return [chunk async for chunk in response.body_iterator]


def test_capture_keeps_200_answers_streamed_or_not_up_to_the_bound_then_merges_into_a_workload(tmp_path):
    cap = Capture(CaptureSettings(dir=str(tmp_path / "cap"), sample_rate=1, max_rows=3, flush_rows=2, seed=0))
    answer = {"choices": [{"message": {"role": "assistant", "content": "Blue."}}]}
    _observe(cap, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5},
             Response(json.dumps(answer).encode(), status_code=200))
    _observe(cap, "/v1/chat/completions", {"messages": CHAT}, Response(b"{}", status_code=500))  # not kept

    async def sse():
        for piece in ("Gr", "een", "."):
            yield f"data: {json.dumps({'choices': [{'delta': {'content': piece}}]})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    streamed = _observe(cap, "/v1/chat/completions", {"messages": CHAT, "stream": True},
                        StreamingResponse(sse(), status_code=200))
    assert len(asyncio.run(_drain(streamed))) == 4  # the client still gets every chunk
    for i in range(3):
        _observe(cap, "/v1/completions", {"prompt": f"p{i}", "max_tokens": 4},
                 Response(json.dumps({"choices": [{"text": "!"}]}).encode(), status_code=200))
    _observe(cap, "/v1/models", {}, Response(b"{}", status_code=200))
    cap.flush()
    out = tmp_path / "captured.parquet"
    assert merge_parts(tmp_path / "cap", out) == 3  # max_rows
    prompts, _ = read_prompts(out)
    assert [p.output for p in prompts] == ["Blue.", "Green.", "!"]
    assert prompts[0].messages == (("system", "Be brief."), ("user", "Name a colour."))
    assert prompts[2].text == "p0" and prompts[2].max_new_tokens == 4
    # the bound holds across restarts: a new Capture on the same dir keeps nothing more
    again = Capture(CaptureSettings(dir=str(tmp_path / "cap"), sample_rate=1, max_rows=3, flush_rows=1))
    again.record("/v1/completions", {"prompt": "late"}, "x")
    again.flush()
    assert merge_parts(tmp_path / "cap", out) == 3


def test_a_stream_the_client_leaves_after_done_is_kept_and_one_cut_before_done_is_not(tmp_path):
    cap = Capture(CaptureSettings(dir=str(tmp_path / "cap"), sample_rate=1, flush_rows=1, seed=0))

    async def sse(done: bool):
        yield f"data: {json.dumps({'choices': [{'delta': {'content': 'Red'}}]})}\n\n".encode()
        if done:
            yield b"data: [DONE]\n\n"
        yield b": keep-alive\n\n"  # something after the last chunk the client reads

    async def read_until_done_then_hang_up(response, chunks: int):
        iterator = response.body_iterator
        for _ in range(chunks):
            await iterator.__anext__()
        await iterator.aclose()  # what Starlette does when the client disconnects mid-stream

    whole = _observe(cap, "/v1/chat/completions", {"messages": CHAT, "stream": True},
                     StreamingResponse(sse(done=True), status_code=200))
    asyncio.run(read_until_done_then_hang_up(whole, 2))
    cut = _observe(cap, "/v1/chat/completions", {"messages": CHAT + [{"role": "user", "content": "again"}],
                                                 "stream": True}, StreamingResponse(sse(done=False), status_code=200))
    asyncio.run(read_until_done_then_hang_up(cut, 1))
    cap.flush()
    out = tmp_path / "captured.parquet"
    assert merge_parts(tmp_path / "cap", out) == 1
    prompts, _ = read_prompts(out)
    assert [p.output for p in prompts] == ["Red"]


def test_sampling_keeps_about_the_rate(tmp_path):
    cap = Capture(CaptureSettings(dir=str(tmp_path), sample_rate=0.25, flush_rows=1000, seed=1))
    for i in range(400):
        _observe(cap, "/v1/completions", {"prompt": f"p{i}"},
                 Response(json.dumps({"choices": [{"text": "x"}]}).encode(), status_code=200))
    cap.flush()
    assert 60 <= merge_parts(tmp_path, tmp_path / "m.parquet") <= 140


def test_merge_without_parts_says_what_to_check(tmp_path):
    with pytest.raises(ValueError, match="no part-\\*.parquet files"):
        merge_parts(tmp_path, tmp_path / "o.parquet")


# --- corpus files ---------------------------------------------------------------------------------------------

def test_warmup_sentinel_becomes_a_shared_corpus_file(tmp_path):
    trial = TrialConfig(spec=NgramSpec(num_draft_tokens=8, external_corpus=WARMUP_CORPUS, external_sam_budget=3))
    warm = [LoadRequest(0, "alpha", 4), LoadRequest(1, "beta", 4), LoadRequest(0, "alpha", 4)]  # cycled split
    resolved, written = corpus_for_trial(trial, warm, tmp_path)
    assert written is not None and isinstance(resolved.spec, NgramSpec)
    assert resolved.spec.external_corpus == written.path and written.documents == 2
    lines = [json.loads(line) for line in open(written.path)]
    assert lines == ["alpha", "beta"]
    again, same = corpus_for_trial(trial, warm, tmp_path)
    assert same is not None and same.path == written.path  # content-addressed: every trial of the study shares it
    # what the engine lists (GET /list_external_corpora) and the replica's record of its runtime load
    listed, loaded = {written.path: 7}, {"id": written.path, "load_s": 0.5, "loaded_token_count": 7}
    assert written.bytes is not None  # a written file knows its size
    assert corpus_record(listed, loaded, written) == ({"corpus_documents": 2.0, "corpus_bytes": float(written.bytes),
                                                       "corpus_tokens": 7.0, "corpus_load_s": 0.5}, None)


def test_no_corpus_passes_through_and_a_user_file_is_read_to_be_shipped(tmp_path):
    plain = TrialConfig(spec=NgramSpec(num_draft_tokens=8))
    assert corpus_for_trial(plain, [], tmp_path) == (plain, None)
    user = write_corpus(["x", "y"], tmp_path / "user.jsonl")
    trial = TrialConfig(spec=NgramSpec(num_draft_tokens=8, external_corpus=user.path, external_sam_budget=2))
    resolved, info = corpus_for_trial(trial, [], tmp_path / "trial")
    # The engine's node may not see the user's file: its documents travel, and the trial keeps its own copy.
    assert info is not None and isinstance(resolved.spec, NgramSpec)
    assert info.documents == 2 and info.texts == ("x", "y")
    assert resolved.spec.external_corpus == info.path and Path(info.path).parent == tmp_path / "trial" / "corpora"
    missing = TrialConfig(spec=NgramSpec(num_draft_tokens=8, external_corpus="/no/such.jsonl", external_sam_budget=2))
    with pytest.raises(ValueError, match="spec.external_corpus: '/no/such.jsonl' is not a file"):
        corpus_for_trial(missing, [], tmp_path)


def test_chat_documents_are_rendered_and_carry_recorded_answers():
    class Item:
        text, input_ids, output = "user: hi", (60, 104, 105, 62), " hello"

    assert corpus_documents([Item()], _Tok()) == ["<hi> hello"]
    with pytest.raises(ValueError, match="no documents"):
        write_corpus([], "/tmp/never.jsonl")
