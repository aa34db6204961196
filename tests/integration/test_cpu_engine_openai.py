"""OpenAI routes of the CPU engine with the real `openai` client (completions and chat, plain and streaming), on a
STANDALONE server (SmolLM2-135M drafting for itself) so that draft-model speculation is also exercised over HTTP."""

from __future__ import annotations

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

ARGS = ["--model-path", "smollm2-135m", "--served-model-name", "smol", "--threads", "1",
        "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "smollm2-135m",
        "--speculative-num-steps", "2", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "5",
        "--verify-probe-seconds", "0"]
PROMPT = "The three primary colors are"


@pytest.fixture(scope="module")
def server(smol_dir, cpu_server, tmp_path_factory):
    with cpu_server(ARGS, tmp_path_factory.mktemp("standalone-server")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300)


def _native(server, text: str, new: int) -> dict:
    resp = httpx.post(server.url + "/generate", timeout=300,
                      json={"text": text, "sampling_params": {"max_new_tokens": new, "temperature": 0}})
    resp.raise_for_status()
    return resp.json()


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == ["smol"]


def test_standalone_generate_reports_spec_counters(server):
    info = httpx.get(server.url + "/server_info").json()
    assert (info["speculative_algorithm"], info["speculative_num_steps"], info["speculative_eagle_topk"],
            info["speculative_num_draft_tokens"]) == ("STANDALONE", 2, 2, 5)
    meta = _native(server, PROMPT, 16)["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_num_proposed_drafts"] == 4 * meta["spec_verify_ct"]
    assert meta["spec_accept_length"] > 1.5  # the model agrees with itself


def test_completion_matches_native_generate(client, server):
    out = client.completions.create(model="smol", prompt=PROMPT, max_tokens=16, temperature=0)
    native = _native(server, PROMPT, 16)
    assert out.choices[0].text == native["text"]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 16 and out.usage.prompt_tokens == native["meta_info"]["prompt_tokens"]


def test_streamed_completion_joins_to_the_same_text(client):
    whole = client.completions.create(model="smol", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stream = client.completions.create(model="smol", prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_uses_the_chat_template_and_streams(client, smol):
    tokenizer = smol[1]
    messages = [{"role": "user", "content": "Name one fruit."}]
    out = client.chat.completions.create(model="smol", messages=messages, max_tokens=20, temperature=0)
    text = out.choices[0].message.content
    assert out.choices[0].message.role == "assistant" and text
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                                  add_special_tokens=False)
    assert out.usage.prompt_tokens == len(prompt_ids)
    stream = client.chat.completions.create(model="smol", messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == out.choices[0].finish_reason


def test_openai_errors_are_400(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smol", prompt=PROMPT, max_tokens=16, n=2)
    after = client.completions.create(model="smol", prompt=PROMPT, max_tokens=2, temperature=0)
    assert after.usage.completion_tokens == 2  # still serving


@pytest.mark.parametrize("body, field", [
    ({"prompt": "\ud800", "max_tokens": 2}, "prompt"),
    ({"prompt": "x", "max_tokens": 2, "stop": ["ok", "\udfff"]}, "stop"),
    ({"prompt": "x", "max_tokens": 2, "seed": 2**63}, "seed"),
    ({"prompt": "x", "max_tokens": "2"}, "max_tokens"),
    ({"prompt": [1, True], "max_tokens": 2}, "prompt"),
    ({"prompt": "x", "max_tokens": 2, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x", "max_tokens": 2, "stop": "y" * 400_000}, "stop"),
])
def test_hostile_completion_bodies_are_400_not_500(server, body, field):
    import json

    resp = httpx.post(server.url + "/v1/completions", content=json.dumps({"model": "smol", **body}),
                      headers={"content-type": "application/json"}, timeout=60)
    assert resp.status_code == 400 and field in resp.json()["error"]["message"]


def test_chat_surrogate_is_400(server):
    resp = httpx.post(server.url + "/v1/chat/completions", timeout=60, headers={"content-type": "application/json"},
                      content='{"model": "smol", "messages": [{"role": "user", "content": "hi \\ud83d"}]}')
    assert resp.status_code == 400 and "messages" in resp.json()["error"]["message"]
