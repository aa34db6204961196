"""A recorded trial as the study's tables, plots and decision read it: `TrialRow`, built once from its MLflow run
(`pipeline.records.trial_runs.row_from_run`), frozen. What the study learns later (the ratio to the baseline, the SLA
verdicts at the search level) comes as a new row (`dataclasses.replace`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.vocabulary.outcome import Outcome

__all__ = ["ROW_METRICS", "TrialRow"]

# The figures a row shows in `python -m pipeline.compare`'s CSV and JSON, in this order. corpus: only trials with an
# external corpus (pipeline/trial/corpus.py).
ROW_METRICS = ("tput_tok_s", "accept_len", "ttft_p50_ms", "itl_p50_ms", "e2e_p50_ms", "tput_ci_low", "tput_ci_high",
               "ttft_p90_ms", "ttft_p99_ms", "itl_p90_ms", "itl_p99_ms", "e2e_p90_ms", "e2e_p99_ms",
               "corpus_tokens", "corpus_load_s")


@dataclass(frozen=True)
class TrialRow:
    """One trial (or finalist run). `name`: the run name, its config label (`pipeline.records.labels`), made unique
    among the study's rows; `trial_id`: the Tune trial id (None in records from before it was kept); `outcome`: None
    when the run's tag names none; `params`: its `spec.*` and `trial.*` params but the algorithm and concurrency;
    `figures`: every metric of the run. `vs_baseline`: throughput over the baseline's; `sla`: the verdicts at the
    search level (None: not checked) and `feasible` (False when it broke a limit; None when none was checked)."""

    run_id: str
    name: str
    trial_id: str | None
    outcome: Outcome | None
    reason: str
    algorithm: str
    params: Mapping[str, str]
    figures: Mapping[str, float]
    vs_baseline: float | None = None
    sla: tuple[str, ...] | None = None
    feasible: bool | None = None

    @property
    def baseline(self) -> bool:
        return self.algorithm == "none"

    @property
    def complete(self) -> bool:
        return self.outcome is Outcome.COMPLETE

    @property
    def outcome_text(self) -> str:
        return self.outcome.value if self.outcome is not None else "?"

    def metric(self, name: str) -> float | None:
        """The run's figure `name` (an objective's, an SLA limit's), None when it has none."""
        return self.figures.get(name)

    @property
    def tput_tok_s(self) -> float | None:
        return self.metric("tput_tok_s")

    @property
    def accept_len(self) -> float | None:
        return self.metric("accept_len")

    @property
    def ttft_p50_ms(self) -> float | None:
        return self.metric("ttft_p50_ms")

    @property
    def tput_ci_low(self) -> float | None:
        return self.metric("tput_ci_low")

    @property
    def tput_ci_high(self) -> float | None:
        return self.metric("tput_ci_high")

    @property
    def corpus_load_s(self) -> float | None:
        return self.metric("corpus_load_s")

    def number(self, param: str) -> float | None:
        """A numeric param (`spec.num_draft_tokens`, `trial.warmup_requests`), None when absent or not a number."""
        value = self.params.get(param)
        try:
            return float(value) if value is not None else None
        except ValueError:
            return None

    def whole(self, param: str) -> int | None:
        """An integer param, None when absent or not an integer."""
        try:
            return int(self.params[param])
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def settings(self) -> str:
        """The config's searched settings in a line: `spec.*` and the warm-up length, without their prefixes."""
        return " ".join(f"{k.split('.', 1)[1]}={v}" for k, v in self.params.items()
                        if k.startswith("spec.") or k == "trial.warmup_requests")

    def record(self) -> dict[str, object]:
        """The row as `python -m pipeline.compare` writes it (JSON, CSV): `sla` and `feasible` only once checked."""
        out: dict[str, object] = {
            "run_id": self.run_id, "name": self.name, "trial_id": self.trial_id, "outcome": self.outcome_text,
            "reason": self.reason, "algorithm": self.algorithm, "params": dict(self.params),
            **{m: self.metric(m) for m in ROW_METRICS}, "baseline": self.baseline, "vs_baseline": self.vs_baseline}
        if self.sla is not None:
            out.update(sla=list(self.sla), feasible=self.feasible)
        return out
