"""Hostile request bodies for the CPU engine: bounded stop strings with a linear hold-back check, strict types,
lone surrogates and out-of-range seeds refused as client errors (BadRequest = HTTP 400), never as a 500."""

from __future__ import annotations

import json
import time

import pytest

from serve.engines.cpu.openai_api import ChatBody, CompletionBody
from serve.engines.cpu.params import (MAX_STOP_CHARS, MAX_STOP_STRINGS, BadRequest, GenerateBody, SamplingParams,
                                      held_back, parse_model)


def _brute_force(text: str, stops: list[str]) -> int:
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@pytest.mark.parametrize("text, stops", [
    ("hello wor", ["world"]), ("abcab", ["abcabd"]), ("aaaa", ["aaab"]), ("xyz", ["q"]), ("", ["abc"]),
    ("the end\n\n", ["\n\nUser:", "\n\n\n"]), ("abababa", ["ababab", "bab"]), ("no match", ["zz", "yy"]),
])
def test_held_back_equals_the_longest_stop_prefix_the_text_ends_with(text, stops):
    assert held_back(text, stops) == _brute_force(text, stops)


def test_held_back_is_linear_in_the_stop_length():
    # The quadratic check took 13.7 s on this input (2-vCPU box, 1 run), the linear one 0.36 s; the bound below is a
    # deadline ~14x above the linear cost, not a benchmark.
    stop = "a" * 400_000 + "b"
    started = time.perf_counter()
    assert held_back("a" * 600_000, [stop]) == 400_000
    assert time.perf_counter() - started < 5


@pytest.mark.parametrize("stop, needle", [
    (["a", "b", "c", "d", "e"], f"at most {MAX_STOP_STRINGS} stop strings"),
    ("x" * (MAX_STOP_CHARS + 1), f"at most {MAX_STOP_CHARS} characters"),
    ([""], "empty stop strings"),
])
def test_stop_strings_are_bounded(stop, needle):
    with pytest.raises(BadRequest, match=needle):
        parse_model(GenerateBody, {"text": "hi", "sampling_params": {"stop": stop}})
    with pytest.raises(BadRequest, match=needle):
        parse_model(SamplingParams, {"stop": stop})


def test_a_long_stop_is_refused_quickly_and_the_message_does_not_echo_it():
    with pytest.raises(BadRequest) as err:
        parse_model(CompletionBody, {"prompt": "x", "stop": "y" * 400_000})
    assert len(str(err.value)) < 400


@pytest.mark.parametrize("kind, body, field", [
    (GenerateBody, {"text": "hi", "sampling_params": {"max_new_tokens": "2"}}, "max_new_tokens"),
    (GenerateBody, {"input_ids": [1, True, 3]}, "input_ids.1"),
    (GenerateBody, {"text": "hi", "stream": "yes"}, "stream"),
    (GenerateBody, {"text": "hi", "sampling_params": {"stop_token_ids": [False]}}, "stop_token_ids"),
    (CompletionBody, {"prompt": "x", "max_tokens": "2"}, "max_tokens"),
    (CompletionBody, {"prompt": [1, True]}, "prompt"),
    (ChatBody, {"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
])
def test_no_coercion_of_strings_or_booleans(kind, body, field):
    with pytest.raises(BadRequest, match=field):
        parse_model(kind, body)


@pytest.mark.parametrize("kind, raw, field", [
    (GenerateBody, '{"text": "a\\ud800b"}', "text"),
    (CompletionBody, '{"prompt": "\\udfff"}', "prompt"),
    (ChatBody, '{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', "messages.0.content"),
    (CompletionBody, '{"prompt": "x", "stop": ["ok", "\\ud800"]}', "stop.1"),
])
def test_lone_surrogates_are_client_errors(kind, raw, field):
    with pytest.raises(BadRequest, match=rf"{field}: not valid Unicode"):
        parse_model(kind, json.loads(raw))


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
def test_seeds_must_fit_int64(seed):
    with pytest.raises(BadRequest, match="seed"):
        parse_model(GenerateBody, {"text": "hi", "sampling_params": {"seed": seed}})
    with pytest.raises(BadRequest, match="seed"):
        parse_model(CompletionBody, {"prompt": "hi", "seed": seed})


def test_valid_bodies_still_parse():
    body = parse_model(GenerateBody, {"text": "héllo 🙂", "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "stop": ["\n", "END"], "seed": 2**63 - 1}})
    assert body.sampling_params.max_new_tokens == 4 and body.sampling_params.temperature == 0.0
    chat = parse_model(ChatBody, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": -5})
    assert chat.max_tokens == 3
