"""Accepted lengths of STANDALONE trees when the target's tokens are known: the draft replay's pure part.

Under greedy decoding a lossless config emits the baseline's tokens, so a round whose committed tokens are
`prompt + output[:j]` accepts the longest path of its draft tree that spells `output[j:]`. Call those path nodes the
on-path nodes c_1, c_2, ...: c_d is the child of c_{d-1} (c_0 the root) carrying output[j + d - 1]. A tree keeps the
best `num_draft_tokens - 1` candidates (`serve.draft.tree`), and a kept node's ancestors are kept, so the accepted
drafts of a (num_steps, num_draft_tokens) tree are the leading on-path nodes of depth <= num_steps whose rank among
the candidates of depth <= num_steps is below num_draft_tokens - 1. One build of the deepest tree of a topk gives
every (num_steps, num_draft_tokens) point of that topk: the frontier of a step does not depend on how many steps
follow, and a shallower tree's candidates are the deeper tree's candidates of that depth or less.

Most of the tree needs no draft forward:
- an on-path node's context is the committed tokens plus output[j:j+d], which the draft saw in one causal pass over
  the baseline's ids, so its expansion is that pass's top-k at the same position (the `chain` given here);
- a candidate's score never exceeds its parent's, and a child is created after its parent. Let t be the score of the
  deepest on-path node the chain allows (top-k membership only; the frontier may cut it shorter). A frontier node
  scoring below t has no descendant that outranks an on-path node or takes an on-path node's place in a frontier, so
  it is never forwarded: its children enter as placeholders (token -1, score -inf), which keeps the candidates' order
  of creation right for every candidate scoring t or more. Children of the deepest on-path node are placeholders for
  the same reason (they score <= t and come after every on-path node).
So only the off-path frontier nodes scoring >= t are forwarded (`wants`), with their context: the committed tokens,
output[j:j+prefix], their forwarded off-path ancestors and themselves.

Pure: the caller runs the draft (`serve.engines.cpu.draft_replay` batches the wants of many rounds per forward).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from serve.draft.tree import Expansion, TreeBuild, best

__all__ = ["RoundTree", "Want", "accepted", "candidates", "tree_nodes"]

PLACEHOLDER = -1  # the token of a candidate that is never expanded (no target token is negative)


@dataclass(frozen=True)
class Want:
    """A frontier node whose top-k the tree needs: its candidate index, token and depth; `prefix` = how many of the
    round's target tokens its context holds (the depth of its deepest on-path ancestor, 0 = the root);
    `ancestors` = its off-path ancestors, root side first (each wanted, and forwarded, at an earlier step)."""

    node: int
    token: int
    depth: int
    prefix: int
    ancestors: tuple[int, ...]


class RoundTree:
    """One round's tree for one topk, built to `max_steps` with only the draft forwards the accepted lengths need.

    `continuation` = the target's tokens after the round's root (output[j:]); `chain[i]` = the draft's top-k
    expansion after the committed tokens plus continuation[:i] (i = 0: the root), for i < min(max_steps,
    len(continuation)). Loop: while `wants` is non-empty, forward them and `give` their expansions in that order;
    then `ranks` holds the result."""

    def __init__(self, topk: int, max_steps: int, continuation: Sequence[int], chain: Sequence[Expansion]) -> None:
        if max_steps < 1:
            raise ValueError(f"draft replay: max_steps must be >= 1, got {max_steps}")
        self.max_steps = max_steps
        self.continuation = tuple(continuation[:max_steps])
        self.chain = chain
        self.build = TreeBuild(topk)
        self.on_path: dict[int, int] = {}  # candidate -> its depth, for on-path candidates
        self.deepest, self.threshold = self._optimistic_chain()
        self.wants: list[Want] = []
        self._rows: list[Expansion | None] = []
        self._offer([chain[0]] if self.continuation else [[(PLACEHOLDER, -math.inf)] * topk])
        self._grow()

    def _optimistic_chain(self) -> tuple[int, float]:
        """(depth, score) of the deepest on-path node whose every ancestor offers it (ignoring frontier cuts)."""
        score, depth = 0.0, 0
        for d, token in enumerate(self.continuation, 1):
            logp = next((lp for tok, lp in self.chain[d - 1] if tok == token), None)
            if logp is None:
                break
            score, depth = score + logp, d
        return depth, (score if depth else math.inf)

    def _offer(self, rows: Sequence[Expansion]) -> None:
        build = self.build
        parents_on_path = {-1: 0} if build.depth == 0 else self.on_path
        for c in build.offer(rows):
            parent_depth = parents_on_path.get(build.parents[c])
            d = build.depths[c]
            if parent_depth is not None and d <= len(self.continuation) and build.tokens[c] == self.continuation[d - 1]:
                self.on_path[c] = d

    def _grow(self) -> None:
        """Advance step by step until a step needs forwards (`wants`) or the tree has max_steps levels."""
        build = self.build
        placeholder = [(PLACEHOLDER, -math.inf)] * build.topk
        while build.depth < self.max_steps and self.deepest > 0:
            rows: list[Expansion | None] = []
            wants: list[Want] = []
            for f in build.advance():
                d = self.on_path.get(f)
                if d is not None:
                    rows.append(self.chain[d] if d < self.deepest else placeholder)
                elif build.scores[f] >= self.threshold:
                    rows.append(None)
                    wants.append(self._want(f))
                else:
                    rows.append(placeholder)
            if wants:
                self.wants, self._rows = wants, rows
                return
            if all(r is placeholder for r in rows):
                break  # every deeper candidate would be a placeholder: none outranks an on-path node
            self._offer([r for r in rows if r is not None])
        self.wants, self._rows = [], []

    def _want(self, node: int) -> Want:
        build = self.build
        ancestors: list[int] = []
        parent = build.parents[node]
        while parent >= 0 and parent not in self.on_path:
            ancestors.append(parent)
            parent = build.parents[parent]
        prefix = self.on_path[parent] if parent >= 0 else 0
        return Want(node, build.tokens[node], build.depths[node], prefix, tuple(reversed(ancestors)))

    def give(self, expansions: Sequence[Expansion]) -> None:
        """The top-k expansions of `wants`, in that order."""
        if len(expansions) != len(self.wants):
            raise ValueError(f"draft replay: {len(expansions)} expansion(s) for {len(self.wants)} wanted node(s)")
        given = iter(expansions)
        self._offer([row if row is not None else next(given) for row in self._rows])
        self._grow()

    @property
    def done(self) -> bool:
        return not self.wants

    def ranks(self) -> list[list[int]]:
        """For num_steps = 1..max_steps: the rank (0 = best) of each on-path node of depth <= num_steps among the
        candidates of depth <= num_steps, in depth order (leading ranks below num_draft_tokens - 1 are accepted)."""
        if not self.done:
            raise RuntimeError("draft replay: the tree still wants forwards")
        build = self.build
        path = sorted(self.on_path, key=self.on_path.__getitem__)
        out: list[list[int]] = []
        for steps in range(1, self.max_steps + 1):
            pool = [c for c in range(len(build.tokens)) if build.depths[c] <= steps]
            order = {c: i for i, c in enumerate(best(pool, build.scores, len(pool)))}
            out.append([order[c] for c in path if build.depths[c] <= steps])
        return out


def accepted(ranks: Sequence[Sequence[int]], num_steps: int, num_draft_tokens: int) -> int:
    """Accepted drafts of the (num_steps, num_draft_tokens) tree from a round's `RoundTree.ranks()`."""
    count = 0
    for rank in ranks[num_steps - 1]:
        if rank >= num_draft_tokens - 1:
            break
        count += 1
    return count


def candidates(num_steps: int, topk: int) -> int:
    """Candidates a (num_steps, topk) build offers: topk after the root, then topk x topk per further step."""
    return topk + (num_steps - 1) * topk * topk


def tree_nodes(num_steps: int, topk: int, num_draft_tokens: int) -> int:
    """Draft nodes of the pruned tree (the verify forward's real queries besides the root)."""
    return min(num_draft_tokens - 1, candidates(num_steps, topk))
