"""NgramCache: SGLang 0.5.23's global n-gram trie. Expected trees below are derived by hand from the semantics in
the module docstring (and SGLang's trie.cpp), never by re-running the algorithm."""

from __future__ import annotations

import random
from typing import Any

import pytest

from serve.ngram.trie import DraftTree, NgramCache


def make(**overrides: Any) -> NgramCache:
    cfg: dict[str, Any] = dict(max_trie_depth=18, capacity=100_000, min_bfs_breadth=1, max_bfs_breadth=10,
                               match_type="BFS", num_draft_tokens=12)
    cfg.update(overrides)
    return NgramCache(**cfg)


def real_paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Root-to-node token paths of the trie nodes (pads left out): the tree's content, whatever its node order."""
    paths: list[tuple[int, ...]] = []
    for tok, parent in zip(tree.tokens, tree.parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
    return set(paths[: tree.num_real])


# ----------------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (
            dict(min_bfs_breadth=4, max_bfs_breadth=2),
            ["min_bfs_breadth <= max_bfs_breadth", "min_bfs_breadth=4", "max_bfs_breadth=2"],
        ),
        (dict(max_trie_depth=1, capacity=10), ["max_trie_depth", "max_trie_depth=1"]),
        (dict(max_trie_depth=18, capacity=18), ["capacity > max_trie_depth", "capacity=18", "max_trie_depth=18"]),
        (dict(num_draft_tokens=0), ["num_draft_tokens", "num_draft_tokens=0"]),
        (dict(min_bfs_breadth=0), ["min_bfs_breadth", "min_bfs_breadth=0"]),
        (dict(match_type="bfs"), ["match_type", "'bfs'"]),
        (dict(capacity=True), ["capacity", "int"]),
        (dict(max_trie_depth=4.0), ["max_trie_depth", "int"]),
    ],
)
def test_bad_arguments_name_the_argument_and_value(overrides, words) -> None:
    with pytest.raises(ValueError) as err:
        make(**overrides)
    for word in words:
        assert word in str(err.value)


def test_bad_tokens_and_empty_context_are_rejected() -> None:
    cache = make()
    with pytest.raises(ValueError, match="context"):
        cache.draft([])
    with pytest.raises(ValueError, match="-1"):
        cache.insert([1, -1])
    with pytest.raises(ValueError, match="int"):
        cache.insert([1.5, 2])  # type: ignore[list-item]  # a float token is the bad input under test
    with pytest.raises(ValueError, match=str(2**31)):
        cache.draft([2**31])
    cache.insert([])  # nothing to insert is not an error (SGLang's insert loop simply does nothing)
    assert cache.num_nodes == 0


# ----------------------------------------------------------------------------------------------- insert, share, reset


def test_every_suffix_of_the_window_is_inserted() -> None:
    cache = make()
    cache.insert([1, 2, 3, 4])
    assert cache.num_nodes == 4 + 3 + 2 + 1  # suffixes 1234, 234, 34, 4 share nothing
    cache.insert([1, 2, 3, 4])
    assert cache.num_nodes == 10  # same n-grams again: counts go up, no new nodes
    cache.insert([2, 3, 5])
    assert cache.num_nodes == 10 + 3  # new: 2-3-5 and 3-5 under existing paths, and 5 under the root


def test_one_trie_is_shared_across_requests() -> None:
    # SGLang [ran]: insert 1..10 from one request, query [3, 4] from another -> drafts 5..10.
    cache = make()
    cache.insert(list(range(1, 11)))
    tree = cache.draft([77, 3, 4])  # another sequence that happens to end in 3, 4
    assert tree.tokens == (5, 6, 7, 8, 9, 10, 0, 0, 0, 0, 0)
    assert tree.parents == (-1, 0, 1, 2, 3, 4, -1, -1, -1, -1, -1)
    assert tree.num_real == 6
    assert tree.depths() == (1, 2, 3, 4, 5, 6, 1, 1, 1, 1, 1)


def test_reset_empties_the_trie() -> None:
    cache = make()
    cache.insert(list(range(1, 11)))
    cache.reset()
    assert cache.num_nodes == 0
    tree = cache.draft([3, 4])
    assert tree.num_real == 0 and tree.tokens == (0,) * 11 and tree.parents == (-1,) * 11
    cache.insert([3, 4, 5])  # usable again after a flush
    assert cache.draft([3, 4]).tokens[:1] == (5,)


def test_only_the_last_max_trie_depth_tokens_are_inserted() -> None:
    cache = make(max_trie_depth=4, capacity=100, min_bfs_breadth=1, max_bfs_breadth=1, num_draft_tokens=6)
    cache.insert(list(range(1, 101)))  # a long prompt: only its tail 97, 98, 99, 100 goes in
    assert cache.num_nodes == 4 + 3 + 2 + 1
    for head in ([1], [2, 3], [50, 51], [96]):
        assert cache.draft(head).num_real == 0
    tree = cache.draft([97])
    assert tree.tokens == (98, 99, 100, 0, 0) and tree.parents == (-1, 0, 1, -1, -1) and tree.num_real == 3


def test_only_the_last_max_trie_depth_context_tokens_are_matched() -> None:
    cache = make(max_trie_depth=3)
    cache.insert([1, 2, 3, 4])  # window 2, 3, 4
    assert cache.draft([99] * 40 + [2, 3]) == cache.draft([2, 3])
    assert real_paths(cache.draft([5, 2, 3])) == {(4,)}


# ----------------------------------------------------------------------------------------------- capacity and LRU


def test_capacity_evicts_least_recently_used_leaves() -> None:
    # capacity 8 = root + 7 nodes, max_trie_depth 2: a bigram a-b is in the trie iff drafting from [a] yields b.
    cache = make(max_trie_depth=2, capacity=8, num_draft_tokens=4)
    cache.insert([1, 2])  # nodes 1, 1-2, 2
    cache.insert([3, 4])  # nodes 3, 3-4, 4 (6 in all)
    cache.insert([1, 2])  # touch: 1-2 is now more recent than 3-4
    assert cache.num_nodes == 6
    # [5, 6] needs 5 and 5-6 with one slot free: evict the LRU tail 3-4. Then [6] needs a slot: evict 3, now a leaf.
    cache.insert([5, 6])
    assert cache.num_nodes == 7
    assert real_paths(cache.draft([1])) == {(2,)}  # kept: used recently
    assert real_paths(cache.draft([3])) == set()  # evicted: least recently used
    assert real_paths(cache.draft([5])) == {(6,)}


def test_capacity_is_never_exceeded_and_only_leaves_are_evicted() -> None:
    rng = random.Random(0)
    for capacity in (5, 6, 9, 40):
        cache = make(max_trie_depth=4, capacity=capacity, match_type=rng.choice(["BFS", "PROB"]))
        fullest = 0
        for _ in range(300):
            # NgramCache raises RuntimeError if eviction ever met a node with children.
            cache.insert([rng.randrange(6) for _ in range(rng.randint(1, 9))])
            assert cache.num_nodes <= capacity - 1  # the root takes one slot, as in SGLang
            fullest = max(fullest, cache.num_nodes)
        assert fullest == capacity - 1  # the limit was actually reached, so eviction was exercised


# ----------------------------------------------------------------------------------------------- BFS vs PROB


def test_bfs_takes_recent_children_prob_takes_frequent_ones() -> None:
    for match_type, expected in (("BFS", {(3,)}), ("PROB", {(2,)})):
        cache = make(max_trie_depth=2, match_type=match_type, num_draft_tokens=2)
        for _ in range(3):
            cache.insert([1, 2])  # 1 -> 2 three times
        cache.insert([1, 3])  # 1 -> 3 once, last
        assert real_paths(cache.draft([1])) == expected, match_type


def _fan_cache(**overrides) -> NgramCache:
    """max_trie_depth 6, breadths 1..5: s = (5-1)/(6-1) = 0.8, so an anchor of depth d starts at breadth
    (5-d)*0.8 + 1 -> d=1: 4.2, d=2: 3.4, d=3: 2.6, d=4: 1.8 (truncated: 4, 3, 2, 1) and loses 0.8 per level.
    Windows 2 3 4 5 10b 10b+1 for b = 1..5, in that order: after 5 come the branches 10, 20, .., 50 (50 most recent)."""
    cache = make(max_trie_depth=6, min_bfs_breadth=1, max_bfs_breadth=5, **overrides)
    for b in range(1, 6):
        cache.insert([2, 3, 4, 5, 10 * b, 10 * b + 1])
    return cache


def test_bfs_long_match_gives_narrow_chains_short_match_a_wide_bush() -> None:
    # Long match [2,3,4,5]: anchor 2345 (breadth 1) gives 50 -> 51; anchor 345 (breadth 2) adds 40 -> 41. Budget 4.
    long_tree = _fan_cache(num_draft_tokens=5).draft([2, 3, 4, 5])
    assert real_paths(long_tree) == {(50,), (50, 51), (40,), (40, 41)}
    # Short match [9, 5]: only anchor 5 (depth 1, breadth 4): the four most recent branches side by side.
    short_tree = _fan_cache(num_draft_tokens=5).draft([9, 5])
    assert real_paths(short_tree) == {(50,), (40,), (30,), (20,)}
    assert short_tree.depths() == (1, 1, 1, 1)


def test_bfs_breadth_cuts_the_oldest_branch_even_with_budget_left() -> None:
    tree = _fan_cache(num_draft_tokens=12).draft([9, 5])
    assert real_paths(tree) == {(b,) for b in (50, 40, 30, 20)} | {(b, b + 1) for b in (50, 40, 30, 20)}
    assert tree.num_real == 8 and tree.tokens[8:] == (0, 0, 0)  # branch 10 is 5th: breadth 4 leaves it out
    assert tree.depths() == (1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1)  # breadth-first, then pads


def test_prob_follows_the_frequent_branch_and_keeps_top_k_children() -> None:
    def cache_with_hot_branch(**overrides) -> NgramCache:
        cache = make(**{**dict(max_trie_depth=6, min_bfs_breadth=1, max_bfs_breadth=5, match_type="PROB"), **overrides})
        for _ in range(3):
            cache.insert([2, 3, 4, 5, 10, 11])  # branch 10 three times, oldest
        for b in range(2, 6):
            cache.insert([2, 3, 4, 5, 10 * b, 10 * b + 1])
        return cache

    # Under 5: 10 has prob 3/7, the others 1/7; 10 -> 11 keeps 3/7 and beats them all. BFS picks recency instead.
    assert real_paths(cache_with_hot_branch(num_draft_tokens=3).draft([9, 5])) == {(10,), (10, 11)}
    bfs = _fan_cache(num_draft_tokens=3)
    for _ in range(3):
        bfs.insert([2, 3, 4, 5, 10, 11])  # most frequent AND now most recent
    bfs.insert([2, 3, 4, 5, 50, 51])
    assert real_paths(bfs.draft([9, 5])) == {(50,), (10,)}
    # max_bfs_breadth 1: each node offers only its most frequent child, so the heap runs dry after 10 -> 11.
    tree = cache_with_hot_branch(num_draft_tokens=5, max_bfs_breadth=1).draft([9, 5])
    assert real_paths(tree) == {(10,), (10, 11)} and tree.num_real == 2 and tree.tokens[2:] == (0, 0)


def test_prob_breaks_probability_ties_like_libstdcxx_priority_queue() -> None:
    # Four equal children of 5, offered in token order 11, 12, 13, 14 (recency plays no part in PROB).
    # Popping 11 moves the last element (14) to the top, walks the hole down the right child (13) on a tie and
    # puts 14 back in the hole, so 13 -- not 12 -- comes out second.
    cache = make(max_trie_depth=2, max_bfs_breadth=4, match_type="PROB", num_draft_tokens=3)
    for tok in (14, 13, 12, 11):
        cache.insert([5, tok])
    assert real_paths(cache.draft([5])) == {(11,), (13,)}


# ----------------------------------------------------------------------------------------------- budget and shape


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
@pytest.mark.parametrize("num_draft_tokens", [1, 2, 5, 12, 33])
def test_budget_padding_and_topological_order(match_type: str, num_draft_tokens: int) -> None:
    rng = random.Random(num_draft_tokens)
    cache = make(max_trie_depth=5, capacity=500, min_bfs_breadth=1, max_bfs_breadth=3, match_type=match_type,
                 num_draft_tokens=num_draft_tokens)
    windows: list[list[int]] = []
    for _ in range(60):
        seq = [rng.randrange(7) for _ in range(rng.randint(1, 8))]
        cache.insert(seq)
        windows.append(seq[-5:])
    grams = {tuple(w[i:j]) for w in windows for i in range(len(w)) for j in range(i + 1, len(w) + 1)}
    for _ in range(40):
        ctx = [rng.randrange(7) for _ in range(rng.randint(1, 7))]
        tree = cache.draft(ctx)
        n = len(tree.tokens)
        assert n == num_draft_tokens - 1
        assert all(-1 <= p < i for i, p in enumerate(tree.parents))  # parents first
        assert tree.tokens[tree.num_real :] == (0,) * (n - tree.num_real)  # pads: token 0 ...
        assert tree.parents[tree.num_real :] == (-1,) * (n - tree.num_real)  # ... under the root
        depths = tree.depths()
        assert list(depths[: tree.num_real]) == sorted(depths[: tree.num_real])  # breadth-first like fillResult
        siblings = [(p, t) for p, t in zip(tree.parents[: tree.num_real], tree.tokens[: tree.num_real])]
        assert len(set(siblings)) == len(siblings)  # equal tokens under one parent are merged
        for path in real_paths(tree):
            # Sound: each drafted path continues some suffix of the context inside one inserted window.
            assert any(tuple(ctx[-d:]) + path in grams for d in range(1, min(len(ctx), 5) + 1)), (ctx, path)


def test_draft_tree_depths_and_checks() -> None:
    tree = DraftTree(tokens=(7, 8, 9, 0), parents=(-1, 0, 0, -1), num_real=3)
    assert tree.depths() == (1, 2, 2, 1)
    with pytest.raises(ValueError, match="parents"):
        DraftTree(tokens=(7, 8), parents=(1, -1), num_real=2)
