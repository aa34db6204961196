"""simulate-first's prediction of a space with more points than `search.simulate.points` (the `ngram` space has
409,860): every point, each distinct replay once, instead of a TPE sample of the predictions. Optuna's TPE reads its
whole history on every ask (~21 CPU-s per 1,000 asks by itself, docs/benchmarks.md "Predict"), so a sample of a few
thousand never finished inside the time cap; the points themselves are cheap to enumerate.

1. Enumerate the space's grid with each point's field values (`grid_points`' recursion, which is `resolve`'s: the
   values a point resolves to are the ones the recursion carries), and check validity per distinct spec and per
   distinct trial part (a TrialConfig has no check across the two: `resolve` fails exactly when one of them does).
2. Group the points into replay classes: points that differ in nothing the replay reads. An NGRAM point's
   `capacity` is left out where its trie never filled (`Simulator`'s `_never_full` rule, checked on the replay), and
   with one draft token (num_draft_tokens 2) its breadths draft nothing different either.
3. Replay: NGRAM configs without a corpus at concurrency 1 in bulk (pipeline/simulate/solo.py: one compiled call per
   config for every warm-up count, on as many threads as the process has cores: the call releases the GIL), in an
   order spread over the space (where the cap stops it, what was predicted is not one corner); every other class
   through `Simulator.predict`, as before.
4. One `Predicted` per class (its first valid point in grid order, with the class's point count), ranked as usual;
   `predictions(cost)` re-prices them after a refit without replaying.

The time cap (`search.simulate.seconds`) still stops it, between configs, as a safety net.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from pydantic import ValidationError

from pipeline.config import StudyConfig, TrialConfig, validate_trial
from pipeline.errors import ConfigError
from pipeline.search.simulated import Explored, Predicted, point_key
from pipeline.search.space import SearchSpace
from pipeline.search.space.grid import _values as grid_values
from pipeline.search.space.model import TRIAL_FIELDS, FixedParam, applies
from pipeline.simulate import parallel, solo
from pipeline.simulate.cost import CostModel
from serve.ngram import compiled
from serve.spec import DRAFT_MODEL_ALGORITHMS

__all__ = ["LIMIT", "WholeSpace", "explore_whole"]

LIMIT = 5_000_000  # points enumerated at most (a few seconds a million); a larger space is sampled by TPE
BATCH = 2048  # bulk replays priced in one call (their steps copied together: a few MB)

Predict = Callable[[TrialConfig], dict[str, float]]


class _Member:
    """The first point of a class at one capacity (its params, its place in grid order) and the points there."""

    __slots__ = ("params", "order", "count")  # one per class and capacity: hundreds of thousands

    def __init__(self, params: dict[str, Any], order: int) -> None:
        self.params = params
        self.order = order
        self.count = 1


@dataclass
class _Class:
    """Points that differ at most in an NGRAM capacity, by capacity (None: not an NGRAM point)."""

    key: tuple[Any, ...]
    algorithm: str
    spec_names: tuple[str, ...]
    spec_values: tuple[Any, ...]  # its first point's (an NGRAM capacity aside, the same for all its points)
    trial: dict[str, Any]
    by_capacity: dict[Any, _Member] = field(default_factory=dict)


@dataclass
class _Row:
    """One prediction: a class (or the part of one whose capacities share a replay)."""

    params: dict[str, Any]
    config: TrialConfig
    members: int
    order: int
    covers: tuple[tuple[tuple[Any, ...], Any], ...]  # (class key, capacity) of its points
    solo: tuple[solo.SoloReplays, int] | None = None  # (its config's replays, which count) on the bulk path
    signature: str = ""


def _points(space: SearchSpace, algorithm: str) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(resolve params, field values) of every point of one branch, in grid order (`grid_points`' recursion)."""
    params = space.params_for(algorithm)

    def expand(i: int, values: dict[str, Any], point: dict[str, Any]) -> Iterator[tuple[dict[str, Any],
                                                                                       dict[str, Any]]]:
        if i == len(params):
            yield point, values
            return
        optuna_name, name, p = params[i]
        if not applies(p, values):
            yield from expand(i + 1, values, point)
            return
        fixed = isinstance(p, FixedParam)
        for value in grid_values(optuna_name, p, values):
            yield from expand(i + 1, {**values, name: value}, point if fixed else {**point, optuna_name: value})

    yield from expand(0, {}, {"algorithm": algorithm})


def _getter(at: list[int]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """A tuple of the values at these positions (operator.itemgetter, always a tuple)."""
    if not at:
        return lambda values: ()
    if len(at) == 1:
        only = at[0]
        return lambda values: (values[only],)
    return itemgetter(*at)


class _Layout:
    """Where a point's field values go, for one branch and one set of field names (a `when` condition changes the
    set): its spec part, its trial part, its class (without an NGRAM capacity on the bulk path)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        spec_at = [i for i, n in enumerate(names) if n not in TRIAL_FIELDS]
        trial_at = [i for i, n in enumerate(names) if n in TRIAL_FIELDS]
        self.spec_names = tuple(names[i] for i in spec_at)
        self.trial_names = tuple(names[i] for i in trial_at)
        self.spec = _getter(spec_at)
        self.trial = _getter(trial_at)
        self.capacity_at = names.index("capacity") if "capacity" in names else None
        self.corpus_at = names.index("external_corpus") if "external_corpus" in names else None
        self.without_capacity = _getter([i for i in range(len(names)) if i != self.capacity_at])


class _Checks:
    """`resolve`'s validity, remembered per distinct spec and per distinct trial part (a TrialConfig has no check
    across the two, so `resolve` fails exactly when one of them does)."""

    def __init__(self, study: StudyConfig) -> None:
        self.study = study
        self.concurrency = study.concurrency[0]
        self.specs: dict[tuple[Any, ...], TrialConfig | None] = {}
        self.trials: dict[tuple[Any, ...], bool] = {}

    def spec(self, algorithm: str, names: tuple[str, ...], values: tuple[Any, ...]) -> TrialConfig | None:
        key = (algorithm, names, values)
        found = self.specs.get(key, False)
        if found is False:
            spec = {"algorithm": algorithm, **dict(zip(names, values))}
            if algorithm in DRAFT_MODEL_ALGORITHMS and not spec.get("draft_model"):
                spec["draft_model"] = self.study.model.drafts.get(algorithm)
            try:
                found = TrialConfig.model_validate({"concurrency": self.concurrency, "spec": spec})
            except ValidationError:
                found = None
            if found is not None and validate_trial(found, self.study.engine.kind):
                found = None
            self.specs[key] = found
        return found  # type: ignore[return-value]

    def trial(self, names: tuple[str, ...], values: tuple[Any, ...]) -> bool:
        key = (names, values)
        found = self.trials.get(key)
        if found is None:
            try:
                TrialConfig.model_validate({**dict(zip(names, values)), "concurrency": self.concurrency})
                found = True
            except ValidationError:
                found = False
            self.trials[key] = found
        return found


def _never_full(nodes: int, depth: int, capacity: int) -> bool:
    """pipeline.simulate.simulator._never_full on a node count: a trie that ended with these nodes never evicted."""
    return 0 <= nodes and nodes + depth < capacity - 1


class WholeSpace:
    """Every valid point of a finite space in replay classes, replayed, and priced under any cost model."""

    def __init__(self, space: SearchSpace, study: StudyConfig, simulator: Any, predict: Predict) -> None:
        self.study = study
        self.simulator = simulator
        self.predict = predict
        self.checks = _Checks(study)
        self.classes: dict[tuple[Any, ...], _Class] = {}
        self.points = 0  # valid points
        self.invalid = 0
        order = 0
        self.bulk_ok = study.concurrency[0] == 1 and compiled.available() and not simulator.open_loop
        self._layouts: dict[tuple[str, ...], _Layout] = {}
        for algorithm in (a for a in space.algorithms if a != "none"):
            for params, values in _points(space, algorithm):
                order += 1
                if order > LIMIT:
                    raise ConfigError(f"search space {space.name!r} has more than {LIMIT} points")
                found = self._classify(algorithm, values)
                if found is None:
                    self.invalid += 1
                    continue
                self.points += 1
                key, capacity, layout, spec_values, trial_values = found
                cls = self.classes.get(key)
                if cls is None:
                    cls = self.classes[key] = _Class(key, algorithm, layout.spec_names, spec_values,
                                                     dict(zip(layout.trial_names, trial_values)))
                member = cls.by_capacity.get(capacity)
                if member is None:
                    cls.by_capacity[capacity] = _Member(params, order)
                else:
                    member.count += 1
        self.rows: list[_Row] = []
        self.traffic: solo.Traffic | None = None
        self.complete = True

    def _classify(self, algorithm: str, values: dict[str, Any]
                  ) -> tuple[tuple[Any, ...], Any, _Layout, tuple[Any, ...], tuple[Any, ...]] | None:
        """(the point's class, its capacity where the class leaves it out, its layout, its spec and trial values);
        None for an invalid point. An NGRAM point on the bulk path is classed without its capacity (the replay says
        whether the capacities share it). Per point of a space of hundreds of thousands: tuples, no dicts."""
        names = tuple(values)
        layout = self._layouts.get(names)
        if layout is None:
            layout = self._layouts[names] = _Layout(names)
        flat = tuple(values.values())
        spec_values = layout.spec(flat)
        config = self.checks.spec(algorithm, layout.spec_names, spec_values)
        trial_values = layout.trial(flat)
        if config is None or not self.checks.trial(layout.trial_names, trial_values):
            return None
        bulk = (self.bulk_ok and algorithm == "ngram"
                and (layout.corpus_at is None or flat[layout.corpus_at] is None))
        if not bulk:
            return (algorithm, False, names, flat), None, layout, spec_values, trial_values
        at = layout.capacity_at
        capacity = flat[at] if at is not None else config.spec.capacity  # type: ignore[union-attr]
        return (algorithm, True, names, layout.without_capacity(flat)), capacity, layout, spec_values, trial_values

    def row_of(self, algorithm: str, values: dict[str, Any]) -> int | None:
        """The row (index into `rows` and `predictions`) predicting the point with these field values."""
        found = self._classify(algorithm, values)
        if found is None:
            return None
        if not hasattr(self, "_index"):
            self._index = {cover: i for i, row in enumerate(self.rows) for cover in row.covers}
        return self._index.get((found[0], found[1]))

    def _config(self, cls: _Class, member: _Member) -> TrialConfig:
        """The member's TrialConfig: its spec as checked, its trial part (checked too) set on it."""
        values = cls.spec_values
        if None not in cls.by_capacity and "capacity" in cls.spec_names:  # a bulk class: this member's capacity
            at = cls.spec_names.index("capacity")
            capacity = member.params.get(f"{cls.algorithm}.capacity", values[at])
            values = (*values[:at], capacity, *values[at + 1:])
        config = self.checks.spec(cls.algorithm, cls.spec_names, values)
        assert config is not None
        return config.model_copy(update=cls.trial)

    def replay(self, deadline: float) -> None:
        """Replay every class (bulk where it applies), stopping at `deadline` (time.monotonic())."""
        bulk: dict[tuple[Any, ...], list[_Class]] = {}
        generic: list[_Class] = []
        for key, cls in self.classes.items():
            if key[1]:
                # one config at its warm-up counts: the class without its warm-up count
                fields = dict(zip((n for n in key[2] if n != "capacity"), key[3]))
                ignored = {"warmup_requests"}
                if fields.get("num_draft_tokens") == 2:
                    # one draft node: the longest match's most recent child (BFS) or its most frequent one (PROB,
                    # the first of its offers whatever their number), at any breadth: one replay for them all
                    ignored |= {"min_bfs_breadth", "max_bfs_breadth"}
                group = (key[2], tuple((n, v) for n, v in fields.items() if n not in ignored))
                bulk.setdefault(group, []).append(cls)
            else:
                generic.extend([cls])
        if bulk:
            top = max(c.trial.get("warmup_requests", 0) for group in bulk.values() for c in group)
            try:
                self.traffic = solo.solo_traffic(self.simulator, top if self.simulator.warmup else 0)
            except ValueError:  # a missing answer (Unsimulable): each config says so through `predict`
                self.traffic = None
            if self.traffic is None:
                generic.extend(c for group in bulk.values() for c in group)
                bulk = {}
        groups = list(bulk.values())
        # a fixed stride through the groups (not grid order, small draft lengths first): where the time cap stops the
        # replay, the configs predicted are spread over the whole space
        stride = next(k for k in (7919, 104729, 1299709) if len(groups) % k) if groups else 1
        groups = [groups[(i * stride) % len(groups)] for i in range(len(groups))]
        with ThreadPoolExecutor(max(1, min(parallel.usable_cores(), len(groups)))) as pool:
            for rows in pool.map(lambda g: self._replay_group(g, deadline), groups):
                if rows is None:
                    self.complete = False
                    continue
                self.rows.extend(rows)
        for cls in generic:
            if time.monotonic() > deadline:
                self.complete = False
                break
            for cap, member in cls.by_capacity.items():
                self.rows.append(_Row(member.params, self._config(cls, member), member.count, member.order,
                                      ((cls.key, cap),)))

    def _replay_group(self, group: list[_Class], deadline: float) -> list[_Row] | None:
        """The classes of one NGRAM config at its warm-up counts: one bulk replay (more where a capacity filled)."""
        if time.monotonic() > deadline:
            return None
        traffic = self.traffic
        assert traffic is not None
        warm = bool(self.simulator.warmup)

        def count_of(cls: _Class) -> int:
            return int(cls.trial.get("warmup_requests", 0)) if warm else 0

        counts = sorted({count_of(c) for c in group})
        first = group[0]
        spec = self._config(first, next(iter(first.by_capacity.values()))).spec
        depth = spec.max_trie_depth  # type: ignore[union-attr]
        replays: dict[int, solo.SoloReplays] = {}
        rows = []
        for cls in group:
            i = counts.index(count_of(cls))
            # each capacity shares a replay at another capacity where that trie never came near either cap (the
            # simulator's `_never_full` rule), else gets its own (smallest first: a small trie fills first)
            sources: dict[int, list[tuple[int, _Member]]] = {}
            for cap in sorted(cls.by_capacity):
                source = next((k for k, r in replays.items() if _never_full(int(r.nodes[i]), depth, min(k, cap))),
                              None)
                if source is None:
                    source = cap
                    replays[cap] = solo.replay_counts(spec, cap, traffic, counts)
                sources.setdefault(source, []).append((cap, cls.by_capacity[cap]))
            for source, shared in sources.items():
                rep = min((m for _, m in shared), key=lambda m: m.order)
                rows.append(_Row(rep.params, self._config(cls, rep), sum(m.count for _, m in shared), rep.order,
                                 tuple((cls.key, cap) for cap, _ in shared), (replays[source], i)))
        return rows

    def predictions(self, cost: CostModel, deadline: float | None = None) -> list[Predicted]:
        """Every row's figures under `cost`, in row order: bulk rows priced from their replays (in batches of one
        warm-up count), the others by `predict` (replayed there the first time) until `deadline`: the rows it
        leaves unpredicted are dropped, and the space is not complete."""
        step_cost = solo.StepCost(cost)
        traffic = self.traffic
        figures: list[dict[str, float] | None] = [None] * len(self.rows)
        by_count: dict[int, list[int]] = {}
        late: list[int] = []
        for n, row in enumerate(self.rows):
            if row.solo is not None and traffic is not None:
                by_count.setdefault(row.solo[0].counts[row.solo[1]], []).append(n)
            elif deadline is not None and time.monotonic() > deadline:
                late.append(n)
            else:
                figures[n] = self.predict(row.config)
        for count, chosen in by_count.items():
            assert traffic is not None
            prefills = solo.uncached_prefills(traffic, count, self.simulator.prefix)
            for start in range(0, len(chosen), BATCH):
                batch = chosen[start:start + BATCH]
                items = []
                for n in batch:
                    replays, i = self.rows[n].solo  # type: ignore[misc]
                    width = self.rows[n].config.spec.num_draft_tokens or 1  # type: ignore[union-attr]
                    items.append((replays, i, width))
                for n, priced in zip(batch, solo.price_rows(traffic, count, items, prefills, step_cost)):
                    figures[n] = priced
        for n, row in enumerate(self.rows):
            if row.solo is not None and not row.signature:
                width = row.config.spec.num_draft_tokens or 1  # type: ignore[union-attr]
                row.signature = row.solo[0].signature(row.solo[1], width)
        if late:  # past the time cap: those classes are not predicted (nor counted)
            self.complete = False
            dropped = set(late)
            self.rows = [row for n, row in enumerate(self.rows) if n not in dropped]
            figures = [f for n, f in enumerate(figures) if n not in dropped]
            self.__dict__.pop("_index", None)
        return [Predicted(row.params, row.config, f or {}) for row, f in zip(self.rows, figures)]

    def signatures(self) -> dict[str, str]:
        """Point key -> replay signature of every row (the first representative of each): a bulk row's from its
        steps (set when it was first priced), any other's the simulator's (`Simulator.signature`)."""
        out = {}
        for row in self.rows:
            signature = row.signature
            if not signature:
                try:
                    signature = self.simulator.signature(row.config)
                except (ValueError, OSError):  # unsimulable (Unsimulable is a ValueError): its own class
                    continue
            out[point_key(row.params)] = signature
        return out


def explore_whole(space: SearchSpace, study: StudyConfig, simulator: Any, cost: CostModel, predict: Predict,
                  started: float, seconds: float) -> Explored:
    """Every point of `space` predicted (one `Predicted` per replay class), stopped at `seconds` after `started`
    (time.monotonic()). ConfigError where the space has no finite grid or more than LIMIT points."""
    whole = WholeSpace(space, study, simulator, predict)
    whole.replay(started + seconds)
    predicted = whole.predictions(cost, started + seconds)
    complete = whole.complete and time.monotonic() - started <= seconds
    return Explored(predicted, sum(r.members for r in whole.rows), time.monotonic() - started,
                    "every point, by replay class", complete, whole=whole)
