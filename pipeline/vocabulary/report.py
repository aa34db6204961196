"""What a trial hands Tune at its end (`pipeline.study.driver`), and what the console, the searchers and resume read
back: one typed record. Tune carries a flat dict of scalars, so the record crosses that boundary as `to_tune()` and
comes back as `from_tune()`, which also reads an intermediate report (outcome MEASURING) and a trial that reported
nothing (None). Pure."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.vocabulary.outcome import MEASURING, NO_REPORT, Outcome

__all__ = ["LOAD_FAILURE_KEY", "SLA_PREFIX", "TrialReport"]

# The cause of a load failure a retry would repeat (`serve.engines.load_failures`); also the Optuna trial's user
# attribute (pipeline.search.space.define)
LOAD_FAILURE_KEY = "load_failure"
SLA_PREFIX = "sla."  # SLA figures at the search level, copied into Optuna's user attributes (pipeline.decide.sla)
_NAMED = ("outcome", "mlflow_run_id", "label", "reason", LOAD_FAILURE_KEY, "accept_len", "tput_noise",
          "measurement_flag", "window_remeasured", "tput_spread", "time_total_s")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass(frozen=True)
class TrialReport:
    """A trial's report. `said`: the outcome as written (an `Outcome` value, MEASURING, or NO_REPORT when the trial
    reported nothing); `metrics`: the objective's figures (a failed trial's the sentinel, the worst value) and any
    other number the report holds; `sla`: the SLA figures by their `sla.` key."""

    said: str
    run_id: str = ""
    label: str = ""
    reason: str = ""
    load_failure: str | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    accept_len: float | None = None
    tput_noise: float | None = None
    measurement_flag: str | None = None  # None: no measurement window (nothing measured)
    window_remeasured: int = 0
    tput_spread: float | None = None
    sla: Mapping[str, float] = field(default_factory=dict)
    seconds: float | None = None  # Tune's own time_total_s, on a report read back from Tune

    @property
    def outcome(self) -> Outcome | None:
        return Outcome.read(self.said)

    @property
    def intermediate(self) -> bool:
        """A chunk's report while the trial still measures (early stopping), not its end."""
        return self.said == MEASURING

    def metric(self, name: str) -> float | None:
        return self.metrics.get(name)

    def to_tune(self) -> dict[str, Any]:
        """The flat dict Tune records (the keys every reader and Optuna's attributes use)."""
        out: dict[str, Any] = {"outcome": self.said, "mlflow_run_id": self.run_id, "label": self.label,
                               "reason": self.reason}
        if self.load_failure:
            out[LOAD_FAILURE_KEY] = self.load_failure
        out.update(self.metrics)
        for key, value in (("accept_len", self.accept_len), ("tput_noise", self.tput_noise),
                           ("tput_spread", self.tput_spread)):
            if value is not None:
                out[key] = value
        if self.measurement_flag is not None:
            out["measurement_flag"] = self.measurement_flag
            out["window_remeasured"] = self.window_remeasured
        out.update(self.sla)
        return out

    @classmethod
    def from_tune(cls, result: Mapping[str, Any] | None) -> TrialReport:
        """The record of a report Tune holds (None: the trial reported nothing, NO_REPORT)."""
        if not result:
            return cls(NO_REPORT)
        numbers = {k: v for k, v in ((k, _number(v)) for k, v in result.items()) if v is not None}
        load_failure = result.get(LOAD_FAILURE_KEY)
        return cls(
            said=str(result.get("outcome", NO_REPORT)), run_id=str(result.get("mlflow_run_id") or ""),
            label=str(result.get("label") or ""), reason=str(result.get("reason") or ""),
            load_failure=str(load_failure) if load_failure else None,
            metrics={k: v for k, v in numbers.items() if k not in _NAMED and not k.startswith(SLA_PREFIX)},
            accept_len=numbers.get("accept_len"), tput_noise=numbers.get("tput_noise"),
            measurement_flag=str(result["measurement_flag"]) if "measurement_flag" in result else None,
            window_remeasured=int(numbers.get("window_remeasured") or 0), tput_spread=numbers.get("tput_spread"),
            sla={k: v for k, v in numbers.items() if k.startswith(SLA_PREFIX)}, seconds=numbers.get("time_total_s"))
