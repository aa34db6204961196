"""SGLang 0.5.23's external n-gram corpora: loading (`cpp_ngram/external_corpus.py`, the tokenizer manager's
`add_external_corpus`, `NgramCorpus.load_external_corpus_named`) and drafting beside the trie (`Ngram::batchMatch`).

Loading:
- A corpus file is JSONL, one JSON string per non-blank line. Each document is tokenized without special tokens
  (empty ones are skipped) and documents are joined by `SEPARATOR_TOKEN`. If the tokens, separators included, would
  exceed `external_corpus_max_tokens`, the file is refused (naming the line). Documents given inline (the runtime
  route's `documents`) are cut at the limit instead, and the result says it was truncated.
- `external_corpus_max_tokens` also bounds all loaded corpora together: a corpus that does not fit in what the others
  left is refused. Ids are unique (remove first to replace); an empty corpus is refused.
- `/flush_cache` keeps corpora (only the trie and match states are reset): `ExternalCorpora` is not touched by it.

Drafting (`draft_with_corpora`): with n > 0 corpora and `external_sam_budget` > 0, the `num_draft_tokens - 1` nodes
are split: each corpus gets `min(sam_budget, total) // n` nodes and the trie the rest. If that share is 0 the trie
drafts alone with the whole budget. The trie's and each corpus' trees are merged under the root by their root-to-leaf
paths (SGLang's `combineRootResults_`): equal prefixes merge, so the merged tree is the union of the trees, except
that a lone token-0 leaf under the root is dropped (SGLang treats it as padding); pads fill the rest.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from serve.ngram.drafttree import DraftTree, layout
from serve.ngram.trie import MatchState, NgramCache
from serve.ngram.sam import SEPARATOR_TOKEN, SuffixAutomaton

__all__ = ["ExternalCorpora", "corpus_file_chunks", "document_chunks", "draft_with_corpora"]

Encode = Callable[[str], Sequence[int]]  # text -> token ids, without special tokens
CHUNK_SIZE = 4096  # SGLang's DEFAULT_CHUNK_SIZE: how tokens are streamed into the automaton


def corpus_file_chunks(path: str | Path, encode: Encode, max_tokens: int,
                       chunk_size: int = CHUNK_SIZE) -> Iterator[list[int]]:
    """Token chunks of a JSONL corpus file, with SGLang's checks and messages (`iter_external_corpus_chunks`)."""
    corpus_path = Path(path)
    if not corpus_path.is_file():
        raise ValueError(f"External ngram corpus path does not exist: {path}")
    if max_tokens <= 0:
        raise ValueError("External ngram corpus max tokens must be positive.")
    total = 0
    has_previous = False
    with corpus_path.open("r", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"Invalid JSON in external ngram corpus at line {line_no}: {err.msg}") from None
            if not isinstance(record, str):
                raise ValueError(f"Invalid external ngram corpus record at line {line_no}: expected a JSON string.")
            ids = list(encode(record))
            if not ids:
                continue
            following = total + (1 if has_previous else 0) + len(ids)
            if following > max_tokens:
                raise ValueError(
                    f"External ngram corpus exceeds the configured token limit ({max_tokens}) at line {line_no} "
                    f"after loading {total} tokens."
                )
            total = following
            if has_previous:
                ids = [SEPARATOR_TOKEN, *ids]
            for i in range(0, len(ids), chunk_size):
                yield ids[i:i + chunk_size]
            has_previous = True


def document_chunks(documents: Iterable[str], encode: Encode, max_tokens: int) -> tuple[list[list[int]], bool]:
    """(chunks, truncated) for inline documents: one chunk per document, cut at the token limit as SGLang's
    tokenizer manager cuts them (the document that would cross the limit and all after it are left out)."""
    chunks: list[list[int]] = []
    total = 0
    for doc in documents:
        if not isinstance(doc, str):
            raise ValueError(f"external corpus: documents must be strings, got {type(doc).__name__}")
        if not doc:
            continue
        ids = list(encode(doc))
        if not ids:
            continue
        if chunks:
            ids = [SEPARATOR_TOKEN, *ids]
        if total + len(ids) > max_tokens:
            return chunks, True
        chunks.append(ids)
        total += len(ids)
    return chunks, False


class ExternalCorpora:
    """The named corpora of one engine and their shared token budget. Thread-safe: corpora are added from HTTP
    threads while the decode worker drafts from a snapshot."""

    def __init__(self, max_tokens: int) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0:
            raise ValueError(
                f"ngram: external_corpus_max_tokens must be a positive int, got {max_tokens!r}; "
                "SGLang's default is 10000000"
            )
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._sams: dict[str, SuffixAutomaton] = {}
        self._loading: set[str] = set()

    def add(self, corpus_id: str, chunks: Iterable[Sequence[int]]) -> int:
        """Build a corpus from token chunks (separators already in) and publish it; returns its token count.
        Raises ValueError for a duplicate id, a corpus over the remaining budget, or an empty corpus."""
        if not isinstance(corpus_id, str) or not corpus_id:
            raise ValueError(f"external corpus: corpus_id must be a non-empty string, got {corpus_id!r}")
        with self._lock:
            if corpus_id in self._sams or corpus_id in self._loading:
                raise ValueError(
                    f"External corpus '{corpus_id}' already exists. Remove it before adding a new corpus with the "
                    "same id."
                )
            # Stale by design, as in SGLang: removals during the load do not raise the budget of this load.
            remaining = self.max_tokens - sum(sam.token_count for sam in self._sams.values())
            self._loading.add(corpus_id)
        try:
            sam = SuffixAutomaton()
            loaded = 0
            for chunk in chunks:
                chunk = list(chunk)
                if loaded + len(chunk) > remaining:
                    raise ValueError(
                        f"External ngram corpus exceeds the remaining token budget ({remaining}) after loading "
                        f"{loaded} tokens."
                    )
                loaded += len(chunk)
                sam.append(chunk)
            sam.finalize()
            if sam.empty:
                raise ValueError("External corpus is empty — no tokens were loaded.")
            with self._lock:
                self._sams[corpus_id] = sam
            return loaded
        finally:
            with self._lock:
                self._loading.discard(corpus_id)

    def add_file(self, corpus_id: str, path: str | Path, encode: Encode) -> int:
        """A JSONL corpus file (the start-up flag uses the path as its id)."""
        return self.add(corpus_id, corpus_file_chunks(path, encode, self.max_tokens))

    def add_documents(self, corpus_id: str, documents: Iterable[str], encode: Encode) -> tuple[int, bool]:
        """Inline documents: (tokens loaded, truncated at the token limit)."""
        chunks, truncated = document_chunks(documents, encode, self.max_tokens)
        return self.add(corpus_id, chunks), truncated

    def remove(self, corpus_id: str) -> None:
        """Removing an id that is not loaded is not an error (as in SGLang)."""
        with self._lock:
            self._sams.pop(corpus_id, None)

    def list(self) -> dict[str, int]:
        """corpus id -> token count (separators included)."""
        with self._lock:
            return {cid: sam.token_count for cid, sam in self._sams.items()}

    def snapshot(self) -> tuple[SuffixAutomaton, ...]:
        with self._lock:
            return tuple(self._sams.values())


def draft_with_corpora(
    cache: NgramCache, sams: Sequence[SuffixAutomaton], sam_budget: int, context: Sequence[int],
    state: MatchState | None = None, total_len: int | None = None,
) -> DraftTree:
    """`cache.draft` with the external corpora drafting beside the trie (SGLang's `Ngram::batchMatch`)."""
    total = cache.num_draft_tokens - 1
    share = min(sam_budget, total) // len(sams) if sams else 0
    if share == 0:
        return cache.draft(context, state, total_len)
    trie_tokens, trie_parents = cache.build(context, total - share * len(sams), state, total_len)
    window = [int(t) for t in context[-cache.max_trie_depth:]]  # checked by cache.build above
    trees = [(trie_tokens, trie_parents)]
    for sam in sams:
        trees.append(sam.build(window, share, max_trie_depth=cache.max_trie_depth,
                               min_bfs_breadth=cache.min_bfs_breadth, max_bfs_breadth=cache.max_bfs_breadth,
                               prob=cache.match_type == "PROB"))
    tokens, parents = _merge(window[-1], trees)
    return layout(tokens, parents, total)


def _merge(root: int, trees: list[tuple[list[int], list[int]]]) -> tuple[list[int], list[int]]:
    """Union of the trees' root-to-node paths, without lone token-0 leaves under the root (combineRootResults_)."""
    tokens, parents = [root], [-1]
    tree_next: list[dict[int, int]] = [{}]
    for tree_tokens, tree_parents in trees:
        has_child = [False] * len(tree_tokens)
        for parent in tree_parents[1:]:
            has_child[parent] = True
        where = {0: 0}  # position in this tree -> position in the merged tree
        for pos in range(1, len(tree_tokens)):
            token, parent = tree_tokens[pos], tree_parents[pos]
            if parent == 0 and token == 0 and not has_child[pos]:
                continue
            merged_parent = where[parent]
            at = tree_next[merged_parent].get(token)
            if at is None:
                at = tree_next[merged_parent][token] = len(tokens)
                tokens.append(token)
                parents.append(merged_parent)
                tree_next.append({})
            where[pos] = at
    return tokens, parents
