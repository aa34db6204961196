"""The draft replay is exact for the CPU engine's STANDALONE: the real scheduler (worker thread, rounds) drives the
real SmolLM2-135M target with a real draft model through a measurement at concurrency 1, and every request's
per-step accepted lengths -- read by the request's sink after each step -- equal the simulator's replay of the
baseline's answers from the draft replay's tables (`serve.engines.cpu.draft_replay`, the draft model only, never
the target), for 5 and 4 (num_steps, topk, num_draft_tokens) points with steps 1-4 and topk 1-4, from one replay
per pair: a chain, a wide tree and trees cut below their size for each pair, plus the self-draft's longest chain. Each
point is one engine run of 7-14 s of CPU here, so the points are the fewest that still reach every step count and
every topk (the replay and the engine share one code path per point, not per value), and the requests are two: at
concurrency 1 a standalone draft keeps nothing from one request to the next, so a third was the same comparison
again (a third of every run), and two still cross a request boundary in the scheduler.

Two pairs, both from the model store's SmolLM2-135M package: the model drafting for itself (the pair of the engine's
STANDALONE server tests: long accepted paths, where the tree's cut decides), and its first 20 of 30 layers drafting
for the whole model (a draft that often disagrees: short and varied paths, off-path subtrees forwarded)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from pipeline.search.draft_replay import tables_of
from pipeline.simulate.replay import Answer, ClosedLoop, Phase, replay
from pipeline.workloads import load_workload
from serve.engines.cpu.draft_replay import ReplayStats, replay_answers
from serve.engines.cpu.runner import ModelRunner
from serve.engines.cpu.speculators import StandaloneSpeculator
from serve.spec import StandaloneSpec
from tests.engine_runs import engine_run

pytestmark = pytest.mark.integration

NEW_TOKENS = 16
DRAFT_LAYERS = 20
PAIRS = {
    "self": [(1, 1, 2), (4, 1, 5), (2, 2, 3), (3, 3, 7), (4, 4, 5)],
    f"first-{DRAFT_LAYERS}-layers": [(3, 1, 4), (2, 2, 5), (3, 3, 4), (2, 4, 6)],
}


@pytest.fixture(scope="module")
def runner(smol):
    return ModelRunner(smol[0])


def first_layers(runner: ModelRunner, layers: int) -> ModelRunner:
    """A draft made of the model's first `layers` layers, its final norm and its head (the same weights)."""
    assert runner.fast is not None, "the draft is cut from the fast forward's layers"
    fast = copy.copy(runner.fast)
    fast.layers = fast.layers[:layers]
    fast.shape = dataclasses.replace(fast.shape, num_layers=layers)
    return ModelRunner(fast)


@pytest.fixture(scope="module")
def prompts(smol):
    work = load_workload("templated", seed=0, n_warmup=0, n_measure=2, max_new_tokens=NEW_TOKENS)
    return [smol[1].encode(p.text) for p in work.measure]


@pytest.fixture(scope="module")
def baseline(runner, smol, prompts):
    """The target's plain answers, which both pairs replay (one target)."""
    return engine_run(runner, smol[1], None, [prompts], concurrency=1, max_new_tokens=NEW_TOKENS)[0]


@pytest.mark.parametrize("pair", list(PAIRS))
def test_replayed_accept_lengths_equal_the_engine_s_request_by_request(runner, smol, prompts, baseline, pair):
    tokenizer = smol[1]
    draft = runner if pair == "self" else first_layers(runner, DRAFT_LAYERS)
    answers = [Answer(tuple(p), tuple(baseline[(0, i)])) for i, p in enumerate(prompts)]
    stats = ReplayStats()
    ranks = replay_answers(draft, [(a.prompt_ids, a.output_ids) for a in answers], [1, 2, 3, 4], 4, stats=stats)
    tables = tables_of("draft", answers, 4, {"answers": [{str(k): v for k, v in per.items()} for per in ranks]})
    lengths: set[int] = set()
    for steps, topk, draft_tokens in PAIRS[pair]:
        spec = StandaloneSpec(draft_model="draft", num_steps=steps, topk=topk, num_draft_tokens=draft_tokens)
        outputs, seen = engine_run(runner, tokenizer, StandaloneSpeculator(draft, steps, topk, draft_tokens),
                                   [prompts], concurrency=1, max_new_tokens=NEW_TOKENS)
        assert outputs == baseline  # lossless: the premise of the replay
        simulated = replay(spec, [Phase("measure", tuple(answers), ClosedLoop(1))], drafts=tables)
        for r in simulated.requests:
            assert r.accepted_lengths == seen[(0, r.position)], f"{pair} {spec}, request {r.position}"
            lengths.update(r.accepted_lengths)
    # the comparison covered short and long accepted paths; the weaker draft's off-path nodes were forwarded, and
    # the replay skipped most of the trees' forwards
    assert min(lengths) == 1 and max(lengths) >= (4 if pair == "self" else 2)
    assert 0 < stats.tree_rows < stats.rounds
