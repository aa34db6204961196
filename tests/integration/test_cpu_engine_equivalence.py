"""Greedy speculative decoding on the real SmolLM2-135M (fp32) is token-identical to plain decoding, for NGRAM
(BFS/PROB, small and large trees, cold and warm trie), STANDALONE (the model drafting for itself, chains and trees),
and for trees that are partly wrong on purpose. Runs in-process on the engine's decoder (no HTTP)."""

from __future__ import annotations

import pytest

from serve.engines.cpu.decode import Decoder, Request, StopRules
from serve.engines.cpu.engine import eos_ids_of
from serve.ngram.trie import DraftTree, NgramCache
from serve.engines.cpu.runner import ModelRunner
from serve.engines.cpu.speculators import NgramSpeculator, StandaloneSpeculator
from serve.engines.cpu.verify import Sampling

pytestmark = pytest.mark.integration

PROMPTS = [
    "List the days of the week, one per line:\nMonday\nTuesday\n",
    "def fib(n):\n    if n < 2:\n        return n\n",
    "The history of the printing press begins",
]
NEW_TOKENS = 24
GREEDY = Sampling(temperature=0.0)


@pytest.fixture(scope="module")
def runner(smol):
    return ModelRunner(smol[0])


@pytest.fixture(scope="module")
def tokenizer(smol):
    return smol[1]


def _run(decoder: Decoder, tokenizer, prompt: str, sampling=GREEDY, seed=0, stop=()) -> Request:
    rules = StopRules(max_new_tokens=NEW_TOKENS, eos_ids=eos_ids_of(decoder.runner.model, tokenizer),
                      stop_strs=tuple(stop), stop_str_max_tokens=8)
    req = Request(rid="t", prompt_ids=tokenizer.encode(prompt), sampling=sampling, rules=rules, seed=seed)
    for _ in range(NEW_TOKENS + 1):  # every step emits a token: more steps than tokens = a stuck decoder
        if req.finished:
            break
        decoder.step(req)
    assert req.finished, "the decoder made no progress"
    decoder.release(req)
    return req


@pytest.fixture(scope="module")
def plain(runner, tokenizer) -> dict[str, list[int]]:
    decoder = Decoder(runner, tokenizer, None)
    return {p: _run(decoder, tokenizer, p).output_ids for p in PROMPTS}


def _counters_consistent(req: Request) -> None:
    # Drafts accepted in the last step count even where a stop rule cut them off (as SGLang counts them).
    cut = 1 + req.spec_verify_ct + req.spec_num_correct_drafts - len(req.output_ids)
    assert 0 <= cut <= len(req.correct_histogram) - 1
    meta = req.meta_info(True, 8)
    assert meta["spec_accept_length"] == pytest.approx(meta["completion_tokens"] / meta["spec_verify_ct"])


NGRAM_CONFIGS = [
    dict(match_type="BFS", num_draft_tokens=4, max_bfs_breadth=10),
    dict(match_type="BFS", num_draft_tokens=16, max_bfs_breadth=4),
    dict(match_type="PROB", num_draft_tokens=8, max_bfs_breadth=10),
]


@pytest.mark.parametrize("cfg", NGRAM_CONFIGS, ids=lambda c: f"{c['match_type']}-{c['num_draft_tokens']}")
def test_ngram_greedy_is_identical_cold_and_warm(runner, tokenizer, plain, cfg):
    cache = NgramCache(max_trie_depth=18, capacity=100_000, min_bfs_breadth=1, **cfg)
    decoder = Decoder(runner, tokenizer, NgramSpeculator(cache, cfg["num_draft_tokens"], 18))
    cold = [_run(decoder, tokenizer, p) for p in PROMPTS]
    warm = [_run(decoder, tokenizer, p) for p in PROMPTS]  # the same workload again: the trie holds its outputs
    for p, c, w in zip(PROMPTS, cold, warm):
        assert c.output_ids == plain[p], f"cold trie diverged on {p!r}"
        assert w.output_ids == plain[p], f"warm trie diverged on {p!r}"
        _counters_consistent(c)
        _counters_consistent(w)
    # every verify step checks the full tree: num_draft_tokens - 1 nodes, pads included (SGLang)
    assert all(r.spec_num_proposed_drafts == r.spec_verify_ct * (cfg["num_draft_tokens"] - 1) for r in cold + warm)
    # a warm trie has seen these very outputs, so it drafts them
    assert sum(r.spec_num_correct_drafts for r in warm) > sum(r.spec_num_correct_drafts for r in cold)


@pytest.mark.parametrize("steps,topk,draft", [(3, 1, 4), (2, 3, 7)])
def test_standalone_self_draft_is_identical(runner, tokenizer, plain, steps, topk, draft):
    decoder = Decoder(runner, tokenizer, StandaloneSpeculator(runner, steps, topk, draft))
    for p in PROMPTS:
        req = _run(decoder, tokenizer, p)
        assert req.output_ids == plain[p]
        _counters_consistent(req)
        assert req.spec_num_proposed_drafts == req.spec_verify_ct * (draft - 1)
        assert req.spec_num_correct_drafts > 0


class _WrongTrees:
    """Proposes the true next tokens mixed with wrong siblings and a wrong third level, pads at the end, and on every
    third step nothing right at all; it knows the truth from the plain run."""

    num_draft_tokens = 8

    def __init__(self, truth: list[int]) -> None:
        self.truth, self.calls = truth, 0

    def propose(self, req):
        self.calls += 1
        t = (self.truth + [0, 0, 0])[len(req.tokens):len(req.tokens) + 3]
        w = [x + 1 for x in t]
        if self.calls % 3 == 0:
            return DraftTree(tokens=(w[0], w[1], 0, 0, 0, 0, 0), parents=(-1, 0, -1, -1, -1, -1, -1), num_real=2)
        return DraftTree(tokens=(w[0], t[0], w[1], t[1], w[2], 0, 0), parents=(-1, -1, 1, 1, 3, -1, -1), num_real=5)

    def observe(self, req, accepted):
        pass

    def release(self, req):
        pass

    def reset(self):
        pass

    def begin_round(self):
        pass


def test_partly_wrong_trees_are_rejected_exactly(runner, tokenizer, plain):
    for p in PROMPTS:
        truth = tokenizer.encode(p) + plain[p]
        req = _run(Decoder(runner, tokenizer, _WrongTrees(truth)), tokenizer, p)
        assert req.output_ids == plain[p]
        _counters_consistent(req)
        assert req.correct_histogram[0] > 0  # whole trees rejected
        assert len(req.correct_histogram) >= 3  # two drafts accepted in one step


def test_sampling_with_a_seed_is_the_same_with_drafts(runner, tokenizer):
    sampling = Sampling(temperature=0.8, top_p=0.95)
    p = PROMPTS[2]
    plain = _run(Decoder(runner, tokenizer, None), tokenizer, p, sampling, seed=11)
    cache = NgramCache(max_trie_depth=18, capacity=100_000, min_bfs_breadth=1, max_bfs_breadth=4, match_type="BFS",
                       num_draft_tokens=8)
    decoder = Decoder(runner, tokenizer, NgramSpeculator(cache, 8, 18))
    first = _run(decoder, tokenizer, p, sampling, seed=11)
    again = _run(decoder, tokenizer, p, sampling, seed=11)  # warm: drafts now come from `first`
    assert first.output_ids == plain.output_ids and again.output_ids == plain.output_ids
    assert again.spec_num_correct_drafts > 0


def test_stop_string_cuts_speculative_output_where_plain_stops(runner, tokenizer, plain):
    p = PROMPTS[0]
    text = tokenizer.decode(plain[p])
    stop = text.strip().split("\n")[1]  # a later line of the plain output
    ref = _run(Decoder(runner, tokenizer, None), tokenizer, p, stop=[stop])
    assert ref.finish_reason == {"type": "stop", "matched": stop}
    cache = NgramCache(max_trie_depth=18, capacity=100_000, min_bfs_breadth=1, max_bfs_breadth=10, match_type="BFS",
                       num_draft_tokens=8)
    decoder = Decoder(runner, tokenizer, NgramSpeculator(cache, 8, 18))
    _run(decoder, tokenizer, p)  # warm the trie so that the stop falls inside an accepted run
    spec = _run(decoder, tokenizer, p, stop=[stop])
    assert spec.output_ids == ref.output_ids and spec.finish_reason == ref.finish_reason
    _counters_consistent(spec)


@pytest.mark.parametrize("algorithm", ["none", "ngram", "standalone"])
def test_requests_stepped_together_decode_what_each_decodes_alone(runner, tokenizer, plain, algorithm):
    # The scheduler's rounds: every running request's verify step in one batched forward (Decoder.step_many).
    speculator: NgramSpeculator | StandaloneSpeculator | None = None
    if algorithm == "ngram":
        cache = NgramCache(max_trie_depth=18, capacity=100_000, min_bfs_breadth=1, match_type="BFS",
                           num_draft_tokens=8, max_bfs_breadth=4)
        speculator = NgramSpeculator(cache, 8, 18)
    elif algorithm == "standalone":
        speculator = StandaloneSpeculator(runner, 2, 3, 7)
    decoder = Decoder(runner, tokenizer, speculator)
    eos = eos_ids_of(runner.model, tokenizer)
    reqs = [Request(rid=str(i), prompt_ids=tokenizer.encode(p), sampling=GREEDY,
                    rules=StopRules(max_new_tokens=NEW_TOKENS, eos_ids=eos), seed=0) for i, p in enumerate(PROMPTS)]
    rounds = 0
    while any(not r.finished for r in reqs):
        decoder.begin_round()
        results = decoder.step_many([r for r in reqs if not r.finished])
        assert not [r for r in results if isinstance(r, Exception)]
        rounds += 1
    assert [r.output_ids for r in reqs] == [plain[p] for p in PROMPTS]
    assert rounds < 3 * NEW_TOKENS  # they did share rounds
    if speculator is not None:
        for r in reqs:
            _counters_consistent(r)
