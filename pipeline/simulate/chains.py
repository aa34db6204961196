"""Chain drafters of the acceptance replay: a stateless lookup in the request's own tokens that proposes one chain
(no tree) per decode step. llama-server's `ngram-simple` (pipeline.simulate.lookup) and vLLM's `ngram`
(pipeline.simulate.vllm_ngram) keep nothing between steps or requests, so a step's draft is a function of the
request's tokens so far, and a greedy verifier accepts its longest prefix equal to the recorded output
(pipeline.simulate.replay walks it).

Where the two differ is the request's end:
- llama-server cuts the draft to the tokens the request may still generate, less the one the step samples itself
  (`get_n_draft_max`: `n_remaining - 1`);
- vLLM does not cut it: the last step verifies the whole draft (its query rows are computed, and what the target
  accepts past `max_tokens` is counted, then cut from the answer). Only `max_model_len` bounds it, which a study's
  prompts stay far below (`NO_LIMIT`: no bound).
The searches depend on one setting each (ngram-simple's match on size_n, vLLM's longest suffix on
prompt_lookup_max), so they are remembered per (answer, tokens so far, that setting): a space's configs that differ
in K, size_m or prompt_lookup_min share them. Pure.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pipeline.simulate.lookup import draft_at, ngram_simple_draft, ngram_simple_match
from pipeline.simulate.vllm_ngram import longest_match
from serve.spec import LlamaNgramSimpleSpec, VllmNgramSpec

__all__ = ["NO_LIMIT", "ChainDrafter", "NgramSimpleChain", "VllmNgramChain", "chain_drafter", "matched"]

NO_LIMIT = sys.maxsize  # vLLM's max_model_len where the replay does not know it: no draft is cut by it
MEMO_LIMIT = 1_000_000  # remembered searches; cleared past it (a space's replays revisit the same few thousand)


class ChainDrafter(Protocol):
    def draft(self, answer: Any, tokens: Sequence[int], remaining: int) -> list[int]:
        """The step's draft for a request whose tokens so far (prompt + output) are `tokens` and which may still
        generate `remaining` tokens; `answer` is the recorded request (held: its identity keys the memo)."""
        ...


# (id of the answer, tokens so far, setting) -> (that answer, the search's result): the answer is held, so its id
# stays its own while the entry lives
_SIMPLE: dict[tuple[int, int, int], tuple[Any, int]] = {}
_VLLM: dict[tuple[int, int, int], tuple[Any, tuple[int, int]]] = {}


def _remember(memo: dict[Any, Any], key: Any, answer: Any, compute: Any) -> Any:
    known = memo.get(key)
    if known is None or known[0] is not answer:
        if len(memo) >= MEMO_LIMIT:
            memo.clear()
        known = memo[key] = (answer, compute())
    return known[1]


@dataclass(frozen=True)
class NgramSimpleChain:
    """llama-server's ngram-simple: `size_n` tokens ending at the sampled one, matched in the history before it."""

    size_n: int
    size_m: int

    def draft(self, answer: Any, tokens: Sequence[int], remaining: int) -> list[int]:
        history, sampled = tokens[:-1], tokens[-1]
        n, m = self.size_n, self.size_m
        if n < 1 or m < 1 or len(history) <= n + m + 1:
            found = ngram_simple_draft(history, sampled, n, m)
        else:
            match = _remember(_SIMPLE, (id(answer), len(tokens), n), answer,
                              lambda: ngram_simple_match(history, sampled, n))
            found = draft_at(history, match, n, m)
        return found[:max(0, remaining - 1)]


@dataclass(frozen=True)
class VllmNgramChain:
    """vLLM's ngram proposer (`propose`, its search remembered), the draft never cut at the request's end."""

    k: int
    min_ngram: int
    max_ngram: int
    max_model_len: int = NO_LIMIT

    def draft(self, answer: Any, tokens: Sequence[int], remaining: int) -> list[int]:
        total = len(tokens)
        k = min(self.k, self.max_model_len - total)
        if total < self.min_ngram or k <= 0:
            return []
        longest, start = _remember(_VLLM, (id(answer), total, self.max_ngram), answer,
                                   lambda: longest_match(tokens, self.max_ngram))
        if longest < self.min_ngram:
            return []
        return list(tokens[start:start + min(k, total - start)])


def chain_drafter(spec: Any) -> ChainDrafter | None:
    """The chain drafter of a spec (None: the spec drafts otherwise, or not at all)."""
    if isinstance(spec, LlamaNgramSimpleSpec):
        return NgramSimpleChain(spec.size_n, spec.size_m)
    if isinstance(spec, VllmNgramSpec):
        return VllmNgramChain(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    return None


def matched(draft: Sequence[int], output: Sequence[int], emitted: int) -> int:
    """A chain draft's tokens a greedy verifier accepts: its longest prefix equal to the output from `emitted` (a
    draft past the output's end: what the known tokens confirm)."""
    count = 0
    for token, expected in zip(draft, output[emitted:]):
        if token != expected:
            break
        count += 1
    return count
