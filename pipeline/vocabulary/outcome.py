"""How a trial ended, and what each ending means. Stored by its value: the MLflow tag `outcome`, the key `outcome` of
Tune's reports and the Optuna user attribute `outcome` hold `Outcome.X.value`; read back with `Outcome.read`.

Two kinds of ending: a verdict on the config (COMPLETE, INVALID, NOT_EQUIVALENT, PRUNED), which a retry would give
again, and a failure of the machine (LAUNCH_FAILED, UNHEALTHY, TIMEOUT), which says nothing about the config.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["MEASURING", "NO_REPORT", "Ending", "Outcome", "TrialFailure"]

# The `outcome` of an intermediate Tune report (early stopping reports after each measured chunk): the trial is still
# measuring. Never an ending: a trial whose last report says it ended without its final report (a FAIL to Optuna).
MEASURING = "MEASURING"
# What a record shows as the outcome of a trial that ended without any report (its function raised): Tune's word for
# that trial, never an `Outcome` (`Outcome.read` gives None).
NO_REPORT = "FAILED"


class Outcome(str, enum.Enum):
    COMPLETE = "COMPLETE"  # measured; equivalent to the baseline's outputs where they were compared
    INVALID = "INVALID"  # refused: by the config's rules, by the engine, or the engine changed what it means
    LAUNCH_FAILED = "LAUNCH_FAILED"  # the engine did not start, or no node can host it
    UNHEALTHY = "UNHEALTHY"  # the engine failed while measuring (a lost request, an HTTP error)
    TIMEOUT = "TIMEOUT"  # the engine did not get ready in time, or every lost request timed out
    NOT_EQUIVALENT = "NOT_EQUIVALENT"  # measured, but its outputs are not the baseline's
    PRUNED = "PRUNED"  # stopped early: it provably cannot beat the baseline

    @classmethod
    def read(cls, value: object) -> Outcome | None:
        """The outcome a stored value names (a tag, a report's `outcome`); None for anything else (a missing tag,
        MEASURING)."""
        try:
            return cls(value)
        except (ValueError, TypeError):
            return None

    @property
    def machine_failure(self) -> bool:
        """The engine or its node failed: nothing is known about the config (a baseline that ended so is queued
        again: `pipeline.search.space.define.baseline_retried`)."""
        return self in (Outcome.LAUNCH_FAILED, Outcome.UNHEALTHY, Outcome.TIMEOUT)

    @property
    def reports_measurement(self) -> bool:
        """Whether a finished search trial tells the search its measured objective (else the worst value): COMPLETE
        and PRUNED (its partial figure) do, NOT_EQUIVALENT never. Under `baseline-noise` the verdict may be a false
        reject, but the reference measures decode kernels and the trial verify kernels over a tree mask
        (`pipeline.trial.gate`): a config that diverges by its kernels, not by luck, would otherwise keep pulling
        the search to a region no finalist can come from."""
        return self in (Outcome.COMPLETE, Outcome.PRUNED)

    @property
    def run_status(self) -> str:
        """The MLflow run status of a run that ended so: only a COMPLETE run FINISHED."""
        return "FINISHED" if self is Outcome.COMPLETE else "FAILED"


@dataclass(frozen=True)
class Ending:
    """How a pass ended, and why: the one form an ending takes between the steps of a trial (`Measurement.failure`,
    what `TrialFailure` carries)."""

    outcome: Outcome
    reason: str

    def text(self) -> str:
        """`<OUTCOME>: <reason>`."""
        return f"{self.outcome.value}: {self.reason}"


class TrialFailure(Exception):
    """A step of a trial's pass that ended it: the outcome it means and why. Raised by the steps
    (`pipeline.trial.engine_pass`), turned into `Measurement.failure` (its `ending`) in one place."""

    def __init__(self, outcome: Outcome, reason: str) -> None:
        super().__init__(reason)
        self.outcome, self.reason = outcome, reason

    @property
    def ending(self) -> Ending:
        return Ending(self.outcome, self.reason)
