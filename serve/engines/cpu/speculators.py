"""Draft sources. Both produce `ngram.DraftTree`s, so one verifier (`decode.Decoder`) serves both.

- `NgramSpeculator`: SGLang NGRAM. One global trie shared by all requests, kept until `/flush_cache`, on SGLang
  0.5.23's schedule (`NGRAMWorker._prepare_draft_tokens` / `_update_ngram_corpus`), run by
  `serve.ngram.schedule.NgramDrafter` (torch-free: the pipeline's acceptance simulator replays the same code):
  - a verify step inserts the last `max_trie_depth` tokens of prompt+output as they were when it drafted, i.e. the
    window ending at the verify root. SGLang inserts before the step's accepted tokens reach `output_ids`, so the
    trie is one step behind: a request's final accepted block is never inserted. The prefill inserts nothing, and
    the body of a long prompt never enters the trie.
  - the inserts of a round land when the next round begins (SGLang: `batch_put` after the batch's verify, and
    `synchronize()` before the next batch drafts), so every request of a round drafts from the same trie.
  - each request keeps a `MatchState` between its steps (its anchors are advanced, not recomputed).
  - with external corpora (`corpus.ExternalCorpora`) and `external_sam_budget` > 0, the corpora draft beside the trie
    within that budget (`corpus.draft_with_corpora`).
- `StandaloneSpeculator`: SGLang STANDALONE. A smaller model with the same tokenizer drafts an EAGLE-style tree
  (`serve.draft.tree`, the construction the pipeline's draft replay shares): step 1 takes the top-k tokens after the
  root; each later step forwards the k best frontier nodes in one tree forward and offers their top-k children; the
  best `num_draft_tokens - 1` candidates by cumulative draft log-prob form the tree. topk=1 is a chain of num_steps.
  The draft model keeps its own KV cache per request, pruned to the accepted path after verification.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from serve.ngram.corpus import ExternalCorpora
from serve.engines.cpu.decode import Request
from serve.ngram.trie import DraftTree, NgramCache
from serve.engines.cpu.runner import ModelRunner, chain_visibility
from serve.draft.tree import Expansion, TreeBuild
from serve.ngram.schedule import DraftState, NgramDrafter

__all__ = ["NgramSpeculator", "StandaloneSpeculator", "log_probs", "top_expansions", "top_of"]


def top_expansions(runner: ModelRunner, hidden: torch.Tensor, k: int) -> list[Expansion]:
    """Each row's top-k (token, log-prob), best first, from hidden states [n, d]: what a STANDALONE step offers.
    The draft replay (`draft_replay`) uses the same two steps, so both rank a row's tokens with the same float ops."""
    return top_of(log_probs(runner, hidden), k)


def log_probs(runner: ModelRunner, hidden: torch.Tensor) -> torch.Tensor:
    """The draft's next-token log-probs [n, V] after hidden states [n, d]."""
    return torch.log_softmax(runner.logits(hidden), dim=-1)


def top_of(logp: torch.Tensor, k: int) -> list[Expansion]:
    """Each row's k best (token, log-prob) of log-probs [n, V], best first."""
    top = torch.topk(logp, k, dim=-1)
    return [list(zip(tokens, values)) for tokens, values in zip(top.indices.tolist(), top.values.tolist())]


class NgramSpeculator:
    """The engine's side of `serve.ngram.schedule.NgramDrafter` (the schedule itself lives there, shared with the
    pipeline's acceptance simulator): the request's drafting state rides on `req.draft_state`."""

    def __init__(
        self, cache: NgramCache, num_draft_tokens: int, max_trie_depth: int, *,
        corpora: ExternalCorpora | None = None, external_sam_budget: int = 0,
    ) -> None:
        self.cache = cache
        self.num_draft_tokens = num_draft_tokens
        self.corpora = corpora  # kept across /flush_cache, as SGLang keeps them
        # validates external_sam_budget against the cache's num_draft_tokens (the engine builds both from one spec)
        self._drafter = NgramDrafter(cache, external_sam_budget, corpora.snapshot if corpora is not None else None)

    def begin_round(self) -> None:
        """Land the previous round's inserts: every request of that round has drafted."""
        self._drafter.begin_round()

    def propose(self, req: Request) -> DraftTree:
        state: DraftState | None = req.draft_state
        if state is None:
            state = req.draft_state = DraftState()
        return self._drafter.propose(state, req.tokens)

    def observe(self, req: Request, accepted: list[int]) -> None:
        pass  # the insert was queued at propose time: the window ending at the verify root

    def release(self, req: Request) -> None:
        req.draft_state = None  # SGLang erases the match state; its queued insert still lands

    def reset(self) -> None:
        self._drafter.reset()


@dataclass
class _DraftState:
    cache: object
    cached: int = 0  # tokens of req.tokens whose KV the draft cache holds (a prefix)
    base: int = 0  # during a step: cache columns before the tree nodes (== len(req.tokens) at propose time)
    columns: dict[int, int] = field(default_factory=dict)  # tree node index -> draft cache column, forwarded nodes


class StandaloneSpeculator:
    def __init__(self, runner: ModelRunner, num_steps: int, topk: int, num_draft_tokens: int) -> None:
        self.runner = runner
        self.num_steps = num_steps
        self.topk = topk
        self.num_draft_tokens = num_draft_tokens

    def reset(self) -> None:
        pass  # the draft caches live on the requests

    def begin_round(self) -> None:
        pass

    def release(self, req: Request) -> None:
        req.draft_state = None

    def propose(self, req: Request) -> DraftTree:
        runner = self.runner
        state: _DraftState = req.draft_state or _DraftState(cache=runner.new_cache())
        req.draft_state = state
        hidden = self._catch_up(state, req.tokens)
        base = state.base = state.cached
        build = TreeBuild(self.topk)
        column_of: dict[int, int] = {}  # candidate -> draft cache column, for forwarded candidates
        build.offer(top_expansions(runner, hidden, self.topk))
        for _ in range(1, self.num_steps):
            frontier = build.advance()
            frontier_hidden = self._forward_frontier(state, frontier, build, column_of, base - 1)
            build.offer(top_expansions(runner, frontier_hidden, self.topk))
        tree, keep = build.prune(self.num_draft_tokens)
        position = {c: i for i, c in enumerate(keep)}
        state.columns = {position[c]: col for c, col in column_of.items() if c in position}
        return tree

    def observe(self, req: Request, accepted: list[int]) -> None:
        """Keep the committed prefix plus the accepted nodes the draft already forwarded (a leading run of the path)."""
        state: _DraftState = req.draft_state
        rel = []
        for node in accepted:
            col = state.columns.get(node)
            if col is None:
                break
            rel.append(col - state.base)
        self.runner.keep(state.cache, state.base, rel)
        state.cached = state.base + len(rel)
        state.columns = {}

    def _catch_up(self, state: _DraftState, tokens: list[int]) -> torch.Tensor:
        """Feed the committed tokens the draft has not seen (the root last); returns the root's hidden state [1, d]."""
        todo = tokens[state.cached:]
        if state.cached == 0:
            hidden = self.runner.prefill(state.cache, todo)
        else:
            start = state.cached
            hidden = self.runner.forward(state.cache, todo, range(start, start + len(todo)),
                                         chain_visibility(start, len(todo)))[-1:]
        state.cached = len(tokens)
        return hidden

    def _forward_frontier(self, state: _DraftState, frontier: Sequence[int], build: TreeBuild,
                          column_of: dict[int, int], root_pos: int) -> torch.Tensor:
        """The frontier nodes in one forward: each sees the committed prefix, its forwarded ancestors and itself."""
        cache_len = self.runner.cache_len(state.cache)
        n = len(frontier)
        visible = torch.zeros(n, cache_len + n, dtype=torch.bool)
        visible[:, : state.base] = True
        key_positions = torch.arange(cache_len)
        for col_cand, col in column_of.items():
            key_positions[col] = root_pos + build.depths[col_cand]
        for row, cand in enumerate(frontier):
            visible[row, cache_len + row] = True
            ancestor = build.parents[cand]
            while ancestor >= 0:
                visible[row, column_of[ancestor]] = True  # every ancestor of a frontier node was forwarded
                ancestor = build.parents[ancestor]
        positions = [root_pos + build.depths[c] for c in frontier]
        hidden = self.runner.forward(state.cache, [build.tokens[c] for c in frontier], positions, visible,
                                     key_positions)
        for row, cand in enumerate(frontier):
            column_of[cand] = cache_len + row
        return hidden
