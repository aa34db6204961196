"""The draft tree of SGLang 0.5.23's STANDALONE/EAGLE drafting, from the draft model's top-k expansions.

Step 1 offers the top-k tokens after the root; every later step takes the k best offered nodes of the previous step
(the frontier, by cumulative draft log-prob), runs them through the draft model in one tree forward and offers each
one's top-k children. Every offered node is a candidate with the sum of the log-probs on its path; the best
`num_draft_tokens - 1` candidates of all steps form the tree (SGLang `organize_draft_results`), in candidate order.
topk=1 is a chain of num_steps nodes.

Ties: candidates with equal scores rank by creation order (the earlier first), for the frontier and for the final
cut. A candidate's score never exceeds its parent's (log-probs are <= 0) and it is created after its parent, so a
kept node's ancestors are always kept: the cut is a tree.

Pure: the caller runs the model and hands over each frontier row's top-k (token, log-prob) pairs, best first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from serve.ngram.drafttree import DraftTree

__all__ = ["Expansion", "TreeBuild", "best", "prune"]

Expansion = Sequence[tuple[int, float]]  # one frontier row's top-k (token, log-prob), best first


def best(candidates: Sequence[int], scores: Sequence[float], count: int) -> list[int]:
    """The `count` best of `candidates` by (higher score, earlier index), in that rank order."""
    return sorted(candidates, key=lambda c: (-scores[c], c))[:count]


@dataclass
class TreeBuild:
    """One tree under construction. Candidates are indices into the parallel lists, in creation order (every parent
    before its children); -1 is the root. Use: `offer` the root's expansion, then per further step `advance` to the
    frontier and `offer` its rows' expansions in frontier order; `prune` at the end."""

    topk: int
    tokens: list[int]
    parents: list[int]
    scores: list[float]
    depths: list[int]
    offered: list[int]  # the candidates the last `offer` created
    frontier: list[int]  # the nodes the next `offer` expands, in index order ([-1]: the root)

    def __init__(self, topk: int) -> None:
        if topk < 1:
            raise ValueError(f"draft tree: topk must be >= 1, got {topk}")
        self.topk = topk
        self.tokens, self.parents, self.scores, self.depths = [], [], [], []
        self.offered = []
        self.frontier = [-1]

    @property
    def depth(self) -> int:
        """Depth of the last offered candidates (0 before the first offer)."""
        return self.depths[-1] if self.depths else 0

    def offer(self, rows: Sequence[Expansion]) -> list[int]:
        """Each frontier node's expansion, in frontier order: its (token, log-prob) children become candidates."""
        if len(rows) != len(self.frontier):
            raise ValueError(f"draft tree: {len(rows)} expansion(s) for a frontier of {len(self.frontier)}")
        depth = self.depth + 1
        offered: list[int] = []
        for parent, row in zip(self.frontier, rows):
            base = self.scores[parent] if parent >= 0 else 0.0
            for token, logp in row:
                offered.append(len(self.tokens))
                self.tokens.append(int(token))
                self.parents.append(parent)
                self.scores.append(base + logp)
                self.depths.append(depth)
        self.offered = offered
        return offered

    def advance(self) -> list[int]:
        """The next frontier: the k best of the last offered candidates, in index order."""
        self.frontier = sorted(best(self.offered, self.scores, self.topk))
        return self.frontier

    def prune(self, num_draft_tokens: int) -> tuple[DraftTree, list[int]]:
        """The tree of the best `num_draft_tokens - 1` candidates, and which candidate each tree node is."""
        return prune(self.tokens, self.parents, self.scores, num_draft_tokens)


def prune(tokens: Sequence[int], parents: Sequence[int], scores: Sequence[float],
          num_draft_tokens: int) -> tuple[DraftTree, list[int]]:
    """The best `num_draft_tokens - 1` candidates as a DraftTree (candidate order), and the candidate of each node."""
    keep = sorted(best(range(len(tokens)), scores, num_draft_tokens - 1))
    position = {c: i for i, c in enumerate(keep)}
    tree_parents = tuple(position[parents[c]] if parents[c] >= 0 else -1 for c in keep)
    return DraftTree(tokens=tuple(tokens[c] for c in keep), parents=tree_parents, num_real=len(keep)), keep
