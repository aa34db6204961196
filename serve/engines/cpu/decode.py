"""One request's life: prefill, then draft + verify steps until a stop rule fires, with SGLang 0.5.23 counters.

A step is exactly one target forward. The first (prefill) emits one token. Every later step verifies one draft tree
rooted at the last emitted token (`none` = an empty tree) and emits the accepted drafts plus one bonus token, then
the speculator sees the new tokens (the n-gram trie inserts, the draft model prunes its cache).

Invariant: the target cache holds the KV of `tokens[:-1]`; `tokens[-1]` (the root of the next tree) is not cached yet.

Counters (per request, SGLang meta_info): `spec_verify_ct` = decode steps; per step the accepted drafts count as
correct drafts, and the accepted drafts plus the bonus token are appended until a stop rule fires (SGLang cuts the
appended tokens at the finishing token, but counts every draft its verify accepted). Hence completion_tokens =
1 (prefill) + spec_verify_ct + spec_num_correct_drafts - (the tokens the last step's stop rule cut off), the cut being
fewer than that step's tree size, and spec_accept_length = completion_tokens / spec_verify_ct.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from serve.ngram.trie import DraftTree
from serve.engines.cpu.runner import ModelRunner, tree_visibility
from serve.engines.cpu.verify import Sampling, TokenChooser, walk_tree

__all__ = ["StopRules", "Request", "Decoder", "Speculator", "StepStats"]


class Speculator(Protocol):
    """A draft source. `propose` returns a tree rooted at `req.tokens[-1]`; `observe` runs after every verify step
    with the accepted tree indices (tokens already appended); `release` when the request ends; `reset` on flush;
    `begin_round` before each scheduler round (every request of the previous round has had its step)."""

    num_draft_tokens: int

    def propose(self, req: Request) -> DraftTree: ...
    def observe(self, req: Request, accepted: list[int]) -> None: ...
    def release(self, req: Request) -> None: ...
    def reset(self) -> None: ...
    def begin_round(self) -> None: ...


@dataclass(frozen=True)
class StopRules:
    max_new_tokens: int
    eos_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    stop_strs: tuple[str, ...] = ()
    stop_str_max_tokens: int = 0  # longest stop string in tokens: how much output tail to decode when checking
    ignore_eos: bool = False


@dataclass(frozen=True)
class StepStats:
    """What one step did, for the server-wide counters."""

    verify: bool  # a decode/verify step (False: the prefill)
    emitted: int  # tokens appended (after a stop rule's cut)
    proposed: int
    correct: int = 0  # drafts the verify accepted (also those a stop rule then cut off)


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    sampling: Sampling
    rules: StopRules
    seed: int
    created: float = field(default_factory=time.monotonic)
    tokens: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    cache: Any = None
    draft_state: Any = None  # owned by the speculator
    finish_reason: dict | None = None
    spec_verify_ct: int = 0
    spec_num_correct_drafts: int = 0
    spec_num_proposed_drafts: int = 0
    correct_histogram: list[int] = field(default_factory=list)
    finished_at: float | None = None
    chooser: TokenChooser | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def meta_info(self, speculative: bool, num_draft_tokens: int | None) -> dict:
        """SGLang 0.5.23 meta_info keys; the spec keys only when the request had a verify step."""
        info: dict = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": 0,
        }
        if self.finished_at is not None:
            info["e2e_latency"] = self.finished_at - self.created
        if speculative and self.spec_verify_ct > 0:
            ct = self.spec_verify_ct
            info["spec_verify_ct"] = ct
            info["spec_accept_length"] = len(self.output_ids) / ct
            info["spec_num_correct_drafts"] = self.spec_num_correct_drafts
            info["spec_num_proposed_drafts"] = self.spec_num_proposed_drafts
            denominator = ct * max(1, (num_draft_tokens or 1) - 1)
            info["spec_accept_rate"] = self.spec_num_correct_drafts / denominator
            info["spec_correct_drafts_histogram"] = list(self.correct_histogram)
        return info


class Decoder:
    """Runs steps of requests on one target model with one (optional) speculator. Single-threaded."""

    def __init__(self, runner: ModelRunner, tokenizer: Any, speculator: Speculator | None) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.speculator = speculator
        # Test-only (`--test-fault batch-noise`, faults.py): perturbs every decode/verify step's logits the way
        # batched GPU numerics do; None (always, outside that switch) leaves decoding exact.
        self.logit_noise: Callable[[torch.Tensor], torch.Tensor] | None = None

    def step(self, req: Request) -> StepStats:
        """One target forward for `req`: its prefill, or one draft + verify step."""
        if req.finished:
            raise RuntimeError(f"request {req.rid} already finished")
        if req.cache is None:
            return self._prefill(req)
        return self._verify(req)

    def step_many(self, reqs: Sequence[Request]) -> list[StepStats | Exception]:
        """One step for each of `reqs` (a scheduler round): prefills one by one, then every draft + verify step in
        one batched target forward where the runner batches (`ModelRunner.batches`). Each result is the request's
        `StepStats` or the exception its step raised, so one bad request fails alone. If the batched forward
        itself raises, each request's forward is run alone with the tree it already drafted (drafting has side
        effects: the n-gram insert is queued at propose time), so the error lands on the request that caused it."""
        results: dict[int, StepStats | Exception] = {}
        drafted: list[tuple[int, Request, _Drafted]] = []
        for i, req in enumerate(reqs):
            try:
                if req.finished:
                    raise RuntimeError(f"request {req.rid} already finished")
                if req.cache is None:
                    results[i] = self._prefill(req)
                elif not self.runner.batches:
                    results[i] = self._verify(req)
                else:
                    drafted.append((i, req, self._draft(req)))
            except Exception as err:  # noqa: BLE001 - handed to the caller per request
                results[i] = err
        if drafted:
            try:
                hiddens = self.runner.forward_many(
                    [(req.cache, step.tokens, step.positions, step.visible) for _, req, step in drafted])
            except Exception:  # noqa: BLE001 - retried one by one below, where the error has an owner
                hiddens = None
            if hiddens is None:
                for i, req, step in drafted:
                    results[i] = self._forward_alone(req, step)
            else:
                # the first-level logits of every request in one matmul: the LM head is read once per round too
                firsts = self.runner.logits(torch.cat([h[:step.first] for h, (_, _, step) in zip(hiddens, drafted)]))
                offset = 0
                for hidden, (i, req, step) in zip(hiddens, drafted):
                    rows = firsts[offset:offset + step.first]
                    offset += step.first
                    try:
                        results[i] = self._accept(req, step, hidden, _LazyLogits(self.runner, hidden, rows=rows,
                                                                                 noise=self.logit_noise))
                    except Exception as err:  # noqa: BLE001
                        results[i] = err
        return [results[i] for i in range(len(reqs))]

    def _forward_alone(self, req: Request, step: _Drafted) -> StepStats | Exception:
        try:
            return self._verify_drafted(req, step)
        except Exception as err:  # noqa: BLE001
            return err

    def begin_round(self) -> None:
        """Called by the scheduler before each round of steps (NGRAM lands the previous round's inserts here)."""
        # Optional on the protocol's implementers: a draft source without round-level state need not define it.
        begin = getattr(self.speculator, "begin_round", None)
        if begin is not None:
            begin()

    def release(self, req: Request) -> None:
        req.cache = None
        if self.speculator is not None:
            self.speculator.release(req)

    def _prefill(self, req: Request) -> StepStats:
        req.chooser = TokenChooser(req.sampling, _generator(req.seed) if not req.sampling.greedy else None)
        req.tokens = list(req.prompt_ids)
        req.cache = self.runner.new_cache()
        hidden = self.runner.prefill(req.cache, req.prompt_ids)
        token = req.chooser(self.runner.logits(hidden)[0])
        self._append(req, [token])
        return StepStats(verify=False, emitted=1, proposed=0)

    def _verify(self, req: Request) -> StepStats:
        return self._verify_drafted(req, self._draft(req))

    def _verify_drafted(self, req: Request, step: _Drafted) -> StepStats:
        hidden = self.runner.forward(req.cache, step.tokens, step.positions, step.visible)
        return self._accept(req, step, hidden, _LazyLogits(self.runner, hidden, first=step.first,
                                                           noise=self.logit_noise))

    def _draft(self, req: Request) -> _Drafted:
        """Propose a tree rooted at the last token and lay it out as the target forward's queries."""
        if req.chooser is None:
            raise RuntimeError(f"request {req.rid}: verify step before its prefill")
        tree = self.speculator.propose(req) if self.speculator is not None else _EMPTY
        base = self.runner.cache_len(req.cache)
        parents = [-1, *(p + 1 for p in tree.parents)]  # query 0 is the root
        return _Drafted(tree=tree, base=base, tokens=[req.tokens[-1], *tree.tokens], parents=parents,
                        positions=[base + d for d in (0, *tree.depths())],
                        visible=tree_visibility(base, parents), first=1 + tree.num_real)

    def _accept(self, req: Request, step: _Drafted, hidden: torch.Tensor, logits_at: _LazyLogits) -> StepStats:
        """Walk the verified tree, keep the accepted KV columns, append the tokens, update the counters."""
        chooser = req.chooser
        if chooser is None:
            raise RuntimeError(f"request {req.rid}: verify step before its prefill")
        accepted, emitted = walk_tree(step.tokens, step.parents, logits_at, chooser)
        self.runner.keep(req.cache, step.base, [0, *accepted])
        kept = self._append(req, emitted)
        tree = step.tree
        req.spec_verify_ct += 1
        # SGLang counts the drafts its verify accepted, also those a stop rule then cuts off (batch_result_processor:
        # num_correct_drafts_per_req), so the last step of a length-capped request counts them too.
        correct = len(accepted)
        req.spec_num_correct_drafts += correct
        req.spec_num_proposed_drafts += len(tree.tokens)
        if len(req.correct_histogram) <= correct:
            req.correct_histogram.extend([0] * (correct + 1 - len(req.correct_histogram)))
        req.correct_histogram[correct] += 1
        if self.speculator is not None:
            self.speculator.observe(req, [a - 1 for a in accepted])
        return StepStats(verify=True, emitted=kept, proposed=len(tree.tokens), correct=correct)

    def _append(self, req: Request, new_tokens: Sequence[int]) -> int:
        """Append tokens one by one, checking the stop rules after each (as SGLang does); returns how many were kept."""
        rules = req.rules
        for count, token in enumerate(new_tokens, 1):
            req.output_ids.append(token)
            req.tokens.append(token)
            reason = self._stop_reason(req, token, rules)
            if reason is not None:
                req.finish_reason = reason
                req.finished_at = time.monotonic()
                return count
        return len(new_tokens)

    def _stop_reason(self, req: Request, token: int, rules: StopRules) -> dict | None:
        # SGLang's Req.check_finished order: length first, then stop tokens, then stop strings.
        if len(req.output_ids) >= rules.max_new_tokens:
            return {"type": "length", "length": rules.max_new_tokens}
        if not rules.ignore_eos and token in rules.eos_ids:
            return {"type": "stop", "matched": token}
        if token in rules.stop_token_ids:
            return {"type": "stop", "matched": token}
        if rules.stop_strs:
            tail = self.tokenizer.decode(req.output_ids[-(rules.stop_str_max_tokens + 1):])
            for stop in rules.stop_strs:
                if stop in tail:
                    return {"type": "stop", "matched": stop}
        return None


_EMPTY = DraftTree(tokens=(), parents=(), num_real=0)


def _generator(seed: int) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


class _LazyLogits:
    """Logits of the verified queries, computed once per query: the root and the real draft nodes in one matmul
    (what a typical step needs; `rows` when the caller computed them for a whole batch), pads only if the walk
    reaches one."""

    def __init__(self, runner: ModelRunner, hidden: torch.Tensor, first: int = 0,
                 rows: torch.Tensor | None = None,
                 noise: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self._runner = runner
        self._hidden = hidden
        self._noise = noise
        batch = runner.logits(hidden[:first]) if rows is None else rows
        if noise is not None:
            batch = noise(batch)
        self._rows: dict[int, torch.Tensor] = {i: batch[i] for i in range(int(batch.shape[0]))}

    def __call__(self, index: int) -> torch.Tensor:
        row = self._rows.get(index)
        if row is None:
            row = self._runner.logits(self._hidden[index:index + 1])
            row = (self._noise(row) if self._noise is not None else row)[0]
            self._rows[index] = row
        return row


@dataclass(frozen=True)
class _Drafted:
    """A drafted step, laid out as the target forward's queries (query 0 = the root, the last emitted token)."""

    tree: DraftTree
    base: int  # cache columns before the queries
    tokens: list[int]
    parents: list[int]
    positions: list[int]
    visible: torch.Tensor
    first: int  # queries whose logits a typical walk needs: the root and the real (non-pad) draft nodes
