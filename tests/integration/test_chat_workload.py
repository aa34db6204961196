"""Chat workloads reach the engine as production's chat route would send them: `pipeline.measure.load` renders the messages
with the model's chat template into `input_ids` for `/generate` (which keeps per-request spec counters); the engine's
`/v1/chat/completions` (under the real `openai` client) must see the same prompt tokens and answer the same text."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from pipeline.measure.load import requests_of, run_phase
from pipeline.workloads import read_prompts

pytestmark = pytest.mark.integration

ARGS = ["--model-path", "smollm2-135m", "--threads", "1", "--context-length", "512",
        "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "6", "--verify-probe-seconds", "0"]
CHATS: list[list[ChatCompletionMessageParam]] = [
    [{"role": "user", "content": "Name three rivers."}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Count to five."}],
]
NEW = 16


@pytest.fixture(scope="module")
def server(smol_dir, cpu_server, tmp_path_factory):
    with cpu_server(ARGS, tmp_path_factory.mktemp("chat-server")) as srv:
        yield srv


def test_rendered_ids_equal_the_chat_route(server, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m, "max_new_tokens": NEW}) + "\n" for m in CHATS))
    items = requests_of(read_prompts(path)[0], "smollm2-135m")
    records = run_phase(server.url, items, phase="measure", concurrency=1, timeout_s=120)
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
    for messages, item, record in zip(CHATS, items, records):
        assert record.error is None, record.error
        chat = api.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=NEW, temperature=0)
        assert chat.usage is not None and item.input_ids is not None
        assert chat.usage.prompt_tokens == record.prompt_tokens == len(item.input_ids)
        assert record.spec_verify_ct  # the reason for /generate: per-request spec counters
        generated = api.completions.create(model="smollm2-135m", prompt=list(item.input_ids), max_tokens=NEW,
                                           temperature=0).choices[0].text
        assert chat.choices[0].message.content == generated  # same ids in, same greedy text out
        assert chat.usage.completion_tokens == record.completion_tokens
