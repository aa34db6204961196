"""Several objectives: the Pareto front over trial rows, finalists from it, and the objective of the final pick.
Pure, over the study's trial rows (`pipeline.vocabulary.row.TrialRow`: name, outcome, figures, `feasible`).

`pareto_front` follows Optuna's `study.best_trials`: COMPLETE trials only, feasible ones only when SLA limits were
checked (a row with `feasible` False is out), and a trial is on the front unless another one is at least as good in
every objective and strictly better in one (equal points are all kept).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from pipeline.vocabulary.row import TrialRow

PICK_METRIC = "tput_tok_s"


class FinalistChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    names: tuple[str, ...]
    front: tuple[str, ...]
    pick_metric: str
    explanation: str


def _signs(metrics: Sequence[str], modes: Sequence[str]) -> list[float]:
    if len(metrics) != len(modes) or not metrics:
        raise ValueError(f"metrics and modes must be non-empty and of the same length, got {metrics} and {modes}")
    bad = [m for m in modes if m not in ("max", "min")]
    if bad:
        raise ValueError(f"modes must be 'max' or 'min', got {bad}")
    return [1.0 if m == "max" else -1.0 for m in modes]


def eligible(rows: Sequence[TrialRow], metrics: Sequence[str]) -> list[TrialRow]:
    """COMPLETE, feasible rows that have every objective value."""
    return [r for r in rows if r.complete and r.feasible is not False and all(r.metric(m) is not None for m in metrics)]


def dominates(a: TrialRow, b: TrialRow, metrics: Sequence[str], signs: Sequence[float]) -> bool:
    """Over eligible rows (every objective value present)."""
    pairs = [(a.figures[m] * s, b.figures[m] * s) for m, s in zip(metrics, signs)]
    return all(x >= y for x, y in pairs) and any(x > y for x, y in pairs)


def pareto_front(rows: Sequence[TrialRow], metrics: Sequence[str], modes: Sequence[str]) -> list[TrialRow]:
    """Non-dominated eligible rows, in input order (module docstring)."""
    signs = _signs(metrics, modes)
    pool = eligible(rows, metrics)
    return [r for r in pool if not any(dominates(o, r, metrics, signs) for o in pool if o is not r)]


def choose_finalists(rows: Sequence[TrialRow], metrics: Sequence[str], modes: Sequence[str], count: int,
                     exclude: Sequence[str] = ()) -> FinalistChoice:
    """Up to `count` finalists (by row `name`, `exclude` left out, e.g. the baseline). One objective: the best by
    it. Several: the Pareto front, ordered by the first objective (the study file lists the most important first),
    so `count` smaller than the front keeps its best by that objective. The final pick among the re-measured
    finalists is always by throughput (PICK_METRIC): the promotion rule's noise-penalised score is defined on
    repeated throughput runs; latency goals belong in `objective.constraints`, which refuse a finalist outright."""
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    signs = _signs(metrics, modes)
    skip = set(exclude)
    if len(metrics) == 1:
        pool = [r for r in eligible(rows, metrics) if r.name not in skip]
        front_names: tuple[str, ...] = ()
        how = f"the {count} best trial(s) by {metrics[0]} ({modes[0]})"
    else:
        pool = [r for r in pareto_front(rows, metrics, modes) if r.name not in skip]
        front_names = tuple(r.name for r in pool)
        how = (f"the Pareto front of {list(metrics)} ({len(pool)} trial(s): {list(front_names)}), "
               f"ordered by the first objective {metrics[0]} ({modes[0]})")
    ordered = sorted(pool, key=lambda r: (-r.figures[metrics[0]] * signs[0], r.name))
    names = tuple(r.name for r in ordered[:count])
    why = (f"finalists: {list(names)}, from {how}; the final pick uses {PICK_METRIC} because the promotion rule "
           "scores repeated throughput runs against the baseline's noise (median - 1.4826 x MAD)")
    if PICK_METRIC not in metrics:
        why += (f"; {PICK_METRIC} is not an objective of this study: the objectives chose the finalists, speed "
                "picks among them")
    return FinalistChoice(names=names, front=front_names, pick_metric=PICK_METRIC, explanation=why)
