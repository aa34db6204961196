"""The compiled trie (serve/ngram/compiled.py) against the Python one it ports (serve/ngram/trie.py): the same random
streams of inserts and drafts, with per-request match states that advance, rebuild (flushes, evictions, a request
going back), small capacities that evict and both match types; every tree (also one rebuilt without a state) and node
count must be equal. Then the schedule's replay step (accepted drafts, real nodes) against propose + walk, and what
happens without a compiler."""

from __future__ import annotations

import random
from typing import Any

import pytest

from serve.ngram import compiled
from serve.ngram.compiled import CompiledNgramCache, CompiledUnavailable, ngram_cache
from serve.ngram.drafttree import accepted_drafts
from serve.ngram.schedule import DraftState, NgramDrafter
from serve.ngram.trie import MatchState, NgramCache
from tests.sweep import sweep


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    try:
        compiled.library()
    except CompiledUnavailable as exc:
        pytest.skip(f"the compiled trie does not build here: {exc}")


def config(rng: random.Random) -> dict[str, Any]:
    depth = rng.choice([2, 3, 4, 7, 18])
    low = rng.randint(1, 3)
    return dict(max_trie_depth=depth, capacity=rng.choice([depth + 1, depth + 4, 40, 100_000]), min_bfs_breadth=low,
                max_bfs_breadth=rng.randint(low, 6), match_type=rng.choice(["BFS", "PROB"]),
                num_draft_tokens=rng.choice([1, 2, 3, 5, 9, 17]))


def check_stream(seed: int) -> None:
    rng = random.Random(seed)
    cfg = config(rng)
    ours, theirs = NgramCache(**cfg), CompiledNgramCache(**cfg)
    vocab = rng.choice([2, 3, 5, 12])  # small vocabularies: shared prefixes, frequency ties, wide nodes
    requests = [[rng.randrange(vocab) for _ in range(rng.randint(1, 6))] for _ in range(3)]
    states = [(MatchState(), MatchState()) for _ in requests]
    for step in range(rng.randint(30, 150)):
        r = rng.random()
        k = rng.randrange(len(requests))
        tokens = requests[k]
        if r < 0.40:  # a request grows (a decode loop) and its window is inserted
            tokens.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))
            ours.insert(tokens)
            theirs.insert(tokens)
        elif r < 0.88:  # a draft with the request's state; now and then the request goes back (a rebuild)
            if rng.random() < 0.1 and len(tokens) > 2:
                del tokens[rng.randint(1, len(tokens) - 1):]
            state_ours, state_theirs = states[k]
            budget = rng.choice([cfg["num_draft_tokens"] - 1, rng.randint(0, 20)])
            a = ours.build(tokens, budget, state_ours, len(tokens))
            b = theirs.build(tokens, budget, state_theirs, len(tokens))
            assert a == b, f"seed {seed}, step {step}: trees differ under {cfg}"
            # also without a state: the match is rebuilt from the context
            assert ours.build(tokens, budget) == theirs.build(tokens, budget), f"seed {seed}, step {step}"
        elif r < 0.93:
            ours.reset()
            theirs.reset()
        else:  # a request leaves; a new one starts with a fresh state
            requests[k] = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
            states[k] = (MatchState(), MatchState())
        assert ours.num_nodes == theirs.num_nodes, f"seed {seed}, step {step}: node counts differ under {cfg}"


def test_every_tree_equals_the_python_tries() -> None:
    sweep(check_stream, range(300))


def check_schedule(seed: int) -> None:
    """Requests of known sequences stepped in rounds: the compiled replay step equals propose + walk on the Python
    trie, round after round, with inserts landing when the next round begins."""
    rng = random.Random(seed)
    cfg = config(rng)
    vocab = rng.choice([3, 6, 20])
    stems = [[rng.randrange(vocab) for _ in range(8)] for _ in range(2)]
    sequences = [tuple(rng.choice(stems) + [rng.randrange(vocab) for _ in range(rng.randint(4, 40))])
                 for _ in range(rng.randint(1, 5))]
    python, native = NgramDrafter(NgramCache(**cfg)), NgramDrafter(CompiledNgramCache(**cfg))
    live = [(seq, rng.randint(1, 4), DraftState(), DraftState()) for seq in sequences]
    while live:
        python.begin_round()
        native.begin_round()
        if rng.random() < 0.03:
            python.reset()
            native.reset()
        still = []
        for seq, length, s_py, s_c in live:
            tree = python.propose(s_py, seq[:length])
            want = (accepted_drafts(tree, seq[length:]), tree.num_real)
            assert native.replay_step(s_c, seq, length) == want, f"seed {seed}, {cfg}"
            length += want[0] + 1
            if length < len(seq):
                still.append((seq, length, s_py, s_c))
        live = still
    python.begin_round()
    native.begin_round()
    native.cache.land()  # type: ignore[attr-defined]
    assert python.cache.num_nodes == native.cache.num_nodes


def test_replay_steps_equal_propose_and_walk() -> None:
    sweep(check_schedule, range(150))


def test_bad_input_is_refused_by_name() -> None:
    cache = CompiledNgramCache(max_trie_depth=4, capacity=100, min_bfs_breadth=1, max_bfs_breadth=2,
                               match_type="BFS", num_draft_tokens=4)
    with pytest.raises(ValueError, match="-1"):
        cache.sequence([3, -1, 4])
    with pytest.raises(ValueError, match="length must be in"):
        cache.step(MatchState(), cache.sequence([1, 2, 3]), 0, False)
    with pytest.raises(ValueError, match="capacity > max_trie_depth"):
        CompiledNgramCache(max_trie_depth=4, capacity=4, min_bfs_breadth=1, max_bfs_breadth=2, match_type="BFS",
                           num_draft_tokens=4)


def test_without_a_compiler_it_says_what_to_install(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # a PATH with no compiler on it
    with pytest.raises(CompiledUnavailable, match="install one"):
        compiled.build(tmp_path / "libngramtrie.so")


def test_the_python_trie_on_request(monkeypatch) -> None:
    params = dict(max_trie_depth=4, capacity=100, min_bfs_breadth=1, max_bfs_breadth=2, match_type="PROB",
                  num_draft_tokens=4)
    assert type(ngram_cache(**params)) is CompiledNgramCache
    monkeypatch.setenv(compiled.TRIE_ENV, "python")
    assert type(ngram_cache(**params)) is NgramCache
