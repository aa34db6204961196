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
from typing import Any

from serve.ngram.compiled import CompiledNgramCache
from serve.ngram.corpus import draft_with_corpora
from serve.ngram.drafttree import DraftTree, accepted_drafts
from serve.ngram.sam import SuffixAutomaton
from serve.ngram.trie import MatchState, NgramCache

__all__ = ["DraftState", "NgramDrafter"]


@dataclass
class DraftState:
    """One request's drafting state: its trie match state and the round of its last draft."""

    match: MatchState = field(default_factory=MatchState)
    drafted_in: int = -1
    native: Any = None  # replay_step with the compiled trie: the request's sequence, copied there


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
        self._pending: list[list[int]] = []  # this round's insert windows, in draft order (Python trie)
        # The compiled trie queues its windows itself and lands them lazily: at the next draft after a round began
        # (inside that draft's call: nothing reads the trie in between), so a replayed step is one call.
        self._compiled = isinstance(cache, CompiledNgramCache)
        self._landing = False
        self._rounds_driven = False  # has a scheduler called begin_round?

    def begin_round(self) -> None:
        """Land the previous round's inserts: every request of that round has drafted."""
        self._rounds_driven = True
        self._land()

    def propose(self, state: DraftState, tokens: Sequence[int]) -> DraftTree:
        """The draft tree of a request whose sequence (prompt + output so far) is `tokens`, rooted at tokens[-1]."""
        window, sams = self._step(state, tokens, len(tokens))
        if sams:
            return draft_with_corpora(self.cache, sams, self._sam_budget, window, state.match, len(tokens))
        return self.cache.draft(window, state.match, len(tokens))

    def replay_step(self, state: DraftState, sequence: Sequence[int], length: int) -> tuple[int, int]:
        """`propose(state, sequence[:length])` for a request whose whole sequence -- prompt and every output token,
        as a replay knows it -- is `sequence`, answered as (draft nodes a greedy verifier accepts along
        sequence[length:], the tree's real nodes). With the compiled trie and no corpora the step is one call into
        C++ on the request's sequence, copied there once."""
        cache = self.cache
        if isinstance(cache, CompiledNgramCache) and not (self._corpora is not None and self._sam_budget):
            self._due(state)
            if state.native is None:
                state.native = cache.sequence(sequence)
            landing, self._landing = self._landing, False
            return cache.step(state.match, state.native, length, landing)
        window, sams = self._step(state, sequence, length)
        if sams:
            tree = draft_with_corpora(cache, sams, self._sam_budget, window, state.match, length)
        else:
            tree = cache.draft(window, state.match, length)
        return accepted_drafts(tree, sequence[length:length + len(tree.tokens)]), tree.num_real

    def replay_alone(self, state: DraftState, sequence: Sequence[int], length: int) -> list[tuple[int, int]] | None:
        """Every remaining step of a request that is alone in its rounds from this one (a round already begun) to
        its last: the `replay_step`s of that request, each after a `begin_round`, answered as (tokens kept, real
        nodes) per step, in one call into C++. None where that call does not apply (the Python trie, corpora, or
        no scheduler driving rounds): the caller steps one round at a time."""
        cache = self.cache
        if not (isinstance(cache, CompiledNgramCache) and self._rounds_driven
                and not (self._corpora is not None and self._sam_budget)) or length >= len(sequence):
            return None
        self._due(state)
        if state.native is None:
            state.native = cache.sequence(sequence)
        landing, self._landing = self._landing, False
        steps = cache.run(state.match, state.native, length, landing)
        # the rounds after the first each began (and landed the previous step's insert) inside the call
        self._round += len(steps) - 1
        state.drafted_in = self._round
        return steps

    def reset(self) -> None:
        """`/flush_cache`: drop the pending inserts and empty the trie (corpora are kept)."""
        self._pending.clear()
        self._landing = False
        self.cache.reset()  # the compiled trie drops its queue too

    def _due(self, state: DraftState) -> None:
        if not self._rounds_driven or state.drafted_in == self._round:
            # No scheduler: every draft is a round of its own. A second draft in one round means a round began
            # without begin_round: land first too.
            self._land()
        state.drafted_in = self._round

    def _step(self, state: DraftState, tokens: Sequence[int], length: int
              ) -> tuple[list[int], Sequence[SuffixAutomaton]]:
        """Land what is due and queue this draft's insert: (the window of tokens[:length] it drafts from, the
        corpora beside the trie)."""
        self._due(state)
        window = list(tokens[max(0, length - self._depth):length])
        cache = self.cache
        if isinstance(cache, CompiledNgramCache):
            if self._landing:
                self._landing = False
                cache.land()
            cache.queue(window)
        else:
            self._pending.append(window)
        return window, self._corpora() if self._corpora is not None and self._sam_budget else ()

    def _land(self) -> None:
        if self._compiled:
            self._landing = True
        else:
            for window in self._pending:
                self.cache.insert_window(window)
            self._pending.clear()
        self._round += 1
