"""Tree acceptance and token choice.

Greedy (temperature ~ 0 or top_k == 1): walk from the root; at each node take the target's argmax; if a child carries
that token, accept the child and continue, else emit the argmax (the bonus token) and stop. Lossless: the emitted
tokens are exactly what plain greedy decoding emits, one target forward per step instead of one per token.

Sampling (temperature > 0): target-only tree sampling. At each node draw one token from the target's (temperature /
top-k / top-p / min-p processed) distribution; if a child carries it, move there, else emit it and stop. Every emitted
token is drawn from the target's conditional given the tokens before it, so the output is distributed exactly as plain
sampling from the target. Each draw consumes exactly one uniform from the request's generator (inverse CDF), so with
the same seed a speculative run emits the same tokens as a plain run, up to float noise in the probabilities.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Sampling", "TokenChooser", "walk_tree"]

GREEDY_EPS = 1e-6  # SGLang treats temperatures below this as greedy


@dataclass(frozen=True)
class Sampling:
    """The sampling transforms of one request (SGLang `sampling_params` names and defaults)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: the whole vocabulary
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1


class TokenChooser:
    """Chooses the next token from float32 logits [V]: argmax when greedy, else one inverse-CDF draw."""

    def __init__(self, sampling: Sampling, generator: torch.Generator | None) -> None:
        self.sampling = sampling
        self.generator = generator

    def __call__(self, logits: torch.Tensor) -> int:
        s = self.sampling
        if s.greedy:
            return int(torch.argmax(logits))
        probs = self.probs(logits)
        cdf = torch.cumsum(probs, 0)
        u = torch.rand((), generator=self.generator, dtype=torch.float64).item() * float(cdf[-1])
        idx = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True)[0])
        idx = min(idx, probs.shape[0] - 1)
        while probs[idx] <= 0 and idx > 0:  # a draw landing exactly on a zero-mass edge
            idx -= 1
        return idx

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed distribution (float64 for a stable CDF): temperature, then top-k, top-p, min-p."""
        s = self.sampling
        x = logits.double() / s.temperature
        vocab = x.shape[0]
        if 0 < s.top_k < vocab:
            kth = torch.topk(x, s.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        p = torch.softmax(x, 0)
        if s.top_p < 1.0:
            sorted_p, order = torch.sort(p, descending=True)
            cum = torch.cumsum(sorted_p, 0)
            drop_sorted = (cum - sorted_p) > s.top_p  # keep the smallest prefix whose mass reaches top_p
            drop = torch.zeros_like(drop_sorted)
            drop[order] = drop_sorted
            p = p.masked_fill(drop, 0.0)
        if s.min_p > 0.0:
            p = p.masked_fill(p < s.min_p * p.max(), 0.0)
        return p / p.sum()


def walk_tree(
    tokens: Sequence[int],
    parents: Sequence[int],
    logits_at: Callable[[int], torch.Tensor],
    choose: Callable[[torch.Tensor], int],
) -> tuple[list[int], list[int]]:
    """Accept the longest path of a verified tree. Query 0 is the root; `parents[i]` for i >= 1 is an earlier query.
    Returns (accepted query indices, excluding the root; emitted tokens = their tokens + the bonus token).
    Among siblings carrying the same token (SGLang's pads are all token 0), the first one is taken."""
    children: list[dict[int, int]] = [{} for _ in tokens]
    for i in range(1, len(tokens)):
        children[parents[i]].setdefault(tokens[i], i)
    accepted: list[int] = []
    emitted: list[int] = []
    node = 0
    while True:
        token = choose(logits_at(node))
        emitted.append(token)
        child = children[node].get(token)
        if child is None:
            return accepted, emitted
        accepted.append(child)
        node = child
