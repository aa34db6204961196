"""A scheduler round as one batched forward (`Decoder.step_many`, `LlamaForward.forward_many`) on tiny random models
(no download): the same tokens as stepping each request alone, requests joining mid-way (a prefill and verify steps
in one round), one failing request failing alone, and HF-module models (Gemma 3) stepping one by one."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from serve.engines.cpu.decode import Decoder, Request, StepStats, StopRules
from serve.ngram.trie import DraftTree
from serve.engines.cpu.runner import ModelRunner, tree_visibility
from serve.engines.cpu.scheduler import Scheduler
from serve.engines.cpu.verify import Sampling

VOCAB = 97
PROMPTS = [[5, 17, 42, 8, 77, 3, 19, 60, 11, 2], [9, 9, 4], [33, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
           [70, 71]]


def _tiny(kind: str):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    common: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
    return Gemma3ForCausalLM(Gemma3TextConfig(**common, sliding_window=4, layer_types=layer_types)).eval()


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def llama():
    return _tiny("llama")


class EchoTrees:
    """Drafts a small tree from the request's own history (the token that followed the last token's previous
    occurrence, a wrong sibling, a pad): some drafts are right, most are not, and trees differ per request."""

    num_draft_tokens = 4

    def __init__(self, fail_for: str | None = None) -> None:
        self.fail_for = fail_for

    def propose(self, req: Request) -> DraftTree:
        if req.rid == self.fail_for:
            raise ValueError(f"no draft for {req.rid}")
        tokens = req.tokens
        last = tokens[-1]
        guess = next((tokens[i + 1] for i in range(len(tokens) - 2, -1, -1) if tokens[i] == last), (last + 1) % VOCAB)
        return DraftTree(tokens=(guess, (guess + 1) % VOCAB, guess, 0), parents=(-1, -1, 0, -1), num_real=3)

    def observe(self, req, accepted):
        pass

    def release(self, req):
        pass

    def reset(self):
        pass

    def begin_round(self):
        pass


class _Tok:
    def decode(self, ids, **_):
        return " ".join(map(str, ids))


def _request(i: int, new_tokens: int = 20) -> Request:
    return Request(rid=f"r{i}", prompt_ids=PROMPTS[i], sampling=Sampling(temperature=0.0),
                   rules=StopRules(max_new_tokens=new_tokens), seed=0)


def _alone(model, speculator, i: int, new_tokens: int = 20) -> list[int]:
    decoder = Decoder(ModelRunner(model), _Tok(), speculator)
    req = _request(i, new_tokens)
    for _ in range(new_tokens + 1):  # every step emits a token: more steps than tokens = a stuck decoder
        if req.finished:
            break
        decoder.step(req)
    assert req.finished, "the decoder made no progress"
    return req.output_ids


def _rounds(decoder: Decoder, reqs: list[Request], join_at: dict[int, int]) -> list[list[StepStats | Exception]]:
    """Step all live requests together each round; request i joins at round join_at.get(i, 0)."""
    rounds = []
    r = 0
    while any(not q.finished for q in reqs):
        live = [q for i, q in enumerate(reqs) if join_at.get(i, 0) <= r and not q.finished]
        rounds.append(decoder.step_many(live))
        r += 1
    return rounds


def test_forward_many_equals_one_forward_per_request(llama):
    runner = ModelRunner(llama)
    assert runner.batches
    caches = [runner.new_cache() for _ in PROMPTS[:3]]
    twins = [runner.new_cache() for _ in PROMPTS[:3]]
    for cache, twin, prompt in zip(caches, twins, PROMPTS):
        runner.prefill(cache, prompt)
        runner.prefill(twin, prompt)
    items: list[tuple[Any, list[int], list[int], torch.Tensor]] = []  # forward_many's (cache, ids, positions, visible)
    for cache, prompt in zip(caches, PROMPTS):  # a chain of 1, a tree of 3, a chain of 5: different sizes and bases
        n = len(items) * 2 + 1
        parents = [-1, *range(n - 1)] if n != 3 else [-1, 0, 0]
        base = len(prompt)
        items.append((cache, [(7 * k + base) % VOCAB for k in range(n)], [base + k for k in range(n)],
                      tree_visibility(base, parents)))
    batched = runner.forward_many(items)
    for (cache, ids, pos, visible), twin, hidden in zip(items, twins, batched):
        alone = runner.forward(twin, ids, pos, visible)
        assert hidden.shape == alone.shape
        torch.testing.assert_close(hidden, alone, rtol=1e-5, atol=1e-5)
        assert cache.length == twin.length
        torch.testing.assert_close(cache.keys[:, :, :cache.length], twin.keys[:, :, :twin.length])


@pytest.mark.parametrize("kind", ["llama", "gemma3-sliding"])
def test_a_batched_round_decodes_what_each_request_decodes_alone(kind, llama):
    model = llama if kind == "llama" else _tiny(kind)
    expected = [_alone(model, EchoTrees(), i) for i in range(len(PROMPTS))]
    decoder = Decoder(ModelRunner(model), _Tok(), EchoTrees())
    reqs = [_request(i) for i in range(len(PROMPTS))]
    rounds = _rounds(decoder, reqs, join_at={2: 3, 3: 5})  # r2 and r3 prefill while r0 and r1 verify
    assert [q.output_ids for q in reqs] == expected
    assert all(not isinstance(result, Exception) for results in rounds for result in results)
    assert any(len(results) == 4 for results in rounds)  # four requests did share a round
    accepted = sum(q.spec_num_correct_drafts for q in reqs)
    assert accepted > 0  # drafts were accepted in batched rounds, not only rejected
    for q in reqs:
        surplus = 1 + q.spec_verify_ct + q.spec_num_correct_drafts - len(q.output_ids)
        # accepted drafts the length cap cut off at the last step still count, as SGLang counts them
        assert surplus == 0 or (surplus > 0 and q.finish_reason is not None and q.finish_reason["type"] == "length"), \
            surplus


def test_plain_decode_batched_equals_alone(llama):
    expected = [_alone(llama, None, i, 12) for i in range(len(PROMPTS))]
    decoder = Decoder(ModelRunner(llama), _Tok(), None)
    reqs = [_request(i, 12) for i in range(len(PROMPTS))]
    _rounds(decoder, reqs, join_at={})
    assert [q.output_ids for q in reqs] == expected


def test_a_request_whose_step_raises_fails_alone(llama):
    expected = [_alone(llama, EchoTrees(), i) for i in (0, 2)]
    decoder = Decoder(ModelRunner(llama), _Tok(), EchoTrees(fail_for="r1"))
    reqs = [_request(i) for i in (0, 1, 2)]
    first = decoder.step_many(reqs)  # prefills: no draft yet, all fine
    assert all(isinstance(r, StepStats) for r in first)
    second = decoder.step_many(reqs)
    assert isinstance(second[1], ValueError) and "no draft for r1" in str(second[1])
    assert isinstance(second[0], StepStats) and isinstance(second[2], StepStats)
    live = [reqs[0], reqs[2]]
    while any(not q.finished for q in live):
        decoder.step_many([q for q in live if not q.finished])
    assert [q.output_ids for q in live] == expected


def test_a_failing_batched_forward_retries_each_request_alone(llama):
    class Flaky(ModelRunner):
        def forward_many(self, items):
            raise RuntimeError("batched forward broke")

    expected = [_alone(llama, EchoTrees(), i) for i in range(3)]
    decoder = Decoder(Flaky(llama), _Tok(), EchoTrees())
    reqs = [_request(i) for i in range(3)]
    _rounds(decoder, reqs, join_at={})
    assert [q.output_ids for q in reqs] == expected


def test_the_scheduler_steps_a_round_in_one_call():
    class Recorder:
        speculator = None

        def __init__(self) -> None:
            self.calls: list[list[str]] = []
            self.gate = threading.Event()

        def step_many(self, reqs):
            self.gate.wait(10)
            self.calls.append([q.rid for q in reqs])
            out = []
            for q in reqs:
                q.output_ids.append(1)
                if len(q.output_ids) >= 2:
                    q.finish_reason = {"type": "length", "length": 2}
                out.append(StepStats(verify=len(q.output_ids) > 1, emitted=1, proposed=0))
            return out

        def release(self, req):
            pass

    decoder = Recorder()
    sched = Scheduler(decoder, 8)
    done = threading.Event()
    left = {"a", "b", "c"}

    def sink(req, error):
        assert error is None
        if req.finished:
            left.discard(req.rid)
            if not left:
                done.set()

    for rid in ("a", "b", "c"):
        sched.submit(Request(rid=rid, prompt_ids=[1], sampling=Sampling(), rules=StopRules(max_new_tokens=2), seed=0),
                     sink)
    sched.start()
    decoder.gate.set()
    assert done.wait(10)
    sched.stop()
    assert decoder.calls == [["a", "b", "c"], ["a", "b", "c"]]
