"""SGLang 0.5.23's external corpus on the CPU engine: loading rules, the suffix automaton's drafts, the budget split
with the trie, and corpora surviving a flush. Expected values are derived by hand from SGLang's sources (the parity
test test_ngram_schedule_parity.py compares drafts with SGLang's C++)."""

from __future__ import annotations

import json

import pytest

from serve.ngram.corpus import ExternalCorpora, corpus_file_chunks, document_chunks, draft_with_corpora
from serve.engines.cpu.decode import Request, StopRules
from serve.engines.cpu.verify import Sampling
from serve.ngram.trie import NgramCache
from serve.ngram.sam import SEPARATOR_TOKEN as SEP
from serve.ngram.sam import SuffixAutomaton
from serve.engines.cpu.speculators import NgramSpeculator


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]


def sam_of(*tokens: int) -> SuffixAutomaton:
    sam = SuffixAutomaton()
    sam.append(tokens)
    sam.finalize()
    return sam


def paths(tokens, parents) -> set[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for tok, parent in zip(tokens, parents):
        out.append((out[parent] if parent >= 0 else ()) + (tok,))
    return set(out)


def build(sam, window, budget, prob=False, min_b=1, max_b=1, depth=18):
    tokens, parents = sam.build(window, budget, max_trie_depth=depth, min_bfs_breadth=min_b, max_bfs_breadth=max_b,
                                prob=prob)
    return paths(tokens[1:], [p - 1 for p in parents[1:]])


# ----------------------------------------------------------------------------------------------- suffix automaton


def test_recency_prefers_the_latest_occurrence_and_frequency_the_most_common() -> None:
    # "1 2" continues with 3 twice (ending at positions 2 and 6) and with 4 once, last (ending at 10).
    sam = sam_of(1, 2, 3, SEP, 1, 2, 3, SEP, 1, 2, 4)
    assert build(sam, [9, 1, 2], 1) == {(4,)}  # BFS: most recent continuation
    assert build(sam, [9, 1, 2], 1, prob=True) == {(3,)}  # PROB: most frequent
    assert build(sam, [9, 1, 2], 2, min_b=2, max_b=2) == {(4,), (3,)}  # BFS breadth 2: both, budget 2


def test_paths_run_to_the_end_of_the_document_and_never_cross_a_separator() -> None:
    sam = sam_of(5, 6, 7, 8, SEP, 9)
    assert build(sam, [5], 10) == {(6,), (6, 7), (6, 7, 8)}  # stops at the separator
    assert build(sam, [8], 10) == set()  # only the separator follows 8: nothing to draft
    assert sam.token_count == 6  # separators count, as SGLang's list reports


def test_an_empty_automaton_and_bad_tokens() -> None:
    sam = SuffixAutomaton()
    sam.finalize()
    assert sam.empty and build(sam, [1], 4) == set()
    with pytest.raises(ValueError, match="-5"):
        SuffixAutomaton().append([1, -5])
    done = sam_of(1)
    with pytest.raises(RuntimeError, match="finaliz"):
        done.append([2])


# ----------------------------------------------------------------------------------------------- loading


def test_corpus_file_rules(tmp_path) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps("ab") + "\n\n" + json.dumps("") + "\n" + json.dumps("cd") + "\n")
    chunks = list(corpus_file_chunks(path, encode, max_tokens=5))
    assert chunks == [[97, 98], [SEP, 99, 100]]  # blank line and empty document skipped; 2 + 1 + 2 = 5 tokens
    with pytest.raises(ValueError, match=r"token limit \(4\) at line 4 after loading 2 tokens"):
        list(corpus_file_chunks(path, encode, max_tokens=4))
    path.write_text(json.dumps("ab") + "\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="line 2: expected a JSON string"):
        list(corpus_file_chunks(path, encode, max_tokens=100))
    path.write_text("{oops\n")
    with pytest.raises(ValueError, match="Invalid JSON in external ngram corpus at line 1"):
        list(corpus_file_chunks(path, encode, max_tokens=100))
    with pytest.raises(ValueError, match="does not exist"):
        list(corpus_file_chunks(tmp_path / "missing.jsonl", encode, max_tokens=100))
    path.write_text(json.dumps("abcdefg") + "\n")
    assert list(corpus_file_chunks(path, encode, max_tokens=100, chunk_size=3)) == [[97, 98, 99], [100, 101, 102],
                                                                                    [103]]


def test_inline_documents_are_cut_at_the_limit() -> None:
    assert document_chunks(["ab", "", "cd", "ef"], encode, 5) == ([[97, 98], [SEP, 99, 100]], True)
    assert document_chunks(["ab", "cd"], encode, 5) == ([[97, 98], [SEP, 99, 100]], False)


def test_corpora_share_one_token_budget_and_ids_are_unique(tmp_path) -> None:
    corpora = ExternalCorpora(max_tokens=10)
    assert corpora.add("a", [[1, 2, 3], [SEP, 4]]) == 5
    with pytest.raises(ValueError, match="already exists"):
        corpora.add("a", [[1]])
    with pytest.raises(ValueError, match=r"remaining token budget \(5\) after loading 3 tokens"):
        corpora.add("b", [[1, 2, 3], [SEP, 4, 5]])
    with pytest.raises(ValueError, match="empty"):
        corpora.add("b", [])
    assert corpora.add_documents("b", ["xyz"], encode) == (3, False)
    assert corpora.list() == {"a": 5, "b": 3}
    corpora.remove("a")
    corpora.remove("never-loaded")  # not an error, as in SGLang
    assert corpora.list() == {"b": 3}
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps("hello") + "\n")
    assert corpora.add_file(str(path), path, encode) == 5
    assert set(corpora.list()) == {"b", str(path)}
    with pytest.raises(ValueError, match="external_corpus_max_tokens"):
        ExternalCorpora(max_tokens=0)


# ----------------------------------------------------------------------------------------------- drafting


def cache(num_draft_tokens=4, **kw) -> NgramCache:
    cfg = dict(max_trie_depth=4, capacity=1000, min_bfs_breadth=1, max_bfs_breadth=1, match_type="BFS",
               num_draft_tokens=num_draft_tokens)
    cfg.update(kw)
    return NgramCache(**cfg)


def test_the_budget_is_split_between_trie_and_corpora() -> None:
    trie = cache(num_draft_tokens=4)  # 3 draft nodes
    trie.insert([1, 2, 3, 4])  # the trie continues 2 with 3, 4
    a = sam_of(2, 7, 8)  # corpus a continues 2 with 7, 8
    b = sam_of(2, 9, 10)
    # budget 2 over two corpora: 1 node each, the trie keeps 3 - 2 = 1.
    tree = draft_with_corpora(trie, [a, b], 2, [5, 2])
    assert paths(tree.tokens, tree.parents) == {(3,), (7,), (9,)}
    # budget 1 over two corpora: 1 // 2 = 0 each, so the trie drafts alone with all 3 nodes.
    tree = draft_with_corpora(trie, [a, b], 1, [5, 2])
    assert paths(tree.tokens, tree.parents) == {(3,), (3, 4), (0,)} and tree.num_real == 2
    # one corpus, budget 2: the trie keeps 1 node.
    tree = draft_with_corpora(trie, [a], 2, [5, 2])
    assert paths(tree.tokens, tree.parents) == {(3,), (7,), (7, 8)}


def test_equal_paths_merge_and_the_rest_is_padded() -> None:
    trie = cache(num_draft_tokens=5)
    trie.insert([1, 2, 3, 4])
    same = sam_of(2, 3, 4)  # the corpus proposes what the trie proposes
    tree = draft_with_corpora(trie, [same], 2, [2])  # trie 2 nodes: 3, 3-4; corpus 2 nodes: 3, 3-4
    assert tree.tokens[:tree.num_real] == (3, 4) and tree.num_real == 2 and len(tree.tokens) == 4


def test_the_speculator_drafts_from_corpora_and_a_flush_keeps_them() -> None:
    corpora = ExternalCorpora(max_tokens=100)
    corpora.add("docs", [[6, 7, 8, 9]])
    spec = NgramSpeculator(cache(num_draft_tokens=4), 4, 4, corpora=corpora, external_sam_budget=3)
    req = Request(rid="r", prompt_ids=[6], sampling=Sampling(), rules=StopRules(max_new_tokens=10), seed=0)
    req.tokens = [1, 6]
    assert spec.propose(req).tokens == (7, 8, 9)  # cold trie: the corpus drafts
    spec.reset()  # /flush_cache
    assert corpora.list() == {"docs": 4}
    req.draft_state = None
    assert spec.propose(req).tokens == (7, 8, 9)


@pytest.mark.parametrize("budget", [-1, 4, True])
def test_sam_budget_is_checked(budget) -> None:
    with pytest.raises(ValueError, match="external_sam_budget"):
        NgramSpeculator(cache(num_draft_tokens=4), 4, 4, corpora=ExternalCorpora(10), external_sam_budget=budget)
