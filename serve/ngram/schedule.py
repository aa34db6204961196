"""SGLang 0.5.23's NGRAM drafting schedule (`NGRAMWorker._prepare_draft_tokens` / `_update_ngram_corpus`) over one
global trie, independent of any model: the CPU engine's `NgramSpeculator` drafts through it, and the pipeline's
acceptance simulator replays a recorded workload through the same object.

- A verify step drafts from the trie and queues the insert of the last `max_trie_depth` tokens of prompt+output as
  they were when it drafted, i.e. the window ending at the verify root. SGLang inserts before the step's accepted
  tokens reach `output_ids`, so the trie is one step behind: a request's final accepted block is never inserted. The
  prefill inserts nothing, and the body of a long prompt never enters the trie.
- The inserts of a round land when the next round begins (SGLang: `batch_put` after the batch's verify, and
  `synchronize()` before the next batch drafts), so every request of a round drafts from the same trie.
- Each request keeps a `MatchState` between its steps (its anchors are advanced, not recomputed); `release` drops
  it when the request ends (its queued insert still lands).
- With external corpora and `external_sam_budget` > 0, the corpora draft beside the trie within that budget
  (`corpus.draft_with_corpora`); corpora are kept across `reset` (SGLang's flush keeps them).

Without `begin_round` calls (a caller stepping one request by itself) every draft is a round of its own: SGLang with
a batch of one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from serve.ngram.corpus import draft_with_corpora
from serve.ngram.drafttree import DraftTree
from serve.ngram.sam import SuffixAutomaton
from serve.ngram.trie import MatchState, NgramCache

__all__ = ["DraftState", "NgramDrafter"]


@dataclass
class DraftState:
    """One request's drafting state: its trie match state and the round of its last draft."""

    match: MatchState = field(default_factory=MatchState)
    drafted_in: int = -1


class NgramDrafter:
    """The trie, the pending inserts of the current round and the round counter. Single-threaded, like the engine's
    decode worker. `corpora` returns the external corpora to draft beside the trie (a snapshot per draft: the
    engine's corpora change at runtime)."""

    def __init__(self, cache: NgramCache, external_sam_budget: int = 0,
                 corpora: Callable[[], Sequence[SuffixAutomaton]] | None = None) -> None:
        num_draft_tokens = cache.num_draft_tokens
        if isinstance(external_sam_budget, bool) or not isinstance(external_sam_budget, int) \
                or not 0 <= external_sam_budget <= num_draft_tokens - 1:
            raise ValueError(
                "ngram: 0 <= external_sam_budget <= num_draft_tokens - 1 must hold, "
                f"got external_sam_budget={external_sam_budget!r}, num_draft_tokens={num_draft_tokens}; "
                "the corpora's nodes come out of the draft budget"
            )
        self.cache = cache
        self._sam_budget = external_sam_budget
        self._corpora = corpora
        self._depth = cache.max_trie_depth
        self._round = 0
        self._pending: list[list[int]] = []  # this round's insert windows, in draft order
        self._rounds_driven = False  # has a scheduler called begin_round?

    def begin_round(self) -> None:
        """Land the previous round's inserts: every request of that round has drafted."""
        self._rounds_driven = True
        self._land()

    def propose(self, state: DraftState, tokens: Sequence[int]) -> DraftTree:
        """The draft tree of a request whose sequence (prompt + output so far) is `tokens`, rooted at tokens[-1]."""
        if not self._rounds_driven or state.drafted_in == self._round:
            # No scheduler: every draft is a round of its own. A second draft in one round means a round began
            # without begin_round: land first too.
            self._land()
        state.drafted_in = self._round
        window = list(tokens[-self._depth:])
        sams = self._corpora() if self._corpora is not None and self._sam_budget else ()
        if sams:
            tree = draft_with_corpora(self.cache, sams, self._sam_budget, window, state.match, len(tokens))
        else:
            tree = self.cache.draft(window, state.match, len(tokens))
        self._pending.append(window)
        return tree

    def reset(self) -> None:
        """`/flush_cache`: drop the pending inserts and empty the trie (corpora are kept)."""
        self._pending.clear()
        self.cache.reset()

    def _land(self) -> None:
        for window in self._pending:
            self.cache.insert_window(window)
        self._pending.clear()
        self._round += 1
