"""The acceptance replay on hand-made token streams whose accepted lengths are worked out by hand below (SGLang
0.5.23's NGRAM: a step inserts the window ending at its verify root, a round's inserts land when the next round
begins, BFS takes the most recent child)."""

from __future__ import annotations

import pytest

from pipeline.simulate.replay import Answer, ClosedLoop, OpenLoop, Phase, replay
from serve.ngram.drafttree import DraftTree, accepted_drafts
from serve.ngram.sam import SuffixAutomaton
from serve.spec import NgramSpec, NoSpec


def spec(**kw) -> NgramSpec:
    return NgramSpec(**{"max_bfs_breadth": 1, "capacity": 1000, **kw})


def measure(*answers: Answer, concurrency: int = 1) -> list[Phase]:
    return [Phase("measure", answers, ClosedLoop(concurrency))]


def test_a_repeating_output_is_drafted_once_it_has_been_inserted():
    # depth 4, 3 draft nodes. Steps 1-4 (tokens 5, 6, 7, 4) find nothing: each window was inserted one step late.
    # Step 5: the trie holds 4-5-6-7 (inserted at step 5's round start), so after the root 4 it drafts 5, 6, 7: all
    # accepted, plus the bonus 4. Step 6: the same chain, but only 3 tokens are left in the output.
    a = Answer((1, 2, 3), (4, 5, 6, 7) * 3)
    (r,) = replay(spec(num_draft_tokens=4, max_trie_depth=4), measure(a)).requests
    assert r.accepted_lengths == [1, 1, 1, 1, 4, 3]
    assert (r.spec_verify_ct, r.spec_num_correct_drafts) == (6, 5)
    assert 1 + sum(r.accepted_lengths) == len(a.output_ids)


def test_the_warm_up_fills_the_trie_and_the_last_accepted_block_is_never_inserted():
    # Warm-up 9 -> 1 2 3 4 5 inserts the windows [9 1], [9 1 2], [1 2 3] and, in the measurement's first round,
    # [2 3 4]; its last block (5) is never inserted. The measured request 8 -> 1 2 3 4 5 then drafts 2, 3 after its
    # root 1 (accepted, bonus 4); at the root 4 the trie has 4 only as a leaf: nothing to draft, bonus 5.
    warm = Answer((9,), (1, 2, 3, 4, 5))
    meas = Answer((8,), (1, 2, 3, 4, 5))
    phases = [Phase("warmup", (warm,), ClosedLoop(1)), Phase("measure", (meas,), ClosedLoop(1))]
    w, m = replay(spec(num_draft_tokens=4, max_trie_depth=3), phases).requests
    assert w.accepted_lengths == [1, 1, 1, 1]
    assert m.accepted_lengths == [3, 1]
    cold = replay(spec(num_draft_tokens=4, max_trie_depth=3), [phases[1]]).requests[0]
    assert cold.accepted_lengths == [1, 1, 1, 1]


def test_requests_of_one_round_draft_from_the_same_trie():
    # depth 2, 2 draft nodes. Two requests 1 -> 2 3 2 3 2 3 side by side: each round both draft before either
    # insert lands, so both go [1, 1, 2, 1]. One after the other, the second finds the first's text: [2, 2, 1].
    a = Answer((1,), (2, 3, 2, 3, 2, 3))
    together = replay(spec(num_draft_tokens=3, max_trie_depth=2), measure(a, a, concurrency=2)).requests
    assert [r.accepted_lengths for r in together] == [[1, 1, 2, 1], [1, 1, 2, 1]]
    assert [(r.admitted_round, r.finished_round) for r in together] == [(0, 4), (0, 4)]
    alone = replay(spec(num_draft_tokens=3, max_trie_depth=2), measure(a, a, concurrency=1)).requests
    assert [r.accepted_lengths for r in alone] == [[1, 1, 2, 1], [2, 2, 1]]


def test_a_pad_accepts_token_zero_as_the_engine_does():
    # A cold trie drafts only pads (token 0 under the root): when the next token is 0, the first pad is accepted.
    (r,) = replay(spec(num_draft_tokens=3, max_trie_depth=4), measure(Answer((5,), (7, 0, 9)))).requests
    assert r.accepted_lengths == [2]


def test_the_external_corpus_drafts_beside_a_cold_trie():
    # The corpus holds 1 2 3 4 5; with the whole budget (3 nodes) after the root 2 it drafts 3 4 5: accepted up to
    # the output's end (3 tokens left). Without the corpus a cold trie drafts nothing.
    sam = SuffixAutomaton()
    sam.append([1, 2, 3, 4, 5])
    sam.finalize()
    a = Answer((1,), (2, 3, 4, 5))
    with_corpus = spec(num_draft_tokens=4, max_trie_depth=4, external_corpus="c.jsonl", external_sam_budget=3)
    assert replay(with_corpus, measure(a), sams=[sam]).requests[0].accepted_lengths == [3]
    assert replay(with_corpus, measure(a)).requests[0].accepted_lengths == [1, 1, 1]  # no corpus loaded


def test_plain_decoding_steps_one_token_and_finishing_in_prefill_has_no_step():
    plain = replay(NoSpec(), measure(Answer((1,), (2, 3, 4)), Answer((1,), (5,)))).requests
    assert [r.accepted_lengths for r in plain] == [[1, 1], []]


def test_the_walk_takes_the_first_sibling_and_stops_at_a_mismatch():
    # root -> 5 (0), root -> 5 (1, a duplicate the walk never reaches), 5 -> 6 (2), 6 -> 7 (3)
    tree = DraftTree(tokens=(5, 5, 6, 7), parents=(-1, -1, 0, 2), num_real=4)
    assert accepted_drafts(tree, [5, 6, 7, 8]) == 3
    assert accepted_drafts(tree, [5, 6, 9]) == 2
    assert accepted_drafts(tree, [4]) == 0


def test_max_running_queues_the_rest_and_open_loop_needs_a_cost():
    a = Answer((1,), (2, 3))
    rows = replay(NoSpec(), measure(a, a, a, concurrency=3), max_running=1).requests
    assert [r.admitted_round for r in rows] == [0, 2, 4]
    with pytest.raises(ValueError, match="round cost"):
        replay(NoSpec(), [Phase("measure", (a,), OpenLoop((0.0,)))])
    timed = replay(NoSpec(), [Phase("measure", (a, a), OpenLoop((0.0, 5.0)))], cost=lambda r: 0.5).requests
    # the second arrives after the first finished: the engine idles until 5 s
    assert [(r.arrival_s, r.first_token_s, r.finished_s) for r in timed] == [(0.0, 0.5, 1.0), (5.0, 5.5, 6.0)]
