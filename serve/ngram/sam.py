"""SGLang 0.5.23's suffix automaton over an external corpus (`ngram_corpus/suffix_automaton.cpp`), in pure Python.

- `append` extends the automaton token by token (the classic online construction; a clone copies its original's
  transitions and last end position, with no occurrences of its own). Documents are joined by `SEPARATOR_TOKEN`
  (int32 min), which never matches a context token and is never drafted, so drafts do not cross documents.
- `finalize` propagates occurrence counts and last end positions up the suffix links (longest states first), then
  orders every state's children (the separator left out) twice: by frequency (occurrences desc, token asc) and by
  recency (last end position desc, token asc).
- `build` matches the context's last `max_trie_depth` tokens (the longest suffix found in the corpus, then its
  suffix-link chain: every state on it with children is an anchor, longest first, with its matched length) and
  expands the anchors into one tree within a node budget exactly as the trie does: BFS (recency order, breadth
  `(D-1-len)*s + min_bfs_breadth` shrinking by s per level, at least 1) or PROB (best-first on path probability over
  the top `max_bfs_breadth` children by frequency, ties popped in libstdc++'s order). Unlike the trie, a path may run
  as deep as the budget allows (until the document ends).

The automaton is immutable once finalized, so drafting needs no lock. Memory is a few hundred bytes per corpus token
(two states per token at most, each with a dict): fine for corpora of up to a few million tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from serve.ngram.drafttree import MAX_TOKEN, place
from serve.ngram.stdheap import heap_pop, heap_push

__all__ = ["SEPARATOR_TOKEN", "SuffixAutomaton"]

SEPARATOR_TOKEN = -(2**31)  # SuffixAutomaton::kSeparatorToken


class SuffixAutomaton:
    """One external corpus. `append` (any number of times), then `finalize`, then `build` for each draft."""

    def __init__(self) -> None:
        self._link = [-1]
        self._max_len = [0]
        self._next: list[dict[int, int]] = [{}]
        self._occ = [0]
        self._end = [-1]
        self._last = 0
        self._pos = 0
        self._finalized = False
        self._loaded = False
        self._by_freq: list[list[tuple[int, int]]] = []
        self._by_recency: list[list[tuple[int, int]]] = []

    @property
    def empty(self) -> bool:
        """True until a finalized automaton holds at least one token (SGLang refuses to publish an empty corpus)."""
        return not self._loaded

    @property
    def token_count(self) -> int:
        """Tokens appended, separators included (what SGLang's /list_external_corpora reports)."""
        return self._pos

    def append(self, tokens: Iterable[int]) -> None:
        if self._finalized:
            raise RuntimeError("Cannot append tokens after finalizing the SAM.")
        for token in tokens:
            if isinstance(token, bool) or not isinstance(token, int) or not (
                    0 <= token <= MAX_TOKEN or token == SEPARATOR_TOKEN):
                raise ValueError(
                    f"external corpus: token ids must be ints in [0, {MAX_TOKEN}] (or the separator "
                    f"{SEPARATOR_TOKEN}), got {token!r}"
                )
            self._extend(token)

    def finalize(self) -> None:
        if self._finalized:
            return
        self._finalized = True
        if self._pos == 0:
            return
        occ, end, link = self._occ, self._end, self._link
        for state in sorted(range(len(link)), key=self._max_len.__getitem__, reverse=True):
            parent = link[state]
            if parent >= 0:
                occ[parent] += occ[state]
                if end[state] > end[parent]:
                    end[parent] = end[state]
        for nxt in self._next:
            children = [(token, child) for token, child in nxt.items() if token != SEPARATOR_TOKEN]
            self._by_freq.append(sorted(children, key=lambda c: (-occ[c[1]], c[0], c[1])))
            self._by_recency.append(sorted(children, key=lambda c: (-end[c[1]], c[0], c[1])))
        self._loaded = True

    def _extend(self, token: int) -> None:
        link, max_len, nxt = self._link, self._max_len, self._next
        cur = len(link)
        link.append(-1)
        max_len.append(max_len[self._last] + 1)
        nxt.append({})
        self._occ.append(1)
        self._end.append(self._pos)
        self._pos += 1
        p = self._last
        self._last = cur
        while p != -1 and token not in nxt[p]:
            nxt[p][token] = cur
            p = link[p]
        if p == -1:
            link[cur] = 0
            return
        q = nxt[p][token]
        if max_len[p] + 1 == max_len[q]:
            link[cur] = q
            return
        clone = len(link)
        link.append(link[q])
        max_len.append(max_len[p] + 1)
        nxt.append(dict(nxt[q]))
        self._occ.append(0)
        self._end.append(self._end[q])
        while p != -1 and nxt[p].get(token) == q:
            nxt[p][token] = clone
            p = link[p]
        link[q] = clone
        link[cur] = clone

    # ------------------------------------------------------------------ drafting

    def build(
        self, window: list[int], budget: int, *, max_trie_depth: int, min_bfs_breadth: int, max_bfs_breadth: int,
        prob: bool,
    ) -> tuple[list[int], list[int]]:
        """Draft tree rooted at window[-1] with at most `budget` nodes: (tokens, parents), position 0 the root, every
        parent before its children, no pads (SGLang's `buildRecency` / `buildFrequency`)."""
        tokens, parents = [window[-1]], [-1]
        tree_next: list[dict[int, int]] = [{}]
        anchors = self._match(window, max_trie_depth)
        if prob:
            self._frequency(anchors, budget, max_bfs_breadth, tokens, parents, tree_next)
        else:
            self._recency(anchors, budget, max_trie_depth, min_bfs_breadth, max_bfs_breadth, tokens, parents,
                          tree_next)
        return tokens, parents

    def _match(self, context: list[int], max_depth: int) -> list[tuple[int, int]]:
        if self.empty or not context:
            return []
        nxt, link, max_len = self._next, self._link, self._max_len
        state = matched = 0
        for token in context[max(0, len(context) - max_depth):]:
            while state != 0 and token not in nxt[state]:
                state = link[state]
                matched = min(matched, max_len[state])
            child = nxt[state].get(token)
            if child is not None:
                state = child
                matched += 1
            else:  # state is the root here
                state = matched = 0
        anchors = []
        while state > 0 and matched > 0:
            if self._by_freq[state]:
                anchors.append((state, matched))
            state = link[state]
            if state <= 0:
                break
            matched = min(matched, max_len[state])
        return anchors

    def _recency(self, anchors, budget, depth, min_breadth, max_breadth, tokens, parents, tree_next) -> None:
        max_match_depth = max(1, depth - 1)
        scale = (max_breadth - min_breadth) / max_match_depth
        by_recency = self._by_recency
        cursor = 1
        for state, matched in anchors:
            queue = deque([(0, (max_match_depth - matched) * scale + min_breadth, state)])
            while queue and cursor <= budget:
                parent, cur_breadth, node = queue.popleft()
                breadth = max(1, int(cur_breadth))  # int() truncates toward zero like C++'s int32_t(double)
                for i, (token, child) in enumerate(by_recency[node]):
                    if i >= breadth or cursor > budget:
                        break
                    pos, cursor = place(token, parent, cursor, tokens, parents, tree_next)
                    queue.append((pos, cur_breadth - scale, child))

    def _frequency(self, anchors, budget, top_k, tokens, parents, tree_next) -> None:
        occ, by_freq = self._occ, self._by_freq
        heap: list = []

        def offer(parent: int, state: int, prob: float) -> None:
            children = by_freq[state][:top_k]
            if not children:
                return
            sum_freq = float(sum(occ[child] for _, child in children))
            if sum_freq <= 0:
                sum_freq = 1.0
            for token, child in children:
                heap_push(heap, (occ[child] / sum_freq * prob, parent, token, child))

        cursor = 1
        for state, _matched in anchors:
            offer(0, state, 1.0)
            while heap and cursor <= budget:
                prob, parent, token, child = heap_pop(heap)
                pos, cursor = place(token, parent, cursor, tokens, parents, tree_next)
                offer(pos, child, prob)
