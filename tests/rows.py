"""Trial rows as a study's tables, plots and decision read them (`TrialRow`), built for tests without MLflow."""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.vocabulary.outcome import Outcome
from pipeline.vocabulary.row import TrialRow


def trial_row(name: str, algorithm: str = "ngram", outcome: Outcome | None = Outcome.COMPLETE, *, reason: str = "",
              params: Mapping[str, str] | None = None, vs_baseline: float | None = None,
              sla: tuple[str, ...] | None = None, feasible: bool | None = None,
              **figures: float | None) -> TrialRow:
    """A row named `name`; `figures` are its run's metrics (None: not measured, left out as MLflow leaves it)."""
    return TrialRow(run_id=f"id-{name}", name=name, trial_id=None, outcome=outcome, reason=reason,
                    algorithm=algorithm, params=dict(params or {}),
                    figures={k: float(v) for k, v in figures.items() if v is not None}, vs_baseline=vs_baseline,
                    sla=sla, feasible=feasible)
