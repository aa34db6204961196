"""llama-server's `ngram-simple` drafting (llama.cpp 11434, the version infra/install-llama-cpp.sh builds), for the
acceptance replay. It keeps no state: each step's draft is a function of the slot's tokens alone, so a greedy
replay of the baseline's answers gives every step's draft and accepted length.

From `common/ngram-map.cpp` (`common_ngram_simple_draft`) and `tools/server/server-context.cpp`:
- A decode step drafts from `history` (the slot's tokens: the prompt and every output token before the one just
  sampled) and `sampled` (that token). The pattern is the last `size_n` tokens ending at `sampled`; the latest earlier
  occurrence of it in `history` starting at position >= 1 (position 0 never matches) and ending before the last
  history token is taken, and the up to `size_m` tokens that followed it are the draft.
- No draft unless `history` has more than `size_n + size_m + 1` tokens, a match exists, and at least `size_n` tokens
  follow the match.
- The server cuts the draft to the tokens the request may still generate, less the one the step samples itself
  (`get_n_draft_max`: `n_remaining - 1`), then verifies `sampled` and the draft in one batch: greedy, the draft's
  longest prefix equal to the target's tokens is accepted, plus the one token the target samples after it.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

__all__ = ["draft_at", "ngram_simple_draft", "ngram_simple_match"]

_ITEM = array("i").itemsize


def ngram_simple_draft(history: Sequence[int], sampled: int, size_n: int, size_m: int) -> list[int]:
    """The draft `common_ngram_simple_draft` returns (empty: no draft this step)."""
    if size_n < 1 or size_m < 1:
        raise ValueError(f"ngram-simple: size_n and size_m must be >= 1, got size_n={size_n}, size_m={size_m}")
    if len(history) <= size_n + size_m + 1:
        return []
    return draft_at(history, ngram_simple_match(history, sampled, size_n), size_n, size_m)


def draft_at(history: Sequence[int], match: int, size_n: int, size_m: int) -> list[int]:
    """The draft of `ngram_simple_draft` given its match (`ngram_simple_match`), which does not depend on size_m."""
    length = len(history)
    if length <= size_n + size_m + 1 or match <= 0:
        return []
    copy = min(size_m, length - (match + size_n))
    if copy < size_n:
        return []
    return list(history[match + size_n:match + size_n + copy])


def ngram_simple_match(history: Sequence[int], sampled: int, size_n: int) -> int:
    """Where the pattern's occurrence `ngram_simple_draft` copies from starts in `history` (-1: none)."""
    length = len(history)
    if length <= size_n + 1:
        return -1
    pattern = array("i", history[length - size_n + 1:])
    pattern.append(sampled)
    needle = pattern.tobytes()
    hay = array("i", history).tobytes()
    # The server scans j = length - size_n - 1 down to 1 for history[j:j + size_n] == pattern: the last aligned
    # occurrence in bytes [ITEM, ITEM * (length - 1)).
    end = _ITEM * (length - 1)
    found = hay.rfind(needle, _ITEM, end)
    while found > 0 and found % _ITEM:
        found = hay.rfind(needle, _ITEM, found + len(needle) - 1)
    return found // _ITEM if found > 0 else -1
