"""The draft tree every draft source hands the verifier, and SGLang's layout of a built tree."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MAX_TOKEN", "DraftTree", "accepted_drafts", "layout", "place", "token_ids"]

MAX_TOKEN = 2**31 - 1  # SGLang stores token ids as int32


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


def layout(tree_tokens: list[int], tree_parents: list[int], budget: int) -> DraftTree:
    """A built tree (position 0 the root) as a DraftTree: breadth-first like SGLang's fillResult, root dropped, then
    pads (token 0 under the root) up to `budget` nodes."""
    kids: list[list[int]] = [[] for _ in tree_tokens]
    for pos in range(1, len(tree_tokens)):
        kids[tree_parents[pos]].append(pos)
    order = list(kids[0])
    for pos in order:  # grows while iterating: a breadth-first walk
        order.extend(kids[pos])
    index = {0: -1}
    tokens: list[int] = []
    parents: list[int] = []
    for pos in order:
        index[pos] = len(tokens)
        tokens.append(tree_tokens[pos])
        parents.append(index[tree_parents[pos]])
    num_real = len(tokens)
    pads = budget - num_real
    return DraftTree(tuple(tokens) + (0,) * pads, tuple(parents) + (-1,) * pads, num_real)


def place(token: int, parent: int, cursor: int, tree_tokens: list[int], tree_parents: list[int],
          tree_next: list[dict[int, int]]) -> tuple[int, int]:
    """The tree position of `token` under `parent` (merged with an equal sibling drafted from another anchor, as
    SGLang's tree does), appending it at `cursor` when new; returns (position, next cursor)."""
    pos = tree_next[parent].get(token)
    if pos is not None:
        return pos, cursor
    tree_next[parent][token] = cursor
    tree_tokens.append(token)
    tree_parents.append(parent)
    tree_next.append({})
    return cursor, cursor + 1


def accepted_drafts(tree: DraftTree, continuation: Sequence[int]) -> int:
    """Draft nodes a greedy verifier accepts: walk from the root while a child carries the next token of
    `continuation` (the target's greedy tokens); among siblings with one token the first is taken, as
    `serve.engines.cpu.verify.walk_tree` takes it."""
    first: dict[tuple[int, int], int] = {}
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        first.setdefault((parent, token), i)
    node, count = -1, 0
    for token in continuation:
        child = first.get((node, token))
        if child is None:
            break
        node, count = child, count + 1
    return count


def token_ids(tokens: Sequence[int], name: str) -> list[int]:
    """`tokens` as a list of int32 token ids; ValueError naming `name` and the bad value otherwise."""
    try:
        ids = [operator.index(t) for t in tokens]
    except TypeError as err:
        raise ValueError(
            f"ngram: {name} must be a sequence of int token ids, got {type(tokens).__name__}: {err}"
        ) from None
    for t in ids:
        if not 0 <= t <= MAX_TOKEN:
            raise ValueError(f"ngram: token ids in {name} must be in [0, {MAX_TOKEN}] (int32), got {t}")
    return ids
