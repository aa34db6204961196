"""Tree acceptance, the sampling transforms, and request validation, with synthetic logits (no model)."""

from __future__ import annotations

import pytest
import torch

from serve.engines.cpu.params import BadRequest, GenerateBody, RequestFactory, SamplingParams, parse_model
from serve.engines.cpu.verify import Sampling, TokenChooser, walk_tree

V = 10


def _onehot(token: int) -> torch.Tensor:
    x = torch.zeros(V)
    x[token] = 5.0
    return x


def _walk(tokens, parents, argmax_at):
    seen = []

    def logits_at(i):
        seen.append(i)
        return _onehot(argmax_at[i])

    accepted, emitted = walk_tree(tokens, parents, logits_at, TokenChooser(Sampling(temperature=0.0), None))
    return accepted, emitted, seen


def test_greedy_walk_takes_the_matching_child_not_the_first():
    # root(0) -> [1: tok 4, 2: tok 3]; 2 -> [3: tok 7]; the target wants 3, then 7, then 9
    accepted, emitted, seen = _walk([0, 4, 3, 7], [-1, 0, 0, 2], {0: 3, 2: 7, 3: 9})
    assert accepted == [2, 3] and emitted == [3, 7, 9] and seen == [0, 2, 3]


def test_greedy_walk_rejects_at_the_root_and_emits_one_token():
    accepted, emitted, _ = _walk([0, 4, 5], [-1, 0, 1], {0: 8})
    assert accepted == [] and emitted == [8]


def test_duplicate_pad_tokens_resolve_to_the_first():
    accepted, emitted, _ = _walk([0, 0, 0], [-1, 0, 0], {0: 0, 1: 6})
    assert accepted == [1] and emitted == [0, 6]


def test_top_k_and_top_p_restrict_support():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.1, 0.05, 0.05]))
    p = TokenChooser(Sampling(temperature=1.0, top_k=2), None).probs(logits)
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0, 0, 0], dtype=p.dtype))
    p = TokenChooser(Sampling(temperature=1.0, top_p=0.7), None).probs(logits)
    assert torch.count_nonzero(p) == 2  # 0.5 alone is below 0.7; 0.5 + 0.3 reaches it
    p = TokenChooser(Sampling(temperature=1.0, min_p=0.25), None).probs(logits)
    assert torch.count_nonzero(p) == 2  # 0.1 < 0.25 * 0.5


def test_sampling_follows_the_distribution_with_one_draw_per_token():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    gen = torch.Generator().manual_seed(0)
    chooser = TokenChooser(Sampling(temperature=1.0), gen)
    draws = [chooser(logits) for _ in range(4000)]
    freq = [draws.count(i) / len(draws) for i in range(3)]
    assert freq == pytest.approx([0.7, 0.2, 0.1], abs=0.03)
    # exactly one uniform per token: a fresh generator with the same seed, advanced by 4000 draws, is in step
    ref = torch.Generator().manual_seed(0)
    torch.rand(4000, generator=ref, dtype=torch.float64)
    assert torch.rand((), generator=gen).item() == torch.rand((), generator=ref).item()


class _Tok:
    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 50 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def _factory(context=32):
    return RequestFactory(_Tok(), frozenset({2}), context, 50, random_seed=1)


def test_request_factory_validates_prompt_and_lengths():
    f = _factory()
    with pytest.raises(BadRequest, match="got neither"):
        f.prompt_ids(None, None)
    with pytest.raises(BadRequest, match="got both"):
        f.prompt_ids("a", [1])
    with pytest.raises(BadRequest, match="empty"):
        f.prompt_ids("", None)
    with pytest.raises(BadRequest, match=r"\[0, 50\)"):
        f.prompt_ids(None, [1, 50])
    ids = f.prompt_ids("hello", None)
    with pytest.raises(BadRequest, match="must be >= 1"):
        f.build(ids, SamplingParams(max_new_tokens=0))
    with pytest.raises(BadRequest, match="lower max_new_tokens to <= 27"):
        f.build(ids, SamplingParams(max_new_tokens=28))
    req = f.build(ids, SamplingParams())
    assert req.rules.max_new_tokens == 27  # SGLang's default 128, bounded by the room left
    assert f.build(ids, SamplingParams(seed=5)).seed == 5 and f.build(ids, SamplingParams()).seed != req.seed


def test_unsupported_or_unknown_parameters_are_rejected():
    with pytest.raises(BadRequest, match="sampling_params.frequency_penalty"):
        parse_model(GenerateBody, {"text": "x", "sampling_params": {"frequency_penalty": 0.5}})
    with pytest.raises(BadRequest, match="sampling_params.topk: unknown field"):
        parse_model(GenerateBody, {"text": "x", "sampling_params": {"topk": 5}})
    body = parse_model(GenerateBody, {"text": "x", "sampling_params": {"temperature": 0, "stop": "\n"}})
    assert body.sampling_params.temperature == 0 and body.sampling_params.stop == "\n"
    assert parse_model(GenerateBody, {"text": "x"}).sampling_params.temperature == 1.0  # SGLang's default
    assert parse_model(GenerateBody, {"text": "x", "sampling_params": None}).sampling_params.max_new_tokens is None


def test_streamed_text_holds_back_a_possible_stop_prefix():
    f = _factory()
    params = SamplingParams(stop=["cd"])
    # ids 0,1,2 decode to "abc": "c" may start "cd", so it waits
    assert f.text_of([0, 1, 2], None, params, final=False) == "ab"
    assert f.text_of([0, 1, 2, 3], {"type": "stop", "matched": "cd"}, params, final=True) == "ab"
