"""Tree verification, KV pruning and draft trees on tiny random HF models (no download): a Llama (which the runner
drives through the fast forward of llama.py), and a Gemma 3 with a 4-token sliding window (HF's modules) so that the
window masks of tree forwards are exercised on short sequences.

The reference is HF's own full forward over the whole sequence (no cache, HF's own masks), one token at a time."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from serve.engines.cpu.decode import Decoder, Request, StopRules
from serve.engines.cpu.llama import KVCache
from serve.ngram.trie import DraftTree
from serve.engines.cpu.runner import ModelRunner, tree_visibility
from serve.engines.cpu.speculators import StandaloneSpeculator
from serve.engines.cpu.verify import Sampling

VOCAB = 97


def _tiny(kind: str):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, PreTrainedModel

    torch.manual_seed(0)
    model: PreTrainedModel
    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  max_position_embeddings=256)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        layer_types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
        model = Gemma3ForCausalLM(Gemma3TextConfig(**common, sliding_window=4, layer_types=layer_types))
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "gemma3-sliding"])
def model(request):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: OpenMP sync costs more than it saves, badly so on a shared CPU
    yield _tiny(request.param)
    torch.set_num_threads(threads)


def test_llama_takes_the_fast_forward_and_gemma_the_hf_modules(model):
    runner = ModelRunner(model)
    assert runner.backend == ("fast-llama" if model.config.model_type == "llama" else "hf")
    assert isinstance(runner.new_cache(), KVCache) == (runner.backend == "fast-llama")


def _reference(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


class _Tok:
    def decode(self, ids, **_):
        return " ".join(map(str, ids))


class WrongTreeSpeculator:
    """Knows the true continuation and proposes trees that are partly wrong: a wrong sibling before the right one,
    a right chain that turns wrong at depth 3, pads, and every third step a tree with nothing right at all."""

    num_draft_tokens = 8

    def __init__(self, truth: list[int]) -> None:
        self.truth = truth
        self.calls = 0

    def propose(self, req: Request) -> DraftTree:
        self.calls += 1
        pos = len(req.tokens)
        t = [self.truth[i] if i < len(self.truth) else 0 for i in range(pos, pos + 3)]
        wrong = [(x + 1) % VOCAB for x in t]
        if self.calls % 3 == 0:
            return DraftTree(tokens=(wrong[0], wrong[0] ^ 1, 0, 0, 0, 0, 0), parents=(-1, 0, -1, -1, -1, -1, -1),
                             num_real=2)
        return DraftTree(tokens=(wrong[0], t[0], wrong[1], t[1], wrong[2], 0, 0),
                         parents=(-1, -1, 1, 1, 3, -1, -1), num_real=5)

    def observe(self, req, accepted):
        pass

    def release(self, req):
        pass

    def reset(self):
        pass

    def begin_round(self):
        pass


def _decode(decoder: Decoder, prompt: list[int], n: int, sampling=Sampling(temperature=0.0), seed=0) -> Request:
    req = Request(rid="t", prompt_ids=prompt, sampling=sampling, rules=StopRules(max_new_tokens=n), seed=seed)
    for _ in range(n + 1):  # every step emits a token: more steps than tokens = a stuck decoder
        if req.finished:
            break
        decoder.step(req)
    assert req.finished, "the decoder made no progress"
    return req


PROMPT = [5, 17, 42, 8, 77, 3, 19, 60, 11, 2]


def test_plain_decoding_matches_full_forward(model):
    runner = ModelRunner(model)
    req = _decode(Decoder(runner, _Tok(), None), PROMPT, 24)
    assert req.output_ids == _reference(model, PROMPT, 24)


def test_partly_wrong_trees_give_plain_greedy_output(model):
    truth = PROMPT + _reference(model, PROMPT, 24)
    spec = WrongTreeSpeculator(truth)
    req = _decode(Decoder(ModelRunner(model), _Tok(), spec), PROMPT, 24)
    assert req.output_ids == truth[len(PROMPT):]
    # rejections happened (all-wrong trees) and so did multi-token acceptance (depth-2 right chains)
    assert req.correct_histogram[0] > 0 and len(req.correct_histogram) >= 3
    surplus = 1 + req.spec_verify_ct + req.spec_num_correct_drafts - len(req.output_ids)
    # accepted drafts the length cap cut off at the last step still count, as SGLang counts them
    assert surplus == 0 or (surplus > 0 and req.finish_reason is not None and req.finish_reason["type"] == "length"), \
        surplus


@pytest.mark.parametrize("steps,topk,draft", [(3, 1, 4), (3, 2, 6), (2, 3, 9)])
def test_standalone_self_draft_is_lossless_and_accepts(model, steps, topk, draft):
    runner = ModelRunner(model)
    spec = StandaloneSpeculator(runner, steps, topk, draft)
    req = _decode(Decoder(runner, _Tok(), spec), PROMPT, 24)
    assert req.output_ids == _reference(model, PROMPT, 24)
    assert req.spec_num_correct_drafts > 0  # a model drafting for itself agrees with itself most of the time


def test_sampling_with_same_seed_is_identical_with_and_without_drafts(model):
    runner = ModelRunner(model)
    sampling = Sampling(temperature=0.9, top_p=0.95, top_k=50)
    plain = _decode(Decoder(runner, _Tok(), None), PROMPT, 20, sampling, seed=123)
    spec = StandaloneSpeculator(runner, 3, 2, 6)
    drafted = _decode(Decoder(runner, _Tok(), spec), PROMPT, 20, sampling, seed=123)
    assert drafted.output_ids == plain.output_ids
    other = _decode(Decoder(runner, _Tok(), None), PROMPT, 20, sampling, seed=124)
    assert other.output_ids != plain.output_ids


def test_keep_prunes_cache_to_prefix_plus_path(model):
    runner = ModelRunner(model)
    cache = runner.new_cache()
    runner.prefill(cache, PROMPT)
    base = runner.cache_len(cache)
    parents = [-1, 0, 0, 2]  # root, two children, a grandchild under the second
    runner.forward(cache, [1, 2, 3, 4], [base, base + 1, base + 1, base + 2], tree_visibility(base, parents))
    assert runner.cache_len(cache) == base + 4
    runner.keep(cache, base, [0, 2, 3])
    assert runner.cache_len(cache) == base + 3
    # the pruned cache continues exactly like a cache that only ever saw root, 3, 4
    fresh = runner.new_cache()
    runner.prefill(fresh, PROMPT + [1, 3, 4])
    for (k, v), (ref_k, ref_v) in zip(_kv(cache), _kv(fresh), strict=True):
        assert torch.allclose(k, ref_k, atol=1e-5) and torch.allclose(v, ref_v, atol=1e-5)


def _kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) [kv_heads, length, head_dim] of either cache kind."""
    if isinstance(cache, KVCache):
        n = cache.length
        return [(cache.keys[i, :, :n], cache.values[i, :, :n]) for i in range(cache.keys.shape[0])]
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def test_bfloat16_decodes_and_drafts():
    # not bit-exact against fp32 or against plain bf16 decoding (multi-token forwards round differently), so this
    # only checks that the bf16 path runs end to end and that a model drafting for itself gets drafts accepted
    model = _tiny("llama").to(torch.bfloat16)
    runner = ModelRunner(model)
    assert runner.dtype == torch.bfloat16
    req = _decode(Decoder(runner, _Tok(), StandaloneSpeculator(runner, 3, 1, 4)), PROMPT, 16)
    assert len(req.output_ids) == 16 and req.spec_num_correct_drafts > 0
