"""A space's NGRAM configs replayed and priced in bulk, closed loop at concurrency 1 (one request in flight at a time:
the CPU engine's search level), with the same replays and the same figures as `Simulator.predict`, to the bit.

At concurrency 1 a request runs alone from its prefill to its end, so a config's replay is, request after request,
its prefill round and then one verify step a round (replay.py's `_finish_alone`), and a config's traffic differs from
another warm-up count's only in how many warm-up requests go first. `replay_counts` replays one config at every
warm-up count of the space in one call into the compiled trie (serve/ngram/csrc/ngram_trie.cpp `sdt_replay_solo`):
the warm-up once, each count's measurement on the trie as the warm-up left it, its inserts then taken back. The
result is each request's (tokens kept, real draft nodes) per step, as small integer arrays: nothing per round in
Python.

`price` then does what `predict.timed` and `predict.predicted_metrics` do, in the same floating-point operations in
the same order: the rounds' seconds (`cost.seconds` per distinct round shape, the verify's context term in numpy as
`RoundTable.verify_ms` computes it), a running sum over the rounds from the replay's start (warm-up included: the
measurement's times carry the warm-up's sum, as `timed`'s do), the client's gap before each request. Lag rounds are
empty and cost 0.0, so they move nothing. tests/unit/test_simulate_solo.py holds both paths equal on every figure.
"""

from __future__ import annotations

from collections.abc import Sequence
import hashlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from pipeline.simulate.cost import CostModel
from pipeline.simulate.prefix import HeldPrefixes, PrefixCache
from pipeline.simulate.replay import Answer, ClosedLoop, Round
from pipeline.simulate.workload import phases_for
from serve.ngram import compiled
from serve.ngram.drafttree import token_ids

__all__ = ["SoloReplays", "Traffic", "price", "replay_counts", "solo_traffic"]

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Traffic:
    """What every config of a space sends at concurrency 1, as flat arrays for the compiled replay: each distinct
    answer's prompt and output once, then the warm-up requests in order (cycled up to the space's largest count) and
    the measurement's, as answer numbers."""

    tokens: np.ndarray  # int32, every answer's prompt + output ids, concatenated
    offsets: np.ndarray  # int64, answer s is tokens[offsets[s]:offsets[s + 1]]
    prompt_lens: np.ndarray  # int32
    output_lens: np.ndarray  # int32
    warm: np.ndarray  # int32, the answer of each warm-up request
    measure: np.ndarray  # int32
    answers: tuple[Answer, ...]  # answer s


def solo_traffic(simulator: Any, max_warmup: int) -> Traffic | None:
    """The traffic of `simulator`'s configs at concurrency 1, with up to `max_warmup` warm-up requests (built by
    `phases_for`, as a replay builds it); None where the bulk path does not apply: open-loop arrivals."""
    if simulator.open_loop:
        return None
    trial = SimpleNamespace(warmup_requests=max_warmup, concurrency=1)
    phases = phases_for(trial, simulator.warmup, simulator.measure, simulator.answers, seed=simulator.seed)
    if any(not isinstance(p.admission, ClosedLoop) for p in phases):
        return None
    warm = next((p.answers for p in phases if p.name == "warmup"), ())
    measure = next(p.answers for p in phases if p.name == "measure")
    index: dict[int, int] = {}
    answers: list[Answer] = []
    for answer in (*warm, *measure):
        if id(answer) not in index:
            index[id(answer)] = len(answers)
            answers.append(answer)
    sequences = [token_ids(a.prompt_ids + a.output_ids, "sequence") for a in answers]
    return Traffic(
        tokens=np.fromiter((t for s in sequences for t in s), np.int32, sum(len(s) for s in sequences)),
        offsets=np.cumsum([0] + [len(s) for s in sequences], dtype=np.int64),
        prompt_lens=np.array([len(a.prompt_ids) for a in answers], np.int32),
        output_lens=np.array([len(a.output_ids) for a in answers], np.int32),
        warm=np.array([index[id(a)] for a in warm], np.int32),
        measure=np.array([index[id(a)] for a in measure], np.int32),
        answers=tuple(answers))


@dataclass(frozen=True)
class SoloReplays:
    """One NGRAM config replayed at several warm-up counts (`sdt_replay_solo`): the warm-up requests' steps once (a
    count's replay starts with the first `count` of them), then each count's measurement."""

    counts: tuple[int, ...]
    warm_kept: np.ndarray  # int16, tokens each step kept (accepted drafts + the bonus, cut at the output's end)
    warm_real: np.ndarray  # int16, real draft nodes of each step's tree
    warm_steps: np.ndarray  # int32, each warm-up request's steps
    warm_starts: np.ndarray  # int64, warm-up request r's steps are [warm_starts[r], warm_starts[r + 1])
    meas_kept: np.ndarray  # int16, every count's measurement, count after count
    meas_real: np.ndarray
    meas_steps: np.ndarray  # int32 [counts, measured requests]
    meas_starts: np.ndarray  # int64, count i's measurement steps are [meas_starts[i], meas_starts[i + 1])
    nodes: np.ndarray  # int64, the trie's nodes after each count's measurement (Replay.trie_nodes)

    def at(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(kept, real, steps per request) of counts[i]'s replay: its warm-up requests, then its measurement."""
        count, end = self.counts[i], self.warm_starts[self.counts[i]]
        span = slice(self.meas_starts[i], self.meas_starts[i + 1])
        return (np.concatenate((self.warm_kept[:end], self.meas_kept[span])),
                np.concatenate((self.warm_real[:end], self.meas_real[span])),
                np.concatenate((self.warm_steps[:count], self.meas_steps[i])))

    def signature(self, i: int, width: int) -> str:
        """What the cost model sees of counts[i]'s replay (its warm-up count, width, steps per request, each step's
        kept tokens and real nodes): equal for two configs exactly when every cost model prices them alike."""
        count, end = self.counts[i], self.warm_starts[self.counts[i]]
        span = slice(self.meas_starts[i], self.meas_starts[i + 1])
        digest = hashlib.blake2b(b"%d %d " % (count, width), digest_size=16)
        for part in (self.warm_steps[:count], self.meas_steps[i], self.warm_kept[:end], self.meas_kept[span],
                     self.warm_real[:end], self.meas_real[span]):
            digest.update(part.tobytes())
        return digest.hexdigest()


def replay_counts(spec: Any, capacity: int, traffic: Traffic, counts: Sequence[int]) -> SoloReplays:
    """`spec` (an NgramSpec, read for its trie and drafting fields; `capacity` instead of its own) replayed at every
    warm-up count in `counts` (ascending, each at most len(traffic.warm)), closed loop at concurrency 1.
    compiled.CompiledUnavailable where the trie cannot be built."""
    lib = compiled.library()
    counts = tuple(counts)
    top = counts[-1] if counts else 0
    measured = len(traffic.measure)
    warm_room = int((traffic.output_lens[traffic.warm[:top]] - 1).sum()) + 1
    meas_room = len(counts) * int((traffic.output_lens[traffic.measure] - 1).sum()) + 1
    warm_kept, warm_real = np.zeros(warm_room, np.int16), np.zeros(warm_room, np.int16)
    meas_kept, meas_real = np.zeros(meas_room, np.int16), np.zeros(meas_room, np.int16)
    warm_steps = np.zeros(top, np.int32)
    meas_steps = np.zeros((len(counts), measured), np.int32)
    nodes = np.zeros(len(counts), np.int64)
    wanted = np.asarray(counts, np.int32)
    handle = lib.sdt_cache_new(spec.max_trie_depth, capacity, spec.min_bfs_breadth, spec.max_bfs_breadth,
                               int(spec.match_type == "PROB"), spec.num_draft_tokens)
    try:
        written = lib.sdt_replay_solo(
            handle, traffic.tokens.ctypes.data, traffic.offsets.ctypes.data, traffic.prompt_lens.ctypes.data,
            traffic.warm.ctypes.data, len(traffic.warm), traffic.measure.ctypes.data, measured,
            wanted.ctypes.data, len(counts), warm_kept.ctypes.data, warm_real.ctypes.data, warm_steps.ctypes.data,
            meas_kept.ctypes.data, meas_real.ctypes.data, meas_steps.ctypes.data, nodes.ctypes.data)
    finally:
        lib.sdt_cache_free(handle)
    if written < 0:
        raise ValueError(f"simulate: warm-up counts {counts} do not fit the traffic ({len(traffic.warm)} warm-up "
                         "requests)")
    warm_starts = np.concatenate(([0], np.cumsum(warm_steps, dtype=np.int64)))
    meas_starts = np.concatenate(([0], np.cumsum(meas_steps.sum(axis=1), dtype=np.int64)))
    end = int(warm_starts[-1])
    return SoloReplays(counts, warm_kept[:end].copy(), warm_real[:end].copy(), warm_steps, warm_starts,
                       meas_kept[:written].copy(), meas_real[:written].copy(), meas_steps, meas_starts, nodes)


def uncached_prefills(traffic: Traffic, count: int, prefix: PrefixCache | None) -> list[int]:
    """The tokens each request's prefill computes, in order (count warm-up requests, then the measurement): the
    prompt's, less what the prefix cache held (held as replay.py holds them: the prompt after its prefill, prompt and
    output but the last token when the request ends; one request at a time, so the same for every config)."""
    order = [int(s) for s in (*traffic.warm[:count], *traffic.measure)]
    if prefix is None:
        return [int(traffic.prompt_lens[s]) for s in order]
    held = HeldPrefixes(prefix)
    out = []
    for s in order:
        answer = traffic.answers[s]
        out.append(held.uncached(answer.prompt_ids))
        held.hold(answer.prompt_ids)  # after its prefill (its whole sequence, below, extends it)
        held.hold(answer.prompt_ids + answer.output_ids[:-1])
    return out


class StepCost:
    """`cost.seconds` of the rounds a bulk replay makes, for arrays of them, in the same floating-point operations:
    a prefill round's from `cost.seconds` itself (per distinct prompt length), a one-request verify round's (width,
    real nodes, context) from the table's cell per (width, logit rows) -- `RoundTable.verify_ms` itself -- with the
    context term and the scale in numpy, as `verify_ms` and `CostModel.seconds` compute them."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._cells: dict[tuple[int, int], float] = {}
        self._prefills: dict[int, float] = {}
        table = cost.table
        self.per_token = 0.0
        if table is not None:
            span = max(1, table.long_context_tokens - table.context_tokens)
            self.per_token = (max(0.0, table.long_context_ms / table.short_context_ms - 1.0) / span
                              if table.short_context_ms else 0.0)

    def prefill(self, tokens: int) -> float:
        found = self._prefills.get(tokens)
        if found is None:  # a prefill round's cost does not depend on its width (no verify in it)
            found = self._prefills[tokens] = self.cost.seconds(Round((tokens,), 1, (), ()))
        return found

    def cells(self, widths: Sequence[int], reals: int) -> np.ndarray:
        """cells[width, real] for every width in `widths` and real nodes below `reals`: with the prior, a round's
        seconds (the same at every context); with a table, its cell (`verify_ms` at the table's own context)."""
        out = np.zeros((max(widths, default=0) + 1, reals))
        for w in set(widths):
            for r in range(reals):
                out[w, r] = self._cell(w, r)
        return out

    def _cell(self, width: int, real: int) -> float:
        key = (width, real)
        found = self._cells.get(key)
        if found is None:
            table = self.cost.table
            if table is None:
                found = self.cost.seconds(Round((), width, (real,), (0,)))
            else:
                found = table.verify_ms(1, width, 1 + real, table.context_tokens)
            self._cells[key] = found
        return found


def price_rows(traffic: Traffic, count: int, rows: Sequence[tuple[SoloReplays, int, int]], prefills: Sequence[int],
               step_cost: StepCost) -> list[dict[str, float]]:
    """Predicted figures of replays that share a warm-up count (`rows`: (replays, the count's index in them, the
    config's width)), as `predicted_metrics(timed(replay))` gives each; `prefills`: `uncached_prefills` at `count`.
    The clock runs in C++ (`sdt_price_solo`: one pass over every step, in `timed`'s operations); the figures from
    the measured requests' times in numpy, as `predicted_metrics` takes them."""
    if not rows:
        return []
    cost = step_cost.cost
    measured = len(traffic.measure)
    total = count + measured
    order = np.concatenate((traffic.warm[:count], traffic.measure))
    per_request = np.empty((len(rows), total), np.int64)
    kept_parts, real_parts = [], []
    for b, (replays, i, _) in enumerate(rows):
        per_request[b, :count] = replays.warm_steps[:count]
        per_request[b, count:] = replays.meas_steps[i]
        end, span = replays.warm_starts[count], slice(replays.meas_starts[i], replays.meas_starts[i + 1])
        kept_parts += [replays.warm_kept[:end], replays.meas_kept[span]]
        real_parts += [replays.warm_real[:end], replays.meas_real[span]]
    kept = np.ascontiguousarray(np.concatenate(kept_parts), np.int16)
    real = np.ascontiguousarray(np.concatenate(real_parts), np.int16)
    row_off = np.concatenate(([0], np.cumsum(per_request.sum(axis=1))))
    verify = per_request[:, count:].sum(axis=1)
    itl_off = np.concatenate(([0], np.cumsum(verify)))
    widths = np.array([w for _, _, w in rows], np.int32)
    reals = int(real.max(initial=0)) + 1
    cells = step_cost.cells(widths.tolist(), reals)
    table = cost.table
    prompt_lens = traffic.prompt_lens[order].astype(np.int64)
    prefill_s = np.array([step_cost.prefill(n) for n in prefills], np.float64)
    arrival = np.zeros((len(rows), measured))
    first = np.zeros((len(rows), measured))
    finished = np.zeros((len(rows), measured))
    itl = np.zeros(int(itl_off[-1]))
    compiled.library().sdt_price_solo(
        len(rows), total, count, per_request.ctypes.data, kept.ctypes.data, real.ctypes.data, row_off.ctypes.data,
        widths.ctypes.data, reals, prompt_lens.ctypes.data, prefill_s.ctypes.data, cost.gap_s,
        0 if table is None else 1, cells.ctypes.data, step_cost.per_token, table.context_tokens if table else 0,
        cost.k, cost.o_ms, itl_off.ctypes.data, arrival.ctypes.data, first.ctypes.data, finished.ctypes.data,
        itl.ctypes.data)
    window = np.maximum(finished.max(axis=1) - arrival.min(axis=1), 1e-9)
    lens = traffic.output_lens[traffic.measure].astype(np.int64)
    tokens = int(lens.sum())
    verified_tokens = (lens[None, :] * (per_request[:, count:] > 0)).sum(axis=1)
    # kept tokens of the measured steps: each row's last `verify` steps
    kept_so_far = np.concatenate(([0], np.cumsum(kept, dtype=np.int64)))
    kept_measured = kept_so_far[row_off[1:]] - kept_so_far[row_off[1:] - verify]
    quantiles: dict[str, list[list[float] | None]] = {
        name: _percentiles(values) for name, values in (("ttft", first - arrival), ("e2e", finished - arrival))}
    quantiles["itl"] = [None] * len(rows)
    for size in np.unique(verify).tolist():
        if size == 0:
            continue
        chosen = np.flatnonzero(verify == size)
        picks = itl_off[chosen][:, None] + np.arange(size)[None, :]
        for b, q in zip(chosen.tolist(), _percentiles(itl[picks])):
            quantiles["itl"][b] = q
    out = []
    for b, (w, v, vt, km) in enumerate(zip(window.tolist(), verify.tolist(), verified_tokens.tolist(),
                                           kept_measured.tolist())):
        figures = {"window_s": w, "completion_tokens": float(tokens), "tput_tok_s": tokens / w,
                   "req_per_s": measured / w}
        if v:
            figures["accept_len"] = vt / v
            figures["accept_len_drafts"] = 1.0 + (km - v) / v
        for name in ("ttft", "itl", "e2e"):
            q = quantiles[name][b]
            if q is not None:
                figures.update({f"{name}_p{p}_ms": value for p, value in zip(PERCENTILES, q)})
        out.append(figures)
    return out


def _percentiles(matrix: np.ndarray) -> list[list[float] | None]:
    """Each row's PERCENTILES of its values in ms, as predicted_metrics takes them of one request list."""
    if matrix.shape[1] == 0:
        return [None] * matrix.shape[0]
    return np.percentile(matrix * 1000.0, PERCENTILES, axis=1).T.tolist()
