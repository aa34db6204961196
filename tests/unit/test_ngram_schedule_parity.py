"""Parity of the CPU engine's NGRAM schedule with SGLang 0.5.23's `Ngram` object (C++ compiled at test time, see
tests/unit/sglang_ngram_oracle.py): several requests interleaved round by round, as the engine's scheduler runs them.

Our side is the real `NgramSpeculator` driven exactly as `Scheduler` + `Decoder` drive it (begin_round, then each
running request's step in admission order: a prefill for a new request, else propose + accept + observe; release when
it finishes). SGLang's side is `NGRAMWorker`'s use of `Ngram`: per decode batch, `synchronize` + `batchMatch` of every
drafting request with its state id and total length, then `asyncInsert` of the windows ending at the verify roots,
and `eraseMatchState` for requests that left. Accepted tokens follow the drafts (a random path of the tree, then a
bonus token), so that match states advance over real matches. Drafts are compared step by step, and the trie's
contents at random round boundaries.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from serve.ngram.corpus import ExternalCorpora, draft_with_corpora
from serve.engines.cpu.decode import Request, StopRules
from serve.engines.cpu.verify import Sampling
from serve.ngram.trie import NgramCache
from serve.ngram.sam import SEPARATOR_TOKEN
from serve.engines.cpu.speculators import NgramSpeculator
from tests.sweep import sweep
from tests.unit.sglang_ngram_oracle import (NGRAM_HARNESS, compile_harness, parse_draft, parse_trie, run,
                                            tree_paths)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> Path:
    return compile_harness(tmp_path_factory.mktemp("ngram_schedule_oracle"), NGRAM_HARNESS,
                           ["ngram.cpp", "trie.cpp", "result.cpp", "suffix_automaton.cpp"])


def _config(rng: random.Random) -> dict:
    depth = rng.choice([2, 3, 4, 6, 8, 18])
    min_b = rng.randint(1, 3)
    return dict(
        max_trie_depth=depth,
        capacity=rng.choice([depth + 1, depth + 4, 40, 200, 100_000]),  # small ones evict cached anchors
        min_bfs_breadth=min_b,
        max_bfs_breadth=rng.randint(min_b, 6),
        match_type=rng.choice(["BFS", "PROB"]),
        num_draft_tokens=rng.choice([2, 4, 8, 12]),
    )


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid=rid, prompt_ids=prompt, sampling=Sampling(), rules=StopRules(max_new_tokens=1 << 30), seed=0)


def _accept(rng: random.Random, tokens, parents, num_real: int, vocab: int) -> list[int]:
    """Tokens a verify step appends: the path to a random drafted node (or none), then a bonus token."""
    path: list[int] = []
    if num_real and rng.random() < 0.75:
        node = rng.randrange(num_real)
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        path.reverse()
        path = path[: rng.randint(1, len(path))]
    return path + [rng.randrange(vocab)]


def _corpus(rng: random.Random, vocab: int, stems: list[list[int]]) -> list[int]:
    """Random documents (some repeating the request stems) joined by the separator."""
    tokens: list[int] = []
    for i in range(rng.randint(1, 6)):
        doc = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.5:
            doc = rng.choice(stems) + doc
        tokens += ([SEPARATOR_TOKEN] if i else []) + doc
    return tokens


def _simulate(rng: random.Random, cfg: dict, corpora: bool = False) -> tuple[list[str], list[tuple]]:
    """Run our speculator through a random multi-request schedule; return the oracle's script and what we drafted.
    With `corpora`, external corpora are loaded at the start and added/removed between rounds."""
    depth = cfg["max_trie_depth"]
    sam_budget = rng.randint(0, cfg["num_draft_tokens"] - 1) if corpora else 0
    store = ExternalCorpora(10_000_000) if corpora else None
    spec = NgramSpeculator(NgramCache(**cfg), cfg["num_draft_tokens"], depth, corpora=store,
                           external_sam_budget=sam_budget)
    vocab = rng.choice([3, 5, 8, 20])
    stems = [[rng.randrange(vocab) for _ in range(rng.randint(2, 12))] for _ in range(3)]
    script = [f"C {cfg['capacity']} {depth} {cfg['min_bfs_breadth']} {cfg['max_bfs_breadth']} "
              f"{int(cfg['match_type'] == 'PROB')} {cfg['num_draft_tokens']} {sam_budget}"]
    expected: list[tuple] = []
    loaded: list[str] = []

    def load(cid: str) -> None:
        assert store is not None, "corpora are loaded only in a run with corpora"
        tokens = _corpus(rng, vocab, stems)
        store.add(cid, [tokens])
        script.append(f"L {cid} {len(tokens)} " + " ".join(map(str, tokens)))
        expected.append(("OK",))
        loaded.append(cid)

    for i in range(rng.randint(1, 3) if corpora else 0):
        load(f"c{i}")
    running: list[tuple[int, Request]] = []  # (state id, request), admission order
    max_running = rng.choice([1, 2, 3, 5])
    next_id = 0
    for _round in range(rng.randint(10, 60)):
        while len(running) < max_running and rng.random() < 0.5:
            prompt = rng.choice(stems) + [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
            running.append((next_id, _request(f"r{next_id}", prompt)))
            next_id += 1
        if not running:
            if rng.random() < 0.2:  # /flush_cache is only accepted while idle
                spec.reset()
                script.append("X")
            continue
        spec.begin_round()
        drafting, windows, left = [], [], []
        for sid, req in list(running):
            if not req.tokens:  # the prefill: one token, no draft, no insert
                req.tokens = list(req.prompt_ids) + [rng.randrange(vocab)]
                continue
            window = req.tokens[-depth:]
            drafting.append(f"{sid} {len(req.tokens)} {len(window)} " + " ".join(map(str, window)))
            windows.append(f"{len(window)} " + " ".join(map(str, window)))
            tree = spec.propose(req)
            assert len(tree.tokens) == cfg["num_draft_tokens"] - 1
            expected.append(("D", sid, len(req.tokens), tree_paths(tree.tokens, tree.parents)))
            accepted = _accept(rng, tree.tokens, tree.parents, tree.num_real, vocab)
            req.tokens.extend(accepted)
            spec.observe(req, [])
            if rng.random() < 0.1:
                spec.release(req)
                running.remove((sid, req))
                left.append(str(sid))
        if drafting:
            script.append(f"M {len(drafting)}")
            script.extend(drafting)
            script.append(f"I {len(windows)}")
            script.extend(windows)
        if left:
            script.append(f"E {len(left)} " + " ".join(left))
        if store is not None and rng.random() < 0.08:  # a runtime add or remove, between two rounds
            if loaded and rng.random() < 0.5:
                cid = loaded.pop(rng.randrange(len(loaded)))
                store.remove(cid)
                script.append(f"V {cid}")
            else:
                load(f"c{len(script)}")
            script.append("Q")
            expected.append(("Q", store.list()))
        if rng.random() < 0.15:
            spec.begin_round()  # lands this round's inserts, as the oracle's synchronize before dumping
            script.append("N")
            expected.append(("N", spec.cache.num_nodes, _trie_paths(spec.cache)))
    return script, expected


def test_multi_request_schedule_matches_sglang(oracle: Path) -> None:
    sweep(lambda seed: _check(oracle, random.Random(seed), corpora=False), range(120))


def test_schedule_with_external_corpora_matches_sglang(oracle: Path) -> None:
    sweep(lambda seed: _check(oracle, random.Random(seed), corpora=True), range(1000, 1120))


def _check(oracle: Path, rng: random.Random, corpora: bool) -> None:
    cfg = _config(rng)
    script, expected = _simulate(rng, cfg, corpora)
    out = run(oracle, script)
    pos = 0
    for kind, *payload in expected:
        if kind == "OK":
            assert out[pos] == "OK", out[pos]
            pos += 1
        elif kind == "Q":
            count = int(out[pos].split()[1])
            theirs = dict((line.split()[1], int(line.split()[2])) for line in out[pos + 1:pos + 1 + count])
            pos += 1 + count
            assert payload[0] == theirs, "corpus token counts differ"
        elif kind == "D":
            sid, total, ours = payload
            theirs = tree_paths(*parse_draft(out[pos]))
            pos += 1
            assert ours == theirs, f"draft of request {sid} at length {total} differs under {cfg}"
        else:
            count, paths, pos = parse_trie(out, pos)
            assert payload[0] == count, f"node count differs under {cfg}"
            assert payload[1] == paths, f"trie contents differ under {cfg}"
    assert pos == len(out)


def _trie_paths(cache: NgramCache) -> set[tuple[int, ...]]:
    out: set[tuple[int, ...]] = set()
    root: tuple[int, ...] = ()
    stack = [(root, cache._root)]
    while stack:
        prefix, node = stack.pop()
        for tok, child in node.children.items():
            out.add(prefix + (tok,))
            stack.append((prefix + (tok,), child))
    return out


def test_corpus_drafts_match_sglang_on_random_corpora_and_queries(oracle: Path) -> None:
    """Bigger corpora and trees than the schedules: an empty trie and the whole budget to the corpora, so the drafts
    are the suffix automata's alone; queries from the corpus (long matches) and random ones (short or none)."""
    sweep(lambda seed: _check_corpus_drafts(oracle, seed), range(5000, 5030))


def _check_corpus_drafts(oracle: Path, seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.choice([2, 4, 8, 18])
    min_b = rng.randint(1, 4)
    cfg: dict[str, Any] = dict(max_trie_depth=depth, capacity=1000, min_bfs_breadth=min_b,
                               max_bfs_breadth=rng.randint(min_b, 8), match_type=rng.choice(["BFS", "PROB"]),
                               num_draft_tokens=rng.choice([2, 8, 16, 40]))
    n_corpora = rng.randint(1, 3)
    budget = cfg["num_draft_tokens"] - 1
    store = ExternalCorpora(10_000_000)
    cache = NgramCache(**cfg)
    script = [f"C 1000 {depth} {min_b} {cfg['max_bfs_breadth']} {int(cfg['match_type'] == 'PROB')} "
              f"{cfg['num_draft_tokens']} {budget}"]
    vocab = rng.choice([4, 10, 50])
    phrases = [[rng.randrange(vocab) for _ in range(rng.randint(2, 10))] for _ in range(20)]
    corpus_tokens = []
    for i in range(n_corpora):
        tokens: list[int] = []
        while len(tokens) < rng.choice([50, 500, 2000]):
            tokens += rng.choice(phrases) if rng.random() < 0.8 else [SEPARATOR_TOKEN]
        store.add(f"k{i}", [tokens])
        corpus_tokens.append(tokens)
        script.append(f"L k{i} {len(tokens)} " + " ".join(map(str, tokens)))
    ours = []
    for q in range(40):
        if rng.random() < 0.7:
            source = rng.choice(corpus_tokens)
            end = rng.randrange(1, len(source) + 1)
            query = [t if t != SEPARATOR_TOKEN else rng.randrange(vocab) for t in source[max(0, end - 30):end]]
        else:
            query = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        window = query[-depth:]
        tree = draft_with_corpora(cache, store.snapshot(), budget, query)
        ours.append((query, tree_paths(tree.tokens, tree.parents)))
        script.append(f"M 1\n{q} {len(query)} {len(window)} " + " ".join(map(str, window)))
    out = run(oracle, script)
    assert out[:n_corpora] == ["OK"] * n_corpora
    for (query, paths), line in zip(ours, out[n_corpora:], strict=True):
        assert paths == tree_paths(*parse_draft(line)), f"draft differs for {query} under {cfg}"
