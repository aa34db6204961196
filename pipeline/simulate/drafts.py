"""STANDALONE (draft-model) configs in the simulator: what the draft replay found, and what a replayed round costs.

The draft replay (`serve.engines.cpu.draft_replay`, run by `pipeline.search.draft_replay` before any STANDALONE
launch) runs the draft model -- never the target -- over the baseline's answers and returns, per answer, topk and
round position j (output[:j] emitted), the ranks of the round's on-path nodes (`serve.draft.acceptance`). A
(num_steps, topk, num_draft_tokens) config's accepted drafts at that round follow from them exactly, so `replay`
walks a STANDALONE config's rounds like an NGRAM config's (`StandaloneSteps`).

What a draft round costs the engine beyond its verify forward (`Round.drafts`, per request): one catch-up forward of
the committed tokens the draft has not seen -- the prompt and first token at a request's first step, then the bonus
token, plus the last accepted node when it was at the deepest level (never forwarded) -- then num_steps - 1 tree
forwards of topk nodes each; each forward also computes its rows' logits. `DraftCurve` is the draft's measured cost
of one such forward by rows, and of a prefill (`verify_cost.draft_cost` of the engine: the CPU engine's probe on the
draft model, the same curve the replay reports), which the step-cost model adds to the round.

Requests of the warm-up phase that the tables lack are replayed without drafts: a draft model keeps no state across
requests, so they move no measured figure. Pure.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from serve.draft.acceptance import accepted, tree_nodes
from serve.spec import FrozenModel, StandaloneSpec

__all__ = ["DraftCurve", "DraftTables", "StandaloneSteps", "draft_curve"]

Ranks = Sequence[Sequence[int]]  # per num_steps: the round's on-path ranks (`RoundTree.ranks`)


class DraftCurve(FrozenModel):
    """ms of one draft forward of `sizes[i]` query rows (with their logits) after a short context, and of a prefill of
    `prefill_tokens[i]` tokens (a request's first draft step), measured on the engine's machine; linear between and
    past the measured sizes."""

    sizes: list[int] = Field(min_length=1)
    ms: list[float] = Field(min_length=1)
    prefill_tokens: list[int] = Field(default_factory=list)
    prefill_ms: list[float] = Field(default_factory=list)

    def forward_ms(self, rows: int) -> float:
        points = sorted({**dict(zip(self.sizes, self.ms)), **dict(zip(self.prefill_tokens, self.prefill_ms))}.items())
        xs, ys = [x for x, _ in points], [y for _, y in points]
        if len(xs) == 1:
            return ys[0] * rows / xs[0]
        i = min(max(bisect.bisect_left(xs, rows), 1), len(xs) - 1)
        return max(0.0, ys[i - 1] + (ys[i] - ys[i - 1]) * (rows - xs[i - 1]) / (xs[i] - xs[i - 1]))


def draft_curve(data: Any) -> DraftCurve | None:
    """The curve of a `draft_cost` entry (the draft replay's, or `/server_info`'s `verify_cost.draft_cost`)."""
    if not isinstance(data, dict):
        return None
    try:
        return DraftCurve(sizes=list(data["sizes"]), ms=list(data["ms"]),
                          prefill_tokens=list(data.get("prefill_tokens") or []),
                          prefill_ms=list(data.get("prefill_ms") or []))
    except (KeyError, TypeError, ValueError):
        return None


@dataclass(frozen=True)
class DraftTables:
    """One draft model's replay: (prompt ids, output ids) -> topk -> ranks of round position j = 1..n-1."""

    draft_model: str
    max_steps: int
    ranks: Mapping[tuple[tuple[int, ...], tuple[int, ...]], Mapping[int, Sequence[Ranks]]]
    curve: DraftCurve | None = None
    seconds: float = 0.0  # the replay's own time (load excluded)

    @property
    def topks(self) -> frozenset[int]:
        return frozenset(k for per in self.ranks.values() for k in per)

    def problem(self, spec: StandaloneSpec) -> str | None:
        """Why this replay cannot give `spec`'s accept lengths (None: it can)."""
        if spec.draft_model != self.draft_model:
            return f"draft model {spec.draft_model!r} was not replayed (only {self.draft_model!r})"
        if spec.num_steps is None or spec.topk is None or spec.num_draft_tokens is None:
            return "num_steps, topk and num_draft_tokens must be set"
        if spec.num_steps > self.max_steps or spec.topk not in self.topks:
            return (f"num_steps={spec.num_steps}, topk={spec.topk} is outside the replay (steps <= {self.max_steps}, "
                    f"topk in {sorted(self.topks)})")
        return None

    def accepted(self, prompt_ids: Sequence[int], output_ids: Sequence[int], emitted: int, num_steps: int,
                 topk: int, num_draft_tokens: int) -> int | None:
        """Accepted drafts of a round after `emitted` output tokens; None if the answer was not replayed."""
        per = self.ranks.get((tuple(prompt_ids), tuple(output_ids)))
        if per is None:
            return None
        return accepted(per[topk][emitted - 1], num_steps, num_draft_tokens)


class StandaloneSteps:
    """A STANDALONE config's verify steps in the replay: accepted drafts, real tree nodes, draft forwards."""

    def __init__(self, spec: StandaloneSpec, tables: DraftTables) -> None:
        problem = tables.problem(spec)
        if problem is not None or spec.num_steps is None or spec.topk is None or spec.num_draft_tokens is None:
            raise ValueError(f"simulate: {problem or 'num_steps, topk and num_draft_tokens must be set'}")
        self.tables = tables
        self.steps, self.topk, self.num_draft_tokens = spec.num_steps, spec.topk, spec.num_draft_tokens
        self.real = tree_nodes(spec.num_steps, spec.topk, spec.num_draft_tokens)

    def step(self, phase: str, prompt_ids: Sequence[int], output_ids: Sequence[int], emitted: int,
             previous: int | None) -> tuple[int, int, tuple[int, ...]]:
        """(accepted drafts, real nodes, draft forward rows) of the step after `emitted` tokens; `previous` = the
        accepted drafts of the request's previous step (None at its first)."""
        drafts = self.tables.accepted(prompt_ids, output_ids, emitted, self.steps, self.topk, self.num_draft_tokens)
        if drafts is None:
            if phase != "warmup":
                raise ValueError("simulate: a measured request is missing from the draft replay")
            drafts = 0
        catch_up = len(prompt_ids) + 1 if previous is None else 1 + (previous == self.steps)
        return drafts, self.real, (catch_up,) + (self.topk,) * (self.steps - 1)
