"""NGRAM draft source: SGLang 0.5.23's n-gram corpus, one global trie shared by all requests, in pure Python.

Semantics follow `sglang/kernels/jit/csrc/ngram_corpus/{trie,result}.cpp` of the 0.5.23 wheel:

- `insert` takes the last `max_trie_depth` tokens of a sequence and inserts every suffix of that window. Each touched
  node gains one count (`freq`) and becomes its parent's most recent child. Then the whole path becomes the most
  recently used in a global LRU, parents ahead of their children.
- The trie holds at most `capacity` nodes, counting the root as SGLang does. Before each suffix is inserted, enough
  least-recently-used nodes are evicted to make room for it (`Trie::squeeze`). Because the LRU keeps parents ahead of
  children, only leaves are ever evicted.
- `draft` finds the trie nodes of the suffixes of the context's last `max_trie_depth` tokens (the anchors) through a
  per-request `MatchState`, as `Trie::match` does: a state that still describes this request's previous step is
  advanced by the tokens appended since then, one token at a time from the anchors it cached; otherwise (first
  step, a flush, an evicted anchor, no forward progress) it is rebuilt from the context. Advancing does not see a
  suffix that entered the trie after the state was cached unless it is at most as long as the tokens appended since,
  so drafts depend on the state, exactly as in SGLang. Without a state, `draft` rebuilds (a fresh `MatchState`).
- Anchors with children are expanded longest first into one tree, merging equal tokens under the same tree parent,
  until `num_draft_tokens - 1` nodes exist:
  - BFS (`Trie::buildRecency`): breadth-first. Children are taken in recency order. The breadth starts at
    `(D-1-d)*s + min_bfs_breadth` for an anchor of depth d (s = (max-min)/(D-1), D = max_trie_depth) and shrinks by s
    at each level, never below 1. So long matches give narrow chains and short matches give wide bushes.
  - PROB (`Trie::buildFrequency`): best-first on a max-heap of path probabilities. Each expanded node offers its top
    `max_bfs_breadth` children by frequency (ties: smaller token first), each with prob = parent_prob * freq / sum.
    Ties in probability are popped in the order a libstdc++ `std::priority_queue` pops them, so the chosen nodes are
    the ones SGLang would choose. `min_bfs_breadth` plays no part in PROB.
- The rest of the budget is padded with token 0 under the root, so the verify width is always `num_draft_tokens`.

When inserts happen (one step behind, a round's inserts after the whole round drafted) is the caller's schedule:
`serve.ngram.schedule.NgramDrafter` runs SGLang's. One thing differs from SGLang and does not change which tokens are
drafted: the output order is breadth-first like SGLang's `fillResult`, but siblings come in the order they were
added, where SGLang follows the hash order of a `std::unordered_map` (the same tree, laid out differently).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque
from collections.abc import Sequence
from heapq import heapify, heappop, heappush
from typing import Any, Literal

from serve.ngram.drafttree import DraftTree, layout, place, token_ids
from serve.ngram.stdheap import heap_pop, heap_push

__all__ = ["DraftTree", "MatchState", "NgramCache", "layout", "token_ids"]

_SHIFT = 1 << 32  # PROB rank key: token - freq * _SHIFT sorts by (freq desc, token asc) as SGLang's CompareByFreq does
_TOKEN_MASK = _SHIFT - 1


class _Node:
    # children: token -> node, in recency order (most recent LAST); it doubles as SGLang's per-node `lru` list.
    # ranked: PROB only, rank keys of the children kept sorted (SGLang's `sorted_children`).
    # offers: PROB only, cached (freq / sum_freq, child) of the top children; None when the children changed.
    # alive: False once evicted, so that a MatchState holding it rebuilds (SGLang's NodeRef version check).
    # stamp: when the node was last touched; the global LRU is the order of stamps (smallest: least recent).
    __slots__ = ("token", "parent", "children", "freq", "ranked", "offers", "alive", "stamp")

    def __init__(self, token: int, parent: _Node | None, ranked: list[int] | None) -> None:
        self.token = token
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.freq = 1
        self.ranked = ranked
        self.offers: list[tuple[float, _Node]] | None = None
        self.alive = True
        self.stamp = 0

    def __lt__(self, other: _Node) -> bool:  # never decides: stamps are unique (heap entries compare stamps first)
        return False


class MatchState:
    """One request's cached suffix matches between steps (trie.cpp's `MatchState`). `anchors[d - 1]` is the trie node
    of the length-d suffix ending at the last token the state covered (None: not in the trie then), and
    `processed_total_len` is the request length it covered. Create one per request, pass it to every
    `NgramCache.draft` of that request, drop it when the request ends (SGLang erases it when the request leaves the
    decode batch). A flush invalidates every state (the cache's epoch changes)."""

    __slots__ = ("epoch", "processed_total_len", "anchors", "native")

    def __init__(self) -> None:
        self.epoch = 0  # the cache's epochs start at 1: a new state never looks current
        self.processed_total_len = 0
        self.anchors: list[_Node | None] = []
        self.native: Any = None  # the compiled trie's twin of this state (serve.ngram.compiled)


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
        self._epoch = 0
        self.reset()

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Empty the trie, as SGLang's /flush_cache does (`Ngram::reset`)."""
        # The root is never an anchor, so it keeps no ranking: with one child per distinct token it would be the
        # largest list to maintain, for nothing.
        self._root = _Node(-1, None, None)
        # SGLang's global LRU as touch stamps: a node's stamp is the time of its last touch. Stamps are unique, so
        # the LRU order is the order of stamps; eviction pops them from a heap built the first time the trie is
        # full (with stale entries of since-touched nodes pushed again with their new stamps), so that an insert
        # that evicts nothing -- nearly all of them -- pays no LRU bookkeeping beyond one stamp per node.
        self._nodes = 0  # non-root nodes
        self._clock = 0
        self._heap: list[tuple[int, _Node]] | None = None
        self._epoch += 1  # every MatchState cached before the flush rebuilds (SGLang's trie_epoch_)

    @property
    def max_trie_depth(self) -> int:
        return self._depth

    @property
    def min_bfs_breadth(self) -> int:
        return self._min_breadth

    @property
    def max_bfs_breadth(self) -> int:
        return self._max_breadth

    @property
    def match_type(self) -> str:
        return "PROB" if self._prob else "BFS"

    @property
    def num_draft_tokens(self) -> int:
        return self._num_draft_tokens

    @property
    def num_nodes(self) -> int:
        """Nodes in the trie, not counting the root. Always at most `capacity - 1`: the root takes one slot."""
        return self._nodes

    # ------------------------------------------------------------------ insert

    def insert(self, tokens: Sequence[int]) -> None:
        """What SGLang does after each decode verify step for one request: take the last `max_trie_depth` tokens of
        prompt+output and insert every suffix of that window (each capped at max_trie_depth)."""
        self.insert_window(self._window(tokens, "tokens"))

    def insert_window(self, window: list[int]) -> None:
        """`insert` of a window already checked by `draft` (at most max_trie_depth valid token ids): the drafting
        schedule inserts the windows it drafted from."""
        n = len(window)
        prob = self._prob
        root = self._root
        heap = self._heap
        room = self._capacity - 1  # the root takes one slot
        clock = self._clock
        for start in range(n):
            # The window is at most max_trie_depth long, so every suffix already fits the cap.
            length = n - start
            free = room - self._nodes
            if length > free:
                self._clock = clock
                self._squeeze(length - free)
                heap = self._heap
            # The path is touched deepest first in SGLang, so that parents end up more recent than their children:
            # the node at depth i of this suffix gets stamp clock + length - 1 - i.
            stamp = clock + length
            clock = stamp
            cursor = root
            for token in window[start:]:
                stamp -= 1
                children = cursor.children
                node = children.get(token)
                if node is None:
                    node = _Node(token, cursor, [] if prob else None)
                    children[token] = node
                    self._nodes += 1
                    node.stamp = stamp
                    if heap is not None:
                        heappush(heap, (stamp, node))
                    if cursor.ranked is not None:  # PROB, below the root
                        cursor.offers = None
                        insort(cursor.ranked, token - _SHIFT)
                else:
                    node.stamp = stamp
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
                cursor = node
        self._clock = clock

    def _squeeze(self, count: int) -> None:
        heap = self._heap
        if heap is None:
            heap = self._heap = [(node.stamp, node) for node in self._walk()]
            heapify(heap)
        elif len(heap) > 4 * self._nodes + 64:  # mostly stale entries: rebuild
            heap[:] = [(node.stamp, node) for node in self._walk()]
            heapify(heap)
        while count:
            stamp, node = heappop(heap)
            if not node.alive:
                continue
            if node.stamp != stamp:  # touched since this entry: its place in the LRU is later
                heappush(heap, (node.stamp, node))
                continue
            count -= 1
            self._nodes -= 1
            node.alive = False
            if node.children:
                raise RuntimeError("ngram trie invariant broken: the least recently used node still has children")
            parent = node.parent
            if parent is None:
                raise RuntimeError("ngram trie invariant broken: the root was chosen for eviction")
            del parent.children[node.token]
            ranked = parent.ranked
            if ranked is not None:
                parent.offers = None
                del ranked[bisect_left(ranked, node.token - node.freq * _SHIFT)]

    def _walk(self) -> list[_Node]:
        """Every non-root node."""
        out: list[_Node] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # ------------------------------------------------------------------ draft

    def draft(self, context: Sequence[int], state: MatchState | None = None, total_len: int | None = None) -> DraftTree:
        """Draft tree for a sequence whose last token is `context[-1]` (the root). Exactly num_draft_tokens - 1 nodes:
        trie nodes first, then pads (token 0 under the root) as SGLang does, so the verify width is constant.

        `state` is the request's MatchState (updated in place); `total_len` is the full length of the request's
        sequence, of which `context` is the tail (default: len(context)). Without a state the match is rebuilt."""
        budget = self._num_draft_tokens - 1
        return layout(*self.build(context, budget, state, total_len), budget)

    def build(
        self, context: Sequence[int], budget: int, state: MatchState | None = None, total_len: int | None = None
    ) -> tuple[list[int], list[int]]:
        """SGLang's `Trie::buildRecency`/`buildFrequency` with a node budget (what `draft` and the external corpus'
        budget split use): the tree as (tokens, parents), position 0 the root (context[-1]), every parent before its
        children, no pads."""
        window, total = self._query(context, total_len)
        anchors = self._match(window, state or MatchState(), total)
        # Tree under construction; position 0 is the root, as in SGLang's `std::vector<Node> tree`.
        tree_tokens = [window[-1]]
        tree_parents = [-1]
        tree_next: list[dict[int, int]] = [{}]
        if self._prob:
            self._build_frequency(anchors, budget, tree_tokens, tree_parents, tree_next)
        else:
            self._build_recency(anchors, budget, tree_tokens, tree_parents, tree_next)
        return tree_tokens, tree_parents

    # ------------------------------------------------------------------ match state (trie.cpp's Trie::match)

    def _match(self, window: list[int], state: MatchState, total_len: int) -> list[tuple[_Node, int]]:
        """Expandable anchors (nodes with children), longest suffix first, with their depths."""
        processed = state.processed_total_len
        forward = total_len >= processed
        appended = total_len - processed if forward else 0
        can_advance = (
            state.epoch == self._epoch and forward and appended <= len(window)
            and len(state.anchors) == min(processed, self._depth)
        )
        if not (can_advance and self._advance(state, window[len(window) - appended:], total_len)):
            self._rebuild(window, state, total_len)
        anchors = state.anchors
        return [(node, d) for d in range(len(anchors), 0, -1) if (node := anchors[d - 1]) is not None and node.children]

    def _rebuild(self, window: list[int], state: MatchState, total_len: int) -> None:
        root = self._root
        n = len(window)
        anchors: list[_Node | None] = []
        for depth in range(1, min(n, self._depth) + 1):
            cursor: _Node | None = root
            for token in window[n - depth:]:
                cursor = cursor.children.get(token)  # type: ignore[union-attr]
                if cursor is None:
                    break
            anchors.append(cursor)
        state.epoch = self._epoch
        state.processed_total_len = total_len
        state.anchors = anchors

    def _advance(self, state: MatchState, appended: list[int], total_len: int) -> bool:
        """Extend the cached anchors by the appended tokens; False if one of them was evicted (rebuild instead)."""
        if any(node is not None and not node.alive for node in state.anchors):
            return False
        root_children = self._root.children
        depth_cap = self._depth
        anchors = state.anchors
        for token in appended:
            nxt: list[_Node | None] = [root_children.get(token)]
            for d in range(1, min(len(anchors) + 1, depth_cap)):
                prev = anchors[d - 1]
                nxt.append(None if prev is None else prev.children.get(token))
            anchors = nxt
        state.anchors = anchors
        state.processed_total_len = total_len
        return True

    # ------------------------------------------------------------------ tree construction

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
                taken = 0
                for child in reversed(node.children.values()):  # most recent first
                    if taken >= breadth or cursor > budget:
                        break
                    taken += 1
                    pos, cursor = place(child.token, parent, cursor, tree_tokens, tree_parents, tree_next)
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
                prob, parent, node = heap_pop(heap)
                pos, cursor = place(node.token, parent, cursor, tree_tokens, tree_parents, tree_next)
                if node.children:
                    _offer_children(heap, pos, node, prob, top_k)

    # ------------------------------------------------------------------ helpers

    def _query(self, context: Sequence[int], total_len: int | None) -> tuple[list[int], int]:
        window = self._window(context, "context")
        if not window:
            raise ValueError(
                "ngram: context must hold at least one token (its last token is the root), got an empty one"
            )
        if total_len is None:
            return window, len(context)
        if isinstance(total_len, bool) or not isinstance(total_len, int) or total_len < len(window):
            raise ValueError(
                f"ngram: total_len must be an int >= the context's matched length {len(window)}, got {total_len!r}; "
                "pass the full length of the request's sequence"
            )
        return window, total_len

    def _window(self, tokens: Sequence[int], name: str) -> list[int]:
        try:
            tail = tokens[-self._depth :]
        except TypeError as err:
            raise ValueError(
                f"ngram: {name} must be a sequence of int token ids, got {type(tokens).__name__}: {err}"
            ) from None
        return token_ids(tail, name)


def _offer_children(heap: list, parent: int, node: _Node, prob: float, top_k: int) -> None:
    """Trie::buildFrequency's addToHeap: push the node's top_k children by frequency with prob * freq / sum_freq."""
    offers = node.offers
    if offers is None:
        children, ranked = node.children, node.ranked or []
        top = [children[key & _TOKEN_MASK] for key in ranked[:top_k]]
        sum_freq = float(sum(child.freq for child in top)) or 1.0
        # C++ computes freq / sum_freq * prob left to right, so caching freq / sum_freq keeps every bit.
        offers = node.offers = [(child.freq / sum_freq, child) for child in top]
    # Ties in probability pop in libstdc++'s order (stdheap), as trie.cpp's std::priority_queue pops them.
    for ratio, child in offers:
        heap_push(heap, (ratio * prob, parent, child))

