"""NGRAM draft source: SGLang 0.5.23's n-gram corpus, one global trie shared by all requests, in pure Python.

Semantics follow `sglang/kernels/jit/csrc/ngram_corpus/{trie,result}.cpp` of the 0.5.23 wheel:

- `insert` takes the last `max_trie_depth` tokens of a sequence and inserts every suffix of that window. Each touched
  node gains one count (`freq`) and becomes its parent's most recent child. Then the whole path becomes the most
  recently used in a global LRU, parents ahead of their children.
- The trie holds at most `capacity` nodes, counting the root as SGLang does. Before each suffix is inserted, enough
  least-recently-used nodes are evicted to make room for it (`Trie::squeeze`). Because the LRU keeps parents ahead of
  children, only leaves are ever evicted.
- `draft` matches every suffix of the context's last `max_trie_depth` tokens. Each match with children is an anchor.
  Anchors are expanded longest first into one tree, merging equal tokens under the same tree parent, until
  `num_draft_tokens - 1` nodes exist:
  - BFS (`Trie::buildRecency`): breadth-first. Children are taken in recency order. The breadth starts at
    `(D-1-d)*s + min_bfs_breadth` for an anchor of depth d (s = (max-min)/(D-1), D = max_trie_depth) and shrinks by s
    at each level, never below 1. So long matches give narrow chains and short matches give wide bushes.
  - PROB (`Trie::buildFrequency`): best-first on a max-heap of path probabilities. Each expanded node offers its top
    `max_bfs_breadth` children by frequency (ties: smaller token first), each with prob = parent_prob * freq / sum.
    Ties in probability are popped in the order a libstdc++ `std::priority_queue` pops them, so the chosen nodes are
    the ones SGLang would choose.
- The rest of the budget is padded with token 0 under the root, so the verify width is always `num_draft_tokens`.

Three things differ from SGLang, and none of them changes which tokens are drafted:
- The output order is breadth-first, like SGLang's `fillResult`. But siblings come in the order they were added,
  where SGLang follows the hash order of a `std::unordered_map`.
- SGLang caches each request's suffix anchors between steps (`MatchState`). Here the match is recomputed from
  `context` on every call, so a suffix that entered the trie since the last step is always seen.
- There is no background insert thread: `insert` is synchronous, as after SGLang's `synchronize()`.
"""

from __future__ import annotations

import operator
from bisect import bisect_left, insort
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["DraftTree", "NgramCache"]

_MAX_TOKEN = 2**31 - 1  # SGLang stores token ids as int32
_SHIFT = 1 << 32  # PROB rank key: token - freq * _SHIFT sorts by (freq desc, token asc) as SGLang's CompareByFreq does
_TOKEN_MASK = _SHIFT - 1


@dataclass(frozen=True)
class DraftTree:
    """Draft nodes in topological order (every parent before its children). The root -- the last real token of
    the sequence -- is NOT included. parents[i] is the index in `tokens` of node i's parent, or -1 if its parent is
    the root."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    num_real: int  # nodes that came from the trie; the rest are SGLang-style pads (token 0, children of the root)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(
                "DraftTree: tokens and parents must have the same length, "
                f"got {len(self.tokens)} and {len(self.parents)}"
            )
        if not 0 <= self.num_real <= len(self.tokens):
            raise ValueError(f"DraftTree: num_real must be in [0, {len(self.tokens)}], got {self.num_real}")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"DraftTree: parents[{i}] must be -1 or an earlier index, got {parent}")

    def depths(self) -> tuple[int, ...]:
        """Depth of each node, 1 for children of the root."""
        out: list[int] = []
        for parent in self.parents:
            out.append(1 if parent < 0 else out[parent] + 1)
        return tuple(out)


class _Node:
    # children: token -> node, in recency order (most recent LAST); it doubles as SGLang's per-node `lru` list.
    # ranked: PROB only, rank keys of the children kept sorted (SGLang's `sorted_children`).
    # offers: PROB only, cached (freq / sum_freq, child) of the top children; None when the children changed.
    __slots__ = ("token", "parent", "children", "freq", "ranked", "offers")

    def __init__(self, token: int, parent: _Node | None, ranked: list[int] | None) -> None:
        self.token = token
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.freq = 1
        self.ranked = ranked
        self.offers: list[tuple[float, _Node]] | None = None


def _check_int(name: str, value: object, minimum: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"ngram: {name} must be an int, got {name}={value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"ngram: {name} >= {minimum} must hold, got {name}={value}; {fix}")
    return value


class NgramCache:
    """One global n-gram trie shared by every request, with SGLang 0.5.23's insert, draft, eviction and reset."""

    def __init__(
        self,
        *,
        max_trie_depth: int,
        capacity: int,
        min_bfs_breadth: int,
        max_bfs_breadth: int,
        match_type: Literal["BFS", "PROB"],
        num_draft_tokens: int,
    ) -> None:
        self._depth = _check_int("max_trie_depth", max_trie_depth, 2, "the n-gram window needs at least 2 tokens")
        _check_int("capacity", capacity, 1, "use a positive node budget")
        if capacity <= max_trie_depth:
            # SGLang 0.5.23 does not check this and crashes in Trie::squeeze (sgl-project/sglang#36495).
            raise ValueError(
                "ngram: capacity > max_trie_depth must hold, "
                f"got capacity={capacity}, max_trie_depth={max_trie_depth}; "
                "raise capacity (it counts the root, so one suffix of max_trie_depth tokens must fit beside it)"
            )
        self._capacity = capacity
        self._min_breadth = _check_int("min_bfs_breadth", min_bfs_breadth, 1, "use 1 or more")
        self._max_breadth = _check_int("max_bfs_breadth", max_bfs_breadth, 1, "use 1 or more")
        if min_bfs_breadth > max_bfs_breadth:
            raise ValueError(
                "ngram: min_bfs_breadth <= max_bfs_breadth must hold, "
                f"got min_bfs_breadth={min_bfs_breadth}, max_bfs_breadth={max_bfs_breadth}; lower min or raise max"
            )
        if match_type not in ("BFS", "PROB"):
            raise ValueError(
                f"ngram: match_type must be 'BFS' or 'PROB' (case-sensitive), got match_type={match_type!r}"
            )
        self._prob = match_type == "PROB"
        self._num_draft_tokens = _check_int(
            "num_draft_tokens", num_draft_tokens, 1, "it counts the root, so 1 means no draft nodes"
        )
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Empty the trie, as SGLang's /flush_cache does (`Ngram::reset`)."""
        # The root is never an anchor, so it keeps no ranking: with one child per distinct token it would be the
        # largest list to maintain, for nothing.
        self._root = _Node(-1, None, None)
        # Every non-root node, least recently used first (SGLang's global_lru_ reversed).
        self._lru: OrderedDict[_Node, None] = OrderedDict()

    @property
    def num_nodes(self) -> int:
        """Nodes in the trie, not counting the root. Always at most `capacity - 1`: the root takes one slot."""
        return len(self._lru)

    # ------------------------------------------------------------------ insert

    def insert(self, tokens: Sequence[int]) -> None:
        """What SGLang does after each decode verify step for one request: take the last `max_trie_depth` tokens of
        prompt+output and insert every suffix of that window (each capped at max_trie_depth)."""
        window = self._window(tokens, "tokens")
        n = len(window)
        prob = self._prob
        lru = self._lru
        touch = lru.move_to_end
        root = self._root
        room = self._capacity - 1  # the root takes one slot
        for start in range(n):
            # The window is at most max_trie_depth long, so every suffix already fits the cap.
            free = room - len(lru)
            if n - start > free:
                self._squeeze(n - start - free)
            cursor = root
            path = []
            for token in window[start:]:
                children = cursor.children
                node = children.get(token)
                if node is None:
                    node = _Node(token, cursor, [] if prob else None)
                    children[token] = node
                    lru[node] = None
                    if cursor.ranked is not None:  # PROB, below the root
                        cursor.offers = None
                        insort(cursor.ranked, token - _SHIFT)
                else:
                    if len(children) > 1:
                        children[token] = children.pop(token)  # most recent child goes last
                    ranked = cursor.ranked
                    if ranked is not None:
                        cursor.offers = None
                        if len(ranked) == 1:
                            ranked[0] -= _SHIFT
                        else:
                            old = token - node.freq * _SHIFT
                            idx = bisect_left(ranked, old)
                            del ranked[idx]
                            insort(ranked, old - _SHIFT, 0, idx)  # a higher count only moves it forward
                    node.freq += 1
                path.append(node)
                cursor = node
            # Deepest first, so that the parents end up more recent than their children.
            for node in reversed(path):
                touch(node)

    def _squeeze(self, count: int) -> None:
        pop = self._lru.popitem
        for _ in range(count):
            node, _ = pop(last=False)
            if node.children:
                raise RuntimeError("ngram trie invariant broken: the least recently used node still has children")
            parent = node.parent
            del parent.children[node.token]
            ranked = parent.ranked
            if ranked is not None:
                parent.offers = None
                del ranked[bisect_left(ranked, node.token - node.freq * _SHIFT)]

    # ------------------------------------------------------------------ draft

    def draft(self, context: Sequence[int]) -> DraftTree:
        """Draft tree for a sequence whose last token is `context[-1]` (the root). Exactly num_draft_tokens - 1 nodes:
        trie nodes first, then pads (token 0 under the root) as SGLang does, so the verify width is constant."""
        window = self._window(context, "context")
        if not window:
            raise ValueError(
                "ngram: context must hold at least one token (its last token is the root), got an empty one"
            )
        budget = self._num_draft_tokens - 1
        anchors = self._anchors(window)
        # Tree under construction; position 0 is the root, as in SGLang's `std::vector<Node> tree`.
        tree_tokens = [window[-1]]
        tree_parents = [-1]
        tree_next: list[dict[int, int]] = [{}]
        if self._prob:
            self._build_frequency(anchors, budget, tree_tokens, tree_parents, tree_next)
        else:
            self._build_recency(anchors, budget, tree_tokens, tree_parents, tree_next)
        return self._layout(tree_tokens, tree_parents, budget)

    def _anchors(self, window: list[int]) -> list[tuple[_Node, int]]:
        """Trie nodes of the context suffixes that have children, longest suffix first, with their depths."""
        root = self._root
        n = len(window)
        anchors = []
        for depth in range(n, 0, -1):
            cursor: _Node | None = root
            for token in window[n - depth :]:
                cursor = cursor.children.get(token)  # type: ignore[union-attr]
                if cursor is None:
                    break
            else:
                if cursor.children:  # type: ignore[union-attr]
                    anchors.append((cursor, depth))
        return anchors

    def _build_recency(
        self, anchors: list[tuple[_Node, int]], budget: int, tree_tokens: list[int], tree_parents: list[int],
        tree_next: list[dict[int, int]],
    ) -> None:
        max_match_depth = max(1, self._depth - 1)
        scale = (self._max_breadth - self._min_breadth) / max_match_depth
        cursor = 1  # next free tree position; positions 1..budget are draft nodes
        for anchor, depth in anchors:
            if cursor > budget:
                break
            queue = deque([(0, (max_match_depth - depth) * scale + self._min_breadth, anchor)])
            while queue and cursor <= budget:
                parent, cur_breadth, node = queue.popleft()
                breadth = int(cur_breadth)  # truncates toward zero like C++'s int32_t(double)
                if breadth < 1:
                    breadth = 1
                child_breadth = cur_breadth - scale
                next_of_parent = tree_next[parent]
                taken = 0
                for child in reversed(node.children.values()):  # most recent first
                    if taken >= breadth or cursor > budget:
                        break
                    taken += 1
                    pos = next_of_parent.get(child.token)
                    if pos is None:
                        pos = cursor
                        cursor += 1
                        next_of_parent[child.token] = pos
                        tree_tokens.append(child.token)
                        tree_parents.append(parent)
                        tree_next.append({})
                    if child.children:  # expanding a leaf adds nothing: skip the queue round trip
                        queue.append((pos, child_breadth, child))

    def _build_frequency(
        self, anchors: list[tuple[_Node, int]], budget: int, tree_tokens: list[int], tree_parents: list[int],
        tree_next: list[dict[int, int]],
    ) -> None:
        top_k = self._max_breadth
        cursor = 1
        for anchor, _depth in anchors:
            if cursor > budget:
                break
            heap: list[tuple[float, int, _Node]] = []
            _offer_children(heap, 0, anchor, 1.0, top_k)
            while heap and cursor <= budget:
                prob, parent, node = _heap_pop(heap)
                next_of_parent = tree_next[parent]
                pos = next_of_parent.get(node.token)
                if pos is None:
                    pos = cursor
                    cursor += 1
                    next_of_parent[node.token] = pos
                    tree_tokens.append(node.token)
                    tree_parents.append(parent)
                    tree_next.append({})
                if node.children:
                    _offer_children(heap, pos, node, prob, top_k)

    @staticmethod
    def _layout(tree_tokens: list[int], tree_parents: list[int], budget: int) -> DraftTree:
        """Breadth-first order like SGLang's fillResult, root dropped, then pads up to the budget."""
        kids: list[list[int]] = [[] for _ in tree_tokens]
        for pos in range(1, len(tree_tokens)):
            kids[tree_parents[pos]].append(pos)
        order = list(kids[0])
        for pos in order:  # grows while iterating: a breadth-first walk
            order.extend(kids[pos])
        index = {0: -1}
        tokens, parents = [], []
        for pos in order:
            index[pos] = len(tokens)
            tokens.append(tree_tokens[pos])
            parents.append(index[tree_parents[pos]])
        num_real = len(tokens)
        pads = budget - num_real
        return DraftTree(tuple(tokens) + (0,) * pads, tuple(parents) + (-1,) * pads, num_real)

    # ------------------------------------------------------------------ helpers

    def _window(self, tokens: Sequence[int], name: str) -> list[int]:
        try:
            tail = tokens[-self._depth :]
            window = [operator.index(t) for t in tail]
        except TypeError as err:
            raise ValueError(
                f"ngram: {name} must be a sequence of int token ids, got {type(tokens).__name__}: {err}"
            ) from None
        for t in window:
            if not 0 <= t <= _MAX_TOKEN:
                raise ValueError(f"ngram: token ids in {name} must be in [0, {_MAX_TOKEN}] (int32), got {t}")
        return window


def _offer_children(heap: list, parent: int, node: _Node, prob: float, top_k: int) -> None:
    """Trie::buildFrequency's addToHeap: push the node's top_k children by frequency with prob * freq / sum_freq."""
    offers = node.offers
    if offers is None:
        children = node.children
        top = [children[key & _TOKEN_MASK] for key in node.ranked[:top_k]]
        sum_freq = float(sum(child.freq for child in top)) or 1.0
        # C++ computes freq / sum_freq * prob left to right, so caching freq / sum_freq keeps every bit.
        offers = node.offers = [(child.freq / sum_freq, child) for child in top]
    for ratio, child in offers:
        item = (ratio * prob, parent, child)
        heap.append(item)
        _sift_up(heap, len(heap) - 1, 0, item)


# std::priority_queue<..., CompareByLastDouble> from libstdc++, so that ties in probability are popped in SGLang's
# order. Only the probability (item[0]) is compared, as in trie.cpp.


def _heap_pop(heap: list) -> tuple:
    top = heap[0]
    last = heap.pop()
    n = len(heap)
    if n == 0:
        return top
    # std::__adjust_heap: walk the hole down to a leaf along the larger child, then sift `last` up from there.
    hole = 0
    child = 0
    while child < (n - 1) // 2:
        child = 2 * (child + 1)
        if heap[child][0] < heap[child - 1][0]:
            child -= 1
        heap[hole] = heap[child]
        hole = child
    if n % 2 == 0 and child == (n - 2) // 2:
        child = 2 * (child + 1)
        heap[hole] = heap[child - 1]
        hole = child - 1
    _sift_up(heap, hole, 0, last)
    return top


def _sift_up(heap: list, hole: int, top: int, item: tuple) -> None:
    value = item[0]
    parent = (hole - 1) // 2
    while hole > top and heap[parent][0] < value:
        heap[hole] = heap[parent]
        hole = parent
        parent = (hole - 1) // 2
    heap[hole] = item
