"""The acceptance simulator is exact for the CPU engine: the real scheduler (its worker thread, FIFO admission,
rounds of batched verify steps, SGLang's NGRAM schedule) drives the real SmolLM2-135M through a warm-up and a
measurement, closed loop, and every request's per-step accepted lengths -- read by the request's sink after each of
its steps -- equal the simulator's replay of the baseline's answers, at concurrency 1 and 3, for BFS, and for PROB
with LRU eviction and an external corpus. At concurrency 3 a sequential replay of the same traffic does not match,
so the rounds are what is tested. The clients submit a request's successor from its last step (lag 0 rounds), which
is what the simulator's ClosedLoop(c, lag=0) models."""

from __future__ import annotations

import json

import pytest

from pipeline.simulate.replay import Answer, ClosedLoop, Phase, replay
from pipeline.simulate.workload import corpus_automaton
from pipeline.workloads import load_workload
from serve.engines.cpu.engine import encoder_of
from serve.engines.cpu.runner import ModelRunner
from serve.engines.cpu.speculators import NgramSpeculator
from serve.ngram.corpus import ExternalCorpora
from serve.ngram.trie import NgramCache
from serve.spec import NgramSpec, NoSpec
from tests.engine_runs import engine_run

pytestmark = pytest.mark.integration

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def runner(smol):
    return ModelRunner(smol[0])


@pytest.fixture(scope="module")
def prompts(smol):
    tokenizer = smol[1]
    work = load_workload("templated", seed=0, n_warmup=5, n_measure=5, max_new_tokens=NEW_TOKENS)
    return ([tokenizer.encode(p.text) for p in work.warmup], [tokenizer.encode(p.text) for p in work.measure])


def _speculator(spec: NgramSpec, sams_docs: list[str] | None, tokenizer):
    cache = NgramCache(max_trie_depth=spec.max_trie_depth, capacity=spec.capacity,
                       min_bfs_breadth=spec.min_bfs_breadth, max_bfs_breadth=spec.max_bfs_breadth,
                       match_type=spec.match_type, num_draft_tokens=spec.num_draft_tokens)
    corpora = None
    if sams_docs is not None:
        corpora = ExternalCorpora(10_000_000)
        corpora.add_documents("c", sams_docs, encoder_of(tokenizer))
    return NgramSpeculator(cache, spec.num_draft_tokens, spec.max_trie_depth, corpora=corpora,
                           external_sam_budget=spec.external_sam_budget)


CASES = [
    (1, NgramSpec(num_draft_tokens=8, max_bfs_breadth=2, max_trie_depth=12, capacity=100_000), False),
    (3, NgramSpec(num_draft_tokens=8, max_bfs_breadth=2, max_trie_depth=12, capacity=100_000), False),
    # PROB, a trie small enough to evict (match states rebuilt), and the corpus drafting beside it
    (3, NgramSpec(num_draft_tokens=6, max_bfs_breadth=3, match_type="PROB", max_trie_depth=8, capacity=300,
                  external_corpus="c.jsonl", external_sam_budget=2), True),
]


def test_simulated_accept_lengths_equal_the_engine_s_step_for_step(runner, smol, prompts, tmp_path):
    tokenizer = smol[1]
    warmup, measure = prompts
    phases = [warmup, measure]
    baseline, _ = engine_run(runner, tokenizer, None, phases, concurrency=1, max_new_tokens=NEW_TOKENS)
    answers = [[Answer(tuple(p), tuple(baseline[(i, j)])) for j, p in enumerate(items)]
               for i, items in enumerate(phases)]
    docs = [tokenizer.decode(p) for p in warmup]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))
    sam = corpus_automaton(corpus, encoder_of(tokenizer), 10_000_000)
    plain = replay(NoSpec(), [Phase("warmup", tuple(answers[0]), ClosedLoop(1)),
                              Phase("measure", tuple(answers[1]), ClosedLoop(1))])
    assert all(r.accepted_lengths == [1] * (r.completion_tokens - 1) for r in plain.requests)
    compared = 0
    for concurrency, spec, with_corpus in CASES:
        outputs, seen = engine_run(runner, tokenizer, _speculator(spec, docs if with_corpus else None, tokenizer),
                                   phases, concurrency, max_new_tokens=NEW_TOKENS)
        assert outputs == baseline  # lossless: the premise of the simulator
        simulated = replay(spec, [Phase("warmup", tuple(answers[0]), ClosedLoop(concurrency)),
                                  Phase("measure", tuple(answers[1]), ClosedLoop(concurrency))],
                           sams=[sam] if with_corpus else ())
        for r in simulated.requests:
            key = (0 if r.phase == "warmup" else 1, r.position)
            assert r.accepted_lengths == seen[key], f"{spec} at concurrency {concurrency}, request {key}"
        compared += sum(r.spec_num_correct_drafts for r in simulated.requests)
        if concurrency > 1 and not with_corpus:  # the rounds matter here: one request at a time drafts otherwise
            sequential = replay(spec, [Phase("warmup", tuple(answers[0]), ClosedLoop(1)),
                                       Phase("measure", tuple(answers[1]), ClosedLoop(1))])
            assert any(r.accepted_lengths != seen[(0 if r.phase == "warmup" else 1, r.position)]
                       for r in sequential.requests)
    assert compared > 0  # the cases accepted drafts: the comparison covered more than bonus tokens
