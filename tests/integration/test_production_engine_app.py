"""The CPU engine's HTTP app in this process (SmolLM2-135M, the real routes through ASGI): hostile JSON is a 400 on
every route, big prompts are tokenized off the event loop, and the OpenAI routes name the fields the client sent
(issue #31 items 6, 7, 9).

Tokenization off the loop is checked by where it runs, not by a timing: the engine's tokenizer is wrapped so that
each `encode` call records its thread (the tokenizing itself is the real one), and a long prompt must never be
encoded on the event loop's thread."""

from __future__ import annotations

import asyncio
import copy
import threading

import httpx
import pytest

from serve.engines.cpu.params import INLINE_TOKENIZE_CHARS

pytestmark = pytest.mark.integration
HOSTILE = [
    b"[" * 5000 + b"]" * 5000,  # RecursionError in the JSON decoder
    b'{"text": "x", "sampling_params": {"max_new_tokens": ' + b"9" * 5000 + b"}}",  # Python's 4300-digit limit
    b'{"text": "x", "sampling_params": {"temperature": Infinity}}',
    b'{"text": "x", "sampling_params": {"temperature": 1e400}}',
    b'{"text": "x", "sampling_params": {"temperature": NaN}}',
]
OPENAI_HOSTILE = [
    b'{"prompt": "x", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"prompt": "x", "temperature": Infinity}',
    b'{"prompt": "x", "top_p": 1e400}',
]


class _RecordingTokenizer:
    """The real tokenizer; `encode` notes (thread, text length). A copy (the engine's tokenizer thread makes one)
    records into the same list."""

    def __init__(self, tokenizer, seen: list[tuple[int, int]]) -> None:
        self._tokenizer, self._seen = tokenizer, seen

    def encode(self, text, *args, **kwargs):
        self._seen.append((threading.get_ident(), len(text)))
        return self._tokenizer.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __deepcopy__(self, memo):
        return _RecordingTokenizer(copy.deepcopy(self._tokenizer, memo), self._seen)


@pytest.fixture(scope="module")
def engine(smol_dir):
    from serve.engines.cpu.command_line import parse_config
    from serve.engines.cpu.engine import build_engine

    built = build_engine(parse_config(["--model-path", str(smol_dir), "--threads", "1", "--verify-probe-seconds", "0",
                                       "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "4"]))
    yield built
    built.scheduler.stop()


def _post_all(engine, requests: list[tuple[str, bytes]]) -> list[httpx.Response]:
    from serve.engines.cpu.server import create_app

    async def run():
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=300) as client:
            return [await client.post(path, content=body, headers={"content-type": "application/json"})
                    for path, body in requests]

    return asyncio.run(run())


def test_hostile_json_is_400_on_every_route(engine):
    requests = [(path, body) for path in ("/generate", "/add_external_corpus") for body in HOSTILE]
    requests += [(path, body) for path in ("/v1/completions", "/v1/chat/completions") for body in OPENAI_HOSTILE]
    for (path, body), response in zip(requests, _post_all(engine, requests)):
        assert response.status_code == 400, (path, body[:60], response.status_code, response.text[:200])


def test_a_long_prompt_is_never_tokenized_on_the_event_loop(engine):
    seen: list[tuple[int, int]] = []
    real = engine.factory.tokenizer
    engine.factory.tokenizer = _RecordingTokenizer(real, seen)
    engine.tokenizer = engine.factory.tokenizer
    long_text = "The quick brown fox jumps over the lazy dog. " * 4000  # 180,000 characters: refused by context
    loop_threads: list[int] = []

    async def run():
        from serve.engines.cpu.server import create_app

        loop_threads.append(threading.get_ident())
        transport = httpx.ASGITransport(app=create_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=300) as client:
            return [await client.post("/generate", json={"text": long_text, "sampling_params": {"max_new_tokens": 1}}),
                    await client.post("/v1/completions", json={"prompt": long_text, "max_tokens": 1}),
                    await client.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": long_text}], "max_tokens": 1}),
                    await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})]

    try:
        answers = asyncio.run(run())
    finally:
        engine.factory.tokenizer = engine.tokenizer = real
    assert [a.status_code for a in answers] == [400, 400, 400, 200]  # 40k tokens cannot fit 8192
    assert "context_length" in answers[0].text
    long_calls = [thread for thread, size in seen if size > INLINE_TOKENIZE_CHARS]
    assert len(long_calls) == 3 and loop_threads[0] not in long_calls, "a long prompt was tokenized on the loop"


def test_the_openai_routes_name_max_tokens_not_the_native_field(engine):
    words = "one two three four five six seven eight nine ten " * 60  # ~600 tokens
    (plain, chat) = _post_all(engine, [
        ("/v1/completions", f'{{"prompt": "{words}", "max_tokens": 8000}}'.encode()),
        ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "{words}"}}], '
                                 f'"max_completion_tokens": 8000}}'.encode())])
    assert plain.status_code == chat.status_code == 400
    assert plain.json()["error"]["message"].startswith("max_tokens: ") and "sampling_params" not in plain.text
    assert chat.json()["error"]["message"].startswith("max_completion_tokens: ")
