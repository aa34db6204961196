"""The simulator of one study: the baseline's answers, the study's traffic and the cost model, turned into
predicted figures for any simulable TrialConfig, and each measured launch into a point for the cost fit.

With an engine's prefix cache (`prefix`, pipeline.simulate.prefix: SGLang's radix cache) every prefill, measured
and predicted, counts the prompt tokens the cache did not hold: the prefill line is fitted to the launches' TTFTs
against their uncached tokens, and a config's replay charges its own.

Replays are memoized per config (a closed-loop replay does not depend on the cost model, so a refit re-times the
cached rounds instead of replaying), and NGRAM configs that differ only in a capacity their trie never came near
share one replay (nothing was evicted: `_never_full`). Pure apart from reading corpus files through `corpora`.
"""

from __future__ import annotations

import hashlib
import marshal
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipeline.measure.summary import RequestRecord
from pipeline.simulate import parallel
from pipeline.simulate.chains import chain_drafter
from pipeline.simulate.cost import CostModel, Launch, fit_cost, prefill_fit, round_table
from pipeline.simulate.drafts import DraftTables
from pipeline.simulate.predict import decode_rounds, predicted_metrics, timed
from pipeline.simulate.prefix import PrefixCache, uncached_tokens
from pipeline.simulate.replay import Answer, Replay, Round, replay
from pipeline.simulate.workload import phases_for
from serve.ngram import compiled
from serve.ngram.sam import SuffixAutomaton
from serve.spec import NgramSpec, StandaloneSpec

__all__ = ["Simulator", "base_cost", "relative_error"]

Corpora = Callable[[Any], Sequence[SuffixAutomaton]]  # TrialConfig -> the corpora its engine would load


def base_cost(baseline: Sequence[RequestRecord], verify_cost: Any, concurrency: int, *,
              prefix: PrefixCache | None = None, flushed_after_warmup: bool = False) -> CostModel:
    """The cost model before any fit: the engine's measured round table (else the prior shape), the prefill from the
    baseline's TTFTs against the tokens each prefill computed (all of the prompt's without a prefix cache, else
    those it did not hold: pipeline.simulate.prefix.uncached_tokens) and the client gap from its window
    (measured requests only)."""
    measured = [r for r in baseline if r.phase == "measure" and r.ok]
    if not measured:
        raise ValueError("simulate: the baseline has no successful measured request")
    tokens = uncached_tokens(baseline, prefix, flushed_after_warmup=flushed_after_warmup)
    p0, p1 = prefill_fit(tokens, [r.ttft_s or 0.0 for r in measured])
    window = max(r.start_s + r.e2e_s for r in measured) - min(r.start_s for r in measured)
    clients = min(concurrency, len(measured))
    spare = clients * window - sum(r.e2e_s for r in measured)
    gap = max(0.0, spare / (len(measured) - clients)) if len(measured) > clients else 0.0
    table = round_table(verify_cost)
    return CostModel(shape="measured" if table is not None else "prior", table=table, k=1.0, p0_ms=p0, p1_ms=p1,
                     gap_s=gap)


class Simulator:
    """`answers`: prompt index -> the baseline's Answer; `warmup`/`measure`: the study's LoadRequests in order;
    `arrival`: the study's workload.arrival; `corpora`: the external corpora of a config (None: no corpus); `lag`:
    closed-loop rounds between a reply and its successor joining the engine's batch; `drafts`: draft model -> its
    draft replay (pipeline.search.draft_replay), for STANDALONE configs; `prefix`: the engine's prefix cache
    (pipeline.simulate.prefix.prefix_cache_of its `/server_info`; None: it has none)."""

    def __init__(self, answers: dict[int, Answer], warmup: Sequence[Any], measure: Sequence[Any], *,
                 arrival: Any = None, seed: int = 0, corpora: Corpora | None = None, lag: int = 0,
                 drafts: Mapping[str, DraftTables] | None = None, prefix: PrefixCache | None = None) -> None:
        self.answers = answers
        self.warmup = tuple(warmup)
        self.measure = tuple(measure)
        self.arrival = arrival
        self.seed = seed
        self.corpora = corpora
        self.lag = lag
        self.drafts = dict(drafts or {})
        self.prefix = prefix
        self._replays: dict[str, Replay] = {}
        self._signatures: dict[str, str] = {}  # config -> its replay's signature
        # an NGRAM config without its capacity -> (capacity, replay) of the configs replayed: a trie that never
        # filled up evicted nothing, so any capacity it never came near replays the same (`_never_full`)
        self._families: dict[str, list[tuple[int, Replay]]] = {}
        self._signed: dict[int, str] = {}  # id of a held replay -> its signature (replays shared across configs)
        # Pricing memo, valid for one cost model (`_cost`): a refit changes the cost, never a closed-loop replay, so
        # re-predicting a space re-times each distinct replay once (configs whose replays are identical -- same
        # rounds, same requests in them -- are one config to the cost model and get one prediction).
        self._cost: CostModel | None = None
        self._priced: dict[str, dict[str, float]] = {}
        self._seconds: Callable[[Round], float] | None = None

    @property
    def flushed_after_warmup(self) -> bool:
        """Whether a launch's engine was flushed between its warm-up and its measurement: only without a warm-up
        split, where the baseline settles on the measured prompts and flushes them (engine_pass.settle_requests)."""
        return not self.warmup

    @property
    def open_loop(self) -> bool:
        return self.arrival is not None and self.arrival.open_loop

    def _sams(self, trial: Any) -> Sequence[SuffixAutomaton]:
        spec = trial.spec
        if not isinstance(spec, NgramSpec) or spec.external_corpus is None or self.corpora is None:
            return ()
        return self.corpora(trial)

    def replay(self, trial: Any, cost: CostModel | None = None) -> Replay:
        """The trial's traffic replayed (with `cost` for open-loop arrivals, which need one)."""
        key = trial.model_dump_json()
        if cost is None and key in self._replays:
            return self._replays[key]
        closed = cost is None or not self.open_loop
        family = _capacity_family(trial) if closed else None
        if family is not None:  # a replay of the same config at another capacity that its trie never came near
            for capacity, known in self._families.get(family, ()):
                if _never_full(known, trial.spec.max_trie_depth, min(capacity, trial.spec.capacity)):
                    self._replays[key] = known
                    return known
        phases = phases_for(trial, self.warmup, self.measure, self.answers, arrival=self.arrival, seed=self.seed,
                            lag=self.lag)
        spec = trial.spec
        tables = self.drafts.get(spec.draft_model or "") if isinstance(spec, StandaloneSpec) else None
        result = replay(spec, phases, sams=self._sams(trial), max_running=trial.max_running_requests,
                        cost=cost.seconds if cost is not None and self.open_loop else None, drafts=tables,
                        prefix=self.prefix)
        if closed:
            self._replays[key] = result
        if family is not None:
            self._families.setdefault(family, []).append((spec.capacity, result))
        return result

    def prepare(self, trials: Sequence[Any], *, deadline: float | None = None, workers: int | None = None,
                spread_ngram: bool | None = None) -> int:
        """Replay `trials` ahead of pricing them, in worker processes when there are enough of them and more than
        one core (pipeline.simulate.parallel); returns how many were replayed there. Only closed-loop replays (an
        open-loop one depends on the cost) of configs that load no external corpus (read by the caller's
        `corpora`) are spread, and NGRAM configs only on the Python trie: with the compiled one
        (serve.ngram.compiled) a worker's start and the replays' way back cost more than the replays (docs/benchmarks.md
        "Predict"; `spread_ngram` True spreads them anyway, for that benchmark); the rest replay on demand. Nor are
        chain-drafted configs (pipeline.simulate.chains): vLLM's 160-point ngram space replayed in 0.4 s here and in
        5.0 s through two workers (their starts), on the 2-core box."""
        if self.open_loop:
            return 0
        workers = parallel.usable_cores() if workers is None else workers
        here = compiled.available() if spread_ngram is None else not spread_ngram
        todo, seen = [], set(self._signatures)
        for trial in trials:
            key = trial.model_dump_json()
            spec = trial.spec
            if key in seen or (isinstance(spec, NgramSpec) and (here or spec.external_corpus is not None)) \
                    or chain_drafter(spec) is not None:
                continue
            seen.add(key)
            todo.append(trial)
        if workers < 2 or len(todo) < parallel.MIN_PARALLEL:
            return 0
        parts = {"answers": self.answers, "warmup": self.warmup, "measure": self.measure, "arrival": self.arrival,
                 "seed": self.seed, "lag": self.lag, "drafts": self.drafts, "prefix": self.prefix}
        done = parallel.replay_in_workers(Simulator, parts, todo, workers=min(workers, len(todo)), deadline=deadline)
        for key, result, signature in done:
            self._replays[key] = result
            self._signatures[key] = signature
        return len(done)

    def signature(self, trial: Any) -> str:
        """What the cost model sees of the trial's closed-loop replay: its rounds and which requests ran in them.
        Two configs with one signature have the same predicted figures under every cost model."""
        key = trial.model_dump_json()
        found = self._signatures.get(key)
        if found is None:
            result = self.replay(trial)
            found = self._signed.get(id(result))
            if found is not None and key in self._replays:  # held, so its id is not reused
                self._signatures[key] = found
                return found
            # rounds as plain tuples: a dataclass repr is most of a signature's time
            rounds = [(r.prefills, r.width, r.trees, r.contexts, r.start_s, r.end_s, r.drafts) for r in result.rounds]
            shape = (rounds, [(r.phase.encode(), r.admitted_round, r.finished_round, r.after_round, r.completion_tokens,
                                      r.spec_verify_ct, r.spec_num_correct_drafts) for r in result.requests],
                     trial.spec.algorithm != "none")
            # marshal's version 2 writes values only (no back-references to shared objects, and bytes, not
            # strings, which it would mark interned or not): equal shapes, equal bytes; several times repr's speed
            found = self._signatures[key] = hashlib.blake2b(marshal.dumps(shape, 2), digest_size=16).hexdigest()
            if key in self._replays:
                self._signed[id(result)] = found
        return found

    def predict(self, trial: Any, cost: CostModel) -> dict[str, float]:
        """Predicted Summary figures of the trial's measurement."""
        if self.open_loop:
            requests = timed(self.replay(trial, cost), cost, already_timed=True)
            return predicted_metrics(requests, trial.spec.algorithm != "none")
        if cost is not self._cost or self._seconds is None:
            self._cost, self._priced, self._seconds = cost, {}, memoized(cost.seconds)
        signature = self.signature(trial)
        figures = self._priced.get(signature)
        if figures is None:
            requests = timed(self.replay(trial), cost, seconds=self._seconds)
            figures = self._priced[signature] = predicted_metrics(requests, trial.spec.algorithm != "none")
        return dict(figures)

    def launch(self, trial: Any, records: Sequence[RequestRecord], cost: CostModel | None = None) -> Launch:
        """A measured launch as a point of the cost fit: its measured requests' decode time against the rounds the
        replay gives each of them (the records are the trial's, in the measurement's order). Open loop: the rounds
        depend on the cost, so `cost` is the model they are replayed with."""
        measured = [r for r in records if r.phase == "measure"]
        rounds = decode_rounds(self.replay(trial, cost if self.open_loop else None))
        if len(measured) != len(rounds) or any(not r.ok or r.ttft_s is None for r in measured):
            raise ValueError("simulate: the launch's measured requests do not match its replay (a failed or "
                             "missing request)")
        return Launch(sum((r.e2e_s - (r.ttft_s or 0.0)) * 1000.0 for r in measured), rounds)

    def fitted(self, base: CostModel, launched: Sequence[tuple[Any, Sequence[RequestRecord]]]) -> CostModel:
        """`base` fitted to every launch that can be a point (a launch that lost a request cannot): the prefill line
        to every launch's TTFTs (a prefill does not depend on the config, so each launch is more of the same sample;
        the first launch of a study runs beside its start-up work and is slow), then k and o. Open loop: who shares a
        round depends on the cost, so the fit is repeated on the rounds its own result gives (3 times)."""
        xs: list[int] = []
        ys: list[float] = []
        for _, records in launched:  # each launch's prefills against what its own engine had cached
            measured = [r for r in records if r.phase == "measure" and r.ok]
            tokens = uncached_tokens(records, self.prefix, flushed_after_warmup=self.flushed_after_warmup)
            for r, n in zip(measured, tokens):
                if r.ttft_s:
                    xs.append(n)
                    ys.append(r.ttft_s)
        if xs:
            p0, p1 = prefill_fit(xs, ys)
            base = base.model_copy(update={"p0_ms": p0, "p1_ms": p1})
        model = base
        for _ in range(3 if self.open_loop else 1):
            points = []
            for trial, records in launched:
                try:
                    points.append(self.launch(trial, records, model))
                except ValueError:
                    continue
            if not points:
                return base
            model = fit_cost(base, points)
        return model


def _capacity_family(trial: Any) -> str | None:
    """An NGRAM config's key with its capacity left out (None for any other config)."""
    spec = trial.spec
    if not isinstance(spec, NgramSpec):
        return None
    return trial.model_copy(update={"spec": spec.model_copy(update={"capacity": 0})}).model_dump_json()


def _never_full(result: Replay, depth: int, capacity: int) -> bool:
    """Whether a trie of `capacity` nodes replaying `result`'s inserts never had to evict. An eviction leaves at least
    capacity - 1 - depth nodes behind it (it frees room for one suffix of at most `depth` tokens, and the trie only
    shrinks by evicting), so a replay whose trie ended with fewer never evicted, and no insert of it came within a
    suffix of the cap: every capacity above that replays it decision for decision (serve/ngram/trie.py)."""
    return 0 <= result.trie_nodes and result.trie_nodes + depth < capacity - 1


def memoized(seconds: Callable[[Round], float]) -> Callable[[Round], float]:
    """`seconds` remembered per round (rounds repeat across the configs of a space)."""
    memo: dict[Round, float] = {}

    def cached(r: Round) -> float:
        value = memo.get(r)
        if value is None:
            value = memo[r] = seconds(r)
        return value

    return cached


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """|predicted - measured| / measured, None when either is missing or measured is 0."""
    if predicted is None or measured is None or measured == 0:
        return None
    return abs(predicted - measured) / abs(measured)

