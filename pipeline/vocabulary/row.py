"""A recorded trial as the study's tables, plots and decision read it: `TrialRow`, built once from its MLflow run
(`pipeline.records.trial_runs.row_from_run`), frozen. What the study learns later (the ratio to the baseline, the SLA
verdicts at the search level) comes as a new row (`dataclasses.replace`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.vocabulary.outcome import Outcome
from serve.latency import LATENCY_FIELDS

__all__ = ["ROW_METRICS", "TrialRow"]

# The figures a row shows in `python -m pipeline.compare`'s CSV and JSON, in this order. corpus: only trials with an
# external corpus (pipeline/trial/corpus.py).
_MEDIANS = tuple(name for name in LATENCY_FIELDS if name.endswith("_p50_ms"))
ROW_METRICS = ("tput_tok_s", "accept_len", *_MEDIANS, "tput_ci_low", "tput_ci_high",
               *(name for name in LATENCY_FIELDS if name not in _MEDIANS), "corpus_tokens", "corpus_load_s")


@dataclass(frozen=True)
class TrialRow:
    """One trial (or finalist run). `name`: the run name, its config label (`pipeline.records.labels`), made unique
    among the study's rows; `trial_id`: the Tune trial id (None in records from before it was kept); `outcome`: None
    when the run's tag names none; `params`: its `spec.*` and `trial.*` params but the algorithm and concurrency;
    `figures`: every metric of the run. `vs_baseline`: throughput over the baseline's; `sla`: the verdicts at the
    search level (None: not checked) and `feasible` (False when it broke a limit; None when none was checked).
    `decided`: a finalist's speed-up as the decision read it (the finalist stage's paired ratio at the search level),
    None for a config that was not re-measured."""

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
    decided: float | None = None

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

    @property
    def speedup(self) -> float | None:
        """The one speed-up every view shows: the decision's figure once the finalist stage measured it, else the
        search's single measurement (`vs_baseline`)."""
        return self.decided if self.decided is not None else self.vs_baseline

    @property
    def search_note(self) -> str:
        """`search 1.59x` beside a re-measured figure (the search's own, labelled); "" where the two are one."""
        return f"search {self.vs_baseline:.2f}x" if self.decided is not None and self.vs_baseline else ""

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
        """The row as `python -m pipeline.compare` writes it (JSON, CSV): `sla` and `feasible` only once checked,
        `decided_vs_baseline` only for a re-measured finalist."""
        out: dict[str, object] = {
            "run_id": self.run_id, "name": self.name, "trial_id": self.trial_id, "outcome": self.outcome_text,
            "reason": self.reason, "algorithm": self.algorithm, "params": dict(self.params),
            **{m: self.metric(m) for m in ROW_METRICS}, "baseline": self.baseline, "vs_baseline": self.vs_baseline}
        if self.decided is not None:  # a finalist: the speed-up the decision read, beside the search's
            out["decided_vs_baseline"] = self.decided
        if self.sla is not None:
            out.update(sla=list(self.sla), feasible=self.feasible)
        return out
