"""The STANDALONE tree construction (`serve.draft.tree`) and the draft replay's accepted lengths
(`serve.draft.acceptance`) on a synthetic draft model: a pure function from a token context to log-probs, with
logits rounded to one decimal so that equal scores (the tie-break by creation order) occur.

The reference is the engine's procedure written out in full: every frontier node forwarded at every step, the tree
pruned to num_draft_tokens - 1 nodes, and the greedy walk along the target's tokens. The replay forwards only the
nodes it needs and derives every (num_steps, num_draft_tokens) point of a topk from one build; it must give the same
accepted drafts for every point, and forward fewer nodes."""

from __future__ import annotations

import math
import random

import pytest

from serve.ngram.drafttree import accepted_drafts
from serve.draft.acceptance import RoundTree, accepted, candidates, tree_nodes
from serve.draft.tree import TreeBuild, prune

VOCAB = 9


def expansion(context: tuple[int, ...], k: int) -> list[tuple[int, float]]:
    rng = random.Random(hash(context))
    logits = [round(rng.gauss(0.0, 2.0), 1) for _ in range(VOCAB)]
    top = max(logits)
    norm = top + math.log(sum(math.exp(x - top) for x in logits))
    ranked = sorted(range(VOCAB), key=lambda t: (-logits[t], t))[:k]
    return [(t, logits[t] - norm) for t in ranked]


def full_build(committed: tuple[int, ...], steps: int, k: int) -> tuple[TreeBuild, int]:
    """The engine's procedure: every frontier node expanded in its own context. Returns the build and how many
    frontier nodes were forwarded."""
    build = TreeBuild(k)
    build.offer([expansion(committed, k)])
    forwarded = 0
    for _ in range(1, steps):
        rows = []
        for f in build.advance():
            path = []
            node = f
            while node >= 0:
                path.append(build.tokens[node])
                node = build.parents[node]
            rows.append(expansion(committed + tuple(reversed(path)), k))
            forwarded += 1
        build.offer(rows)
    return build, forwarded


def replayed(committed: tuple[int, ...], continuation: tuple[int, ...], max_steps: int, k: int
             ) -> tuple[RoundTree, int]:
    chain = [expansion(committed + continuation[:i], k) for i in range(min(max_steps, len(continuation)))]
    tree = RoundTree(k, max_steps, continuation, chain)
    forwarded = 0
    while not tree.done:
        rows = []
        for want in tree.wants:
            assert want.ancestors == tuple(sorted(want.ancestors))  # root side first
            context = committed + continuation[:want.prefix] + tuple(
                tree.build.tokens[a] for a in want.ancestors) + (want.token,)
            rows.append(expansion(context, k))
        forwarded += len(rows)
        tree.give(rows)
    return tree, forwarded


def greedy_continuation(committed: tuple[int, ...], length: int, noise: random.Random, miss: float) -> tuple[int, ...]:
    """What a target close to the draft emits: the draft's argmax, or its 2nd/3rd choice or a random token."""
    out: list[int] = []
    for _ in range(length):
        top = expansion(committed + tuple(out), 3)
        r = noise.random()
        token = top[0][0] if r > miss else (top[1][0] if r > miss / 2 else noise.randrange(VOCAB))
        out.append(token)
    return tuple(out)


def test_a_tree_keeps_the_best_candidates_and_breaks_ties_by_creation_order():
    build = TreeBuild(2)
    build.offer([[(5, -0.1), (6, -1.0)]])
    assert build.advance() == [0, 1]
    build.offer([[(7, -0.9), (8, -2.0)], [(9, 0.0), (3, -0.5)]])  # node 4 (9) ties node 1 at -1.0
    assert build.scores == [-0.1, -1.0, -1.0, -2.1, -1.0, -1.5]
    tree, keep = build.prune(4)
    assert keep == [0, 1, 2]  # -1.0 three times: nodes 1 and 2 come before node 4
    assert (tree.tokens, tree.parents) == ((5, 6, 7), (-1, -1, 0))
    tree, keep = prune(build.tokens, build.parents, build.scores, 5)
    assert keep == [0, 1, 2, 4] and tree.parents == (-1, -1, 0, 1)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_replayed_accepts_equal_the_full_tree_for_every_point(k):
    noise = random.Random(k)
    max_steps, compared, saved, accepting = 6, 0, 0, 0
    for case in range(60):
        committed = tuple(noise.randrange(VOCAB) for _ in range(noise.randint(1, 6)))
        length = noise.randint(1, 8)
        continuation = greedy_continuation(committed, length, noise, miss=[0.1, 0.4, 0.9][case % 3])
        tree, lazy_forwards = replayed(committed, continuation, max_steps, k)
        ranks = tree.ranks()
        full_forwards = 0
        for steps in range(1, max_steps + 1):
            build, forwarded = full_build(committed, steps, k)
            assert len(build.tokens) == candidates(steps, k)
            full_forwards = forwarded
            for num_draft_tokens in range(2, min(steps * k + 1, 16) + 1):
                draft_tree, _ = build.prune(num_draft_tokens)
                assert draft_tree.num_real == tree_nodes(steps, k, num_draft_tokens)
                want = accepted_drafts(draft_tree, continuation)
                got = accepted(ranks, steps, num_draft_tokens)
                assert got == want, (case, steps, k, num_draft_tokens, committed, continuation)
                compared += 1
                accepting += want > 1
        saved += full_forwards - lazy_forwards
        assert lazy_forwards <= full_forwards
    assert compared > 300 and accepting > 20  # long accepted paths were compared, not just misses
    assert saved > (0 if k == 1 else 100)  # and the replay forwarded fewer nodes
