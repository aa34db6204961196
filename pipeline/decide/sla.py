"""SLA limits (`objective.constraints`): verdicts over measured figures, and Optuna's `constraints_func`. Pure.

A limit holds at one concurrency level (or at every level). During the search trials are measured at the search
level only (`StudyConfig.search_concurrency`), so the search can check only the limits that hold there; the others
are checked when finalists are re-measured at every level (`pipeline.decide.levels.decide_levels`).

Optuna's contract: `constraints_func(frozen_trial)` returns one float per limit, <= 0 meaning satisfied. The trial
must store each figure as a user attribute named `constraint_attr(limit)` (see `constraint_user_attrs`); a figure
the trial did not measure (None, missing) counts as broken, since an unmeasured latency cannot be shown to be
within its limit.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline.config import SlaConstraint
from pipeline.vocabulary.row import TrialRow

# Positive and finite: Optuna rejects NaN, and a huge finite value keeps TPE's feasibility arithmetic sane.
UNMEASURED_VIOLATION = 1e9


class Verdict(BaseModel):
    """One limit checked at one level: the figure (None = not measured), the limit, and whether it holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    metric: str
    concurrency: int
    figure_ms: float | None
    max_ms: float
    ok: bool

    @property
    def text(self) -> str:
        figure = "not measured" if self.figure_ms is None else f"{self.figure_ms:.1f} ms"
        relation = "<=" if self.ok else ">"
        if self.figure_ms is None:
            return f"{self.metric} at concurrency {self.concurrency}: {figure} (limit {self.max_ms:g} ms)"
        return f"{self.metric} at concurrency {self.concurrency}: {figure} {relation} limit {self.max_ms:g} ms"


def limits_at(constraints: Sequence[SlaConstraint], level: int) -> list[SlaConstraint]:
    """The limits that hold at `level` (those naming it, and those with no level)."""
    return [c for c in constraints if c.concurrency in (None, level)]


def median_figure(values: Sequence[float | None]) -> float | None:
    """Median over re-measured runs of one figure, ignoring runs that did not measure it; None when none did."""
    present = [float(v) for v in values if v is not None]
    return statistics.median(present) if present else None


def check(constraints: Sequence[SlaConstraint], level: int, figures: Mapping[str, float | None]) -> list[Verdict]:
    """Verdicts of every limit holding at `level`, given `figures` (metric name -> ms, None = not measured)."""
    verdicts = []
    for limit in limits_at(constraints, level):
        figure = figures.get(limit.metric)
        verdicts.append(Verdict(metric=limit.metric, concurrency=level, figure_ms=figure, max_ms=limit.max_ms,
                                ok=figure is not None and figure <= limit.max_ms))
    return verdicts


def broken(verdicts: Sequence[Verdict]) -> str | None:
    """A reason naming every broken limit with its figure and the limit; None when all hold."""
    bad = [v.text for v in verdicts if not v.ok]
    return ("breaks SLA limit(s): " + "; ".join(bad)) if bad else None


def constraint_attr(limit: SlaConstraint) -> str:
    """The Optuna user attribute a trial sets to this limit's measured figure (ms, or None)."""
    where = "any" if limit.concurrency is None else str(limit.concurrency)
    return f"sla.{limit.metric}@{where}"


def constraint_user_attrs(constraints: Sequence[SlaConstraint], search_level: int,
                          metrics: Mapping[str, Any] | None) -> dict[str, float | None]:
    """What a search trial stores as user attributes: for each limit checkable at `search_level`, the trial's figure
    from its summary metrics (`Summary.to_metrics()` or the result dict; None when the trial measured none)."""
    metrics = metrics or {}
    out: dict[str, float | None] = {}
    for limit in limits_at(constraints, search_level):
        value = metrics.get(limit.metric)
        out[constraint_attr(limit)] = float(value) if isinstance(value, (int, float)) else None
    return out


class SlaConstraintsFunc:
    """Optuna's `constraints_func` over `limits`: figure - limit per limit (<= 0 holds). A class, not a closure: Ray
    Tune checkpoints the searcher (and with it the sampler holding this) by pickling it."""

    def __init__(self, limits: Sequence[SlaConstraint]) -> None:
        self.limits = tuple(limits)

    def __call__(self, trial: Any) -> tuple[float, ...]:
        attrs = trial.user_attrs
        values = []
        for limit in self.limits:
            figure = attrs.get(constraint_attr(limit))
            values.append(UNMEASURED_VIOLATION if not isinstance(figure, (int, float))
                          else float(figure) - limit.max_ms)
        return tuple(values)


def constraints_func(constraints: Sequence[SlaConstraint], search_level: int
                     ) -> Callable[[Any], Sequence[float]] | None:
    """Optuna `constraints_func` over the limits checkable at `search_level` (`SlaConstraintsFunc`); None when no
    limit holds at that level (the sampler then runs unconstrained)."""
    limits = limits_at(constraints, search_level)
    return SlaConstraintsFunc(limits) if limits else None


def row_verdicts(row: TrialRow, constraints: Sequence[SlaConstraint], level: int) -> list[Verdict]:
    """Verdicts for one trial row (a search trial measured at `level`)."""
    return check(constraints, level, {c.metric: row.metric(c.metric) for c in limits_at(constraints, level)})
