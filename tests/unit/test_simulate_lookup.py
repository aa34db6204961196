"""llama-server's ngram-simple in the acceptance replay: the port against a line-by-line transliteration of
llama.cpp 11434's `common_ngram_simple_draft` (its index loop, not our byte search) on random token streams, a hand
worked replay, and simulate-first's choice for a space of it."""

from __future__ import annotations

import random

import pytest

from pipeline.config import load_study
from pipeline.search.space import load_space
from pipeline.search.strategy import resolve_strategy
from pipeline.simulate.lookup import ngram_simple_draft
from pipeline.simulate.replay import Answer, ClosedLoop, Phase, replay
from serve.spec import LlamaNgramSimpleSpec


def reference_draft(tokens: list[int], sampled: int, n: int, m: int) -> list[int]:
    """common/ngram-map.cpp, as written there (size_t loop from cur_len - n - 1 down to 1)."""
    cur_len = len(tokens)
    if cur_len <= n + m + 1:
        return []
    pattern = [tokens[j] for j in range(cur_len - n + 1, cur_len)] + [sampled]
    match_pos = 0
    j = cur_len - n - 1
    while j > 0:
        if all(tokens[j + k] == pattern[k] for k in range(len(pattern))):
            match_pos = j
            break
        j -= 1
    if match_pos == 0:
        return []
    copy_max = min(m, cur_len - (match_pos + n))
    if copy_max < n:
        return []
    return [tokens[match_pos + n + j] for j in range(copy_max)]


@pytest.mark.parametrize("seed", range(6))
def test_the_port_drafts_what_llama_cpp_drafts(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 50, 70_000, 2**31 - 1])  # large ids span every byte of an int32
    # phrases repeated in random order, with noise between them: matches of every length, and misses
    phrases = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 7))] for _ in range(4)]
    tokens: list[int] = []
    while len(tokens) < 100:
        tokens += rng.choice(phrases) if rng.random() < 0.8 else [rng.randrange(vocab)]
    drafted = 0
    for end in range(1, len(tokens)):
        for n in (1, 2, 3, 5):
            for m in (1, 2, 4, 9):
                got = ngram_simple_draft(tokens[:end], tokens[end], n, m)
                assert got == reference_draft(tokens[:end], tokens[end], n, m), (end, n, m)
                drafted += bool(got)
    assert drafted


def test_an_unaligned_byte_match_is_not_a_token_match():
    # 256 = 00 01 00 00 and 1 = 01 00 00 00 (little endian): the bytes of [1, 0] occur inside [256, 0, ...] at an
    # offset that is not a token boundary
    history = [9, 256, 0, 7, 7, 7, 7, 7, 7, 7]
    assert ngram_simple_draft(history, 0, 2, 2) == reference_draft(history, 0, 2, 2) == []


def test_bad_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match="size_n"):
        ngram_simple_draft([1, 2, 3], 4, 0, 2)


def test_a_replay_accepts_the_matching_prefix_and_cuts_the_draft_to_the_output_left():
    # size_n 1, size_m 3; the prompt 1 2 3 4 5 6, the output 1 2 3 9 1 2.
    a = Answer((1, 2, 3, 4, 5, 6), (1, 2, 3, 9, 1, 2))
    (r,) = replay(LlamaNgramSimpleSpec(size_n=1, size_m=3), [Phase("measure", (a,), ClosedLoop(1))]).requests
    steps = [(s.kept, s.tree) for s in r.steps]
    # step 1 (after 1): no draft (history 1..6 holds 1 only at position 0). step 2 (after 2): draft 3 4 5, keeps 3 9.
    # step 3 (after 9): no draft. step 4 (after 1): [1] at position 6 (the output's first) would draft 2 3 9, but one
    # output token is left and the step samples it itself: the draft is cut to nothing.
    assert steps == [(1, 0), (2, 3), (1, 0), (1, 0)]
    assert sum(s.kept for s in r.steps) + 1 == len(a.output_ids)


def test_simulate_first_runs_on_a_space_of_ngram_simple_and_not_with_llama_cpps_stateful_types(tmp_path):
    simple = tmp_path / "simple.yaml"
    simple.write_text("algorithms: [none, llama_ngram_simple]\nbranches:\n  llama_ngram_simple:\n"
                      "    size_n: {type: int, low: 1, high: 4}\n    size_m: {type: int, low: 2, high: 8}\n")
    study = load_study(None, {"engine.kind": "llama_cpp"})
    assert resolve_strategy(study, load_space(simple)).name == "simulate-first"
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(simple.read_text().replace("[none, llama_ngram_simple]", "[none, llama_ngram_simple, "
                                                "llama_ngram_mod]")
                     + "  llama_ngram_mod:\n    n_match: {type: fixed, value: 4}\n")
    strategy = resolve_strategy(study, load_space(mixed))
    assert strategy.name == "tpe" and "llama_ngram_mod" in strategy.reason
