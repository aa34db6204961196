"""The step-cost model: how long one engine round takes, T(batch rows, query tokens per request, context), plus each
prefill, fitted to the launches that ran.

A round (pipeline.simulate.replay.Round) prefills its new requests one by one, then verifies b requests of w query
tokens each (w = num_draft_tokens, 1 for plain decoding) in one forward. Its time is

    sum of prefill(prompt tokens)  +  k * shape(b, w, logit rows, context)  +  o * b      (milliseconds)

- `shape` is the engine's own curve when it measured one (the CPU engine's round table in `/server_info`'s
  `verify_cost.round_cost`, measured once per model, dtype, threads, weights mode and machine: the forward of b x w
  queries, the LM head per row -- a round computes logits for every root and real draft node -- and one step at a
  longer context), in milliseconds; for an engine that reports none (SGLang's own server, llama-server), the same
  table measured over its HTTP API right after the baseline's measurement (pipeline/measure/shape.py, recorded as
  the baseline's `verify_cost`; SGLang's verify computes the logits of every query row, so its cells hold them and
  its LM-head column is flat); otherwise (the probe failed) a prior for a memory-bound decode step,
  1 + ALPHA * (b*w - 1), in units of one plain step.
- `k` scales the shape and `o` is the per-request cost of a round outside the forward (drafting, tree masks, the
  accept walk, streaming). Both are fitted to what each launch measured: the sum over its measured requests of
  (e2e - ttft), against the same sum over the rounds the replay says each request spanned (`Launch`). One launch
  (the baseline) fixes the scale: with a measured shape, k = 1 and o absorbs the rest; with the prior, o = 0 and k is
  the baseline's step. Two launches whose rounds differ in shape (the baseline and any NGRAM config) fit both, by
  non-negative least squares on relative errors; every further launch refines them.
- a STANDALONE round also runs the draft model (`Round.drafts`: the rows of each draft forward); with a measured
  shape, `draft` (the draft's measured curve, pipeline.simulate.drafts) adds its milliseconds to the shape.
- `prefill(n) = p0 + p1 * n` from the launches' TTFTs (the prefill plus the request's way in and its first chunk's
  way out; the same for every config, so every launch refits it on all of them). n is the tokens the prefill
  computes: the prompt's, less what the engine's prefix cache held (pipeline.simulate.prefix: SGLang's radix cache
  keeps the warm-up's and earlier requests' shared prefix, and a TTFT follows the rest); `gap_s`: what a closed-loop
  client spends between a reply and its next request, from the baseline's window and e2e times.
Pure: no I/O.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field

from pipeline.simulate.drafts import DraftCurve
from pipeline.simulate.replay import Round
from serve.spec import FrozenModel

__all__ = ["ALPHA", "CostModel", "Launch", "RoundTable", "fit_cost", "plain_step", "prefill_fit", "round_table"]

ALPHA = 0.015  # prior: each extra query row costs 1.5% of a plain decode step (bf16 GPU/AMX: 16 rows ~1.2x)


@dataclass
class _Derived:
    sources: tuple[Any, ...]
    ms: list[list[float]]
    heads: list[float]
    memo: dict[tuple[int, int, int], float]


class RoundTable(FrozenModel):
    """An engine's measured round costs (ms): `ms[i][j]` for batches[i] requests x widths[j] queries each, the LM
    head per row count, and one plain step at context_tokens and at long_context_tokens."""

    batches: list[int] = Field(min_length=1)
    widths: list[int] = Field(min_length=1)
    ms: list[list[float]]
    lm_head_rows: list[int] = Field(min_length=1)
    lm_head_ms: list[float]
    context_tokens: int
    long_context_tokens: int
    short_context_ms: float
    long_context_ms: float
    # True: read the cells as measured, not raised to a narrower or smaller one's. For a table whose dips reproduce
    # (pipeline/measure/shape.py): torch's fp32 GEMM on 2 or 3 rows is slower than on 4 (SmolLM2's LM head, one
    # thread: 7.0, 17.5, 26.3, 13.6 ms for 1-4 rows), so an engine's verify of width 3 costs more than of width 4.
    as_measured: bool = False

    def _derived(self) -> _Derived:
        """The table read as monotone (more rows never cost less: a cell below a narrower or smaller one is
        measurement noise, raised to it), unless `as_measured`, and a memo of interpolated shapes, computed once per
        table: re-predicting a space times every round of every config. Kept beside the fields, and checked against
        the very lists it was made from, so a `model_copy(update=...)` with other cells recomputes it."""
        derived = self.__dict__.get("_derived_cache")
        sources = (self.batches, self.widths, self.ms, self.lm_head_rows, self.lm_head_ms, self.as_measured)
        if derived is None or any(a is not b for a, b in zip(derived.sources, sources)):
            if self.as_measured:
                derived = _Derived(sources, [list(row) for row in self.ms], list(self.lm_head_ms), {})
            else:
                derived = _Derived(sources, _monotone(self.ms), _monotone([self.lm_head_ms])[0], {})
            self.__dict__["_derived_cache"] = derived
        return derived

    def verify_ms(self, batch: int, width: int, logit_rows: int, context: float) -> float:
        """A round's verify forward, from the monotone table."""
        derived = self._derived()
        key = (batch, width, logit_rows)
        base = derived.memo.get(key)
        if base is None:
            heads = derived.heads
            # the table's cell holds the logits of the b roots; a round computes every root's and real node's
            base = _interp2(self.batches, self.widths, derived.ms, batch, width) + (
                _interp(self.lm_head_rows, heads, logit_rows) - _interp(self.lm_head_rows, heads, batch))
            derived.memo[key] = base
        span = max(1, self.long_context_tokens - self.context_tokens)
        per_token = max(0.0, self.long_context_ms / self.short_context_ms - 1.0) / span if self.short_context_ms else 0.0
        return max(0.0, base) * (1.0 + per_token * (context - self.context_tokens))


def round_table(verify_cost: Any) -> RoundTable | None:
    """The round table an engine reported (`verify_cost.round_cost` of its `/server_info`), None if it has none."""
    if not isinstance(verify_cost, dict) or not isinstance(verify_cost.get("round_cost"), dict):
        return None
    data = verify_cost["round_cost"]
    try:
        return RoundTable.model_validate({k: data[k] for k in RoundTable.model_fields if k in data})
    except (KeyError, ValueError):
        return None


def plain_step(verify_cost: Any) -> Callable[[int, float], float] | None:
    """The engine's calibrated plain decode step (ms) at `batch` requests and `context` tokens, from the round table
    it reported; None when it reported none. What a plain-decoding measurement window is judged against
    (pipeline/measure/window.py)."""
    table = round_table(verify_cost)
    if table is None:
        return None
    return lambda batch, context: table.verify_ms(batch, 1, batch, context)


class CostModel(FrozenModel):
    """A fitted step-cost model (see the module docstring); `launches` = launches it was fitted to."""

    shape: Literal["measured", "prior"]
    table: RoundTable | None = None
    alpha: float = ALPHA
    k: float = Field(gt=0)
    o_ms: float = Field(0.0, ge=0)
    p0_ms: float = Field(0.0, ge=0)
    p1_ms: float = Field(0.0, ge=0)
    gap_s: float = Field(0.0, ge=0)
    launches: int = 0
    draft: DraftCurve | None = None  # a STANDALONE draft model's forward by rows (ms), with a measured shape

    def shape_of(self, r: Round) -> float:
        """The round's verify shape (0 without a verify step)."""
        if not r.batch:
            return 0.0
        if self.table is not None:
            context = sum(r.contexts) / r.batch
            drafted = sum(self.draft.forward_ms(rows) for rows in r.drafts) if self.draft is not None else 0.0
            return self.table.verify_ms(r.batch, r.width, r.batch + sum(r.trees), context) + drafted
        return 1.0 + self.alpha * (r.batch * r.width - 1)

    def prefill_ms(self, r: Round) -> float:
        return sum(self.p0_ms + self.p1_ms * n for n in r.prefills)

    def seconds(self, r: Round) -> float:
        """What the round costs: prefills + k * shape + o per verifying request."""
        verify = self.k * self.shape_of(r) + self.o_ms * r.batch if r.batch else 0.0
        return (self.prefill_ms(r) + verify) / 1000.0


@dataclass(frozen=True)
class Launch:
    """One measured launch as the fit sees it: measured = sum over its measured requests of (e2e - ttft) in ms, and
    for each such request the rounds the replay says it decoded in (after its prefill round)."""

    measured_ms: float
    rounds: tuple[tuple[Round, ...], ...]


def prefill_fit(prompt_tokens: Sequence[int], ttft_s: Sequence[float]) -> tuple[float, float]:
    """(p0, p1) in ms of prefill(n) = p0 + p1 * n: least squares on the launches' (prefilled tokens, TTFT) with
    p0 >= 0 and p1 >= 0; all prefills of one length give p1 = 0 and p0 = the median TTFT."""
    pairs = [(n, t * 1000.0) for n, t in zip(prompt_tokens, ttft_s) if t is not None]
    if not pairs:
        raise ValueError("simulate: the baseline has no TTFT to fit the prefill cost on")
    xs = [float(n) for n, _ in pairs]
    ys = [t for _, t in pairs]
    mean_x = statistics.fmean(xs)
    var = sum((x - mean_x) ** 2 for x in xs)
    if var == 0:
        return statistics.median(ys), 0.0
    slope = sum((x - mean_x) * (y - statistics.fmean(ys)) for x, y in zip(xs, ys)) / var
    if slope <= 0:
        return statistics.median(ys), 0.0
    intercept = statistics.fmean(ys) - slope * mean_x
    if intercept < 0:
        # The best line with p0 >= 0 then passes through the origin. Clipping p0 and keeping the free fit's slope
        # would add |intercept| to every prefill: 4 TTFTs over a narrow range of prompt lengths (one of them slow)
        # gave -143 ms, and a first launch predicted 26% low.
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return intercept, slope


def fit_cost(base: CostModel, launches: Sequence[Launch]) -> CostModel:
    """(k, o) fitted to `launches` (module docstring); `base` carries the shape, prefill and gap."""
    rows: list[tuple[float, float, float, float]] = []
    for launch in launches:
        shape = sum(base.shape_of(r) for rounds in launch.rounds for r in rounds)
        per_request = sum(r.batch for rounds in launch.rounds for r in rounds)
        prefill = sum(base.prefill_ms(r) for rounds in launch.rounds for r in rounds)
        target = launch.measured_ms - prefill
        if shape > 0 and launch.measured_ms > 0:
            rows.append((shape, float(per_request), target, launch.measured_ms))
    if not rows:
        raise ValueError("simulate: no launch with a decode step to fit the step cost on")
    k, o = _nnls2(rows) if len(rows) >= 2 else (None, None)
    if k is None:  # one launch, or launches whose rounds do not tell k and o apart
        total_shape = sum(r[0] for r in rows)
        total_requests = sum(r[1] for r in rows)
        total_target = sum(r[2] for r in rows)
        if base.shape == "measured" and total_target >= total_shape:
            k, o = 1.0, (total_target - total_shape) / total_requests
        else:
            k, o = max(total_target, 1e-9) / total_shape, 0.0
    return base.model_copy(update={"k": max(k, 1e-9), "o_ms": max(0.0, o or 0.0), "launches": len(launches)})


def _nnls2(rows: Sequence[tuple[float, float, float, float]]) -> tuple[float | None, float | None]:
    """min sum ((k a + o b - y) / w)^2 over k > 0, o >= 0; (None, None) when a and b are collinear."""
    saa = sab = sbb = say = sby = 0.0
    for a, b, y, w in rows:
        saa += a * a / w / w
        sab += a * b / w / w
        sbb += b * b / w / w
        say += a * y / w / w
        sby += b * y / w / w
    det = saa * sbb - sab * sab
    if det <= 1e-12 * saa * sbb:
        return None, None
    k = (say * sbb - sby * sab) / det
    o = (saa * sby - sab * say) / det
    if k > 0 and o >= 0:
        return k, o
    return (say / saa if say > 0 else None), 0.0  # o pinned at 0


def _monotone(ms: Sequence[Sequence[float]]) -> list[list[float]]:
    """Running maxima along each row (widths) and then down each column (batches)."""
    rows = [[max(row[:j + 1]) for j in range(len(row))] for row in ms]
    for i in range(1, len(rows)):
        rows[i] = [max(a, b) for a, b in zip(rows[i], rows[i - 1])]
    return rows


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear in x, extrapolated linearly past either end."""
    if len(xs) == 1:
        return ys[0] * x / xs[0] if xs[0] else ys[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _interp2(batches: Sequence[int], widths: Sequence[int], ms: Sequence[Sequence[float]], b: float,
             w: float) -> float:
    column = [_interp(widths, row, w) for row in ms]
    return _interp(batches, column, b)
