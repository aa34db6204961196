"""What the study optimises and how sure it must be (`budget:`, `objective:`, `promotion:`): the inputs of the
search and of the pure decision rules in `pipeline/decide/`."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from pipeline.measure.summary import Summary
from serve.latency import LATENCY_FIELDS
from serve.spec import FrozenModel


class BudgetSettings(FrozenModel):
    max_trials: int = Field(8, ge=1, description="trials including the baseline")
    time_budget_s: float | None = Field(None, gt=0, description="stop starting new trials after this")
    # On by default: on the recorded grid's replay it never stopped a point within 2% of the best nor one faster than
    # the baseline (docs/configuration.md "Early stopping").
    early_stopping: bool = Field(True, description="measure trials request by request and stop (PRUNED) one that "
                                 "provably cannot beat the baseline (pipeline/decide/stopping.py); search concurrency 1")
    early_stopping_sigma: float = Field(0.05, ge=0, le=1, description="run-to-run sd of log throughput the rule "
                                        "allows for (the recorded grid's pooled figure is 0.034)")


# Latency figures an SLA limit may name (`serve.latency`), and every numeric figure an objective may name: taken from
# what `pipeline.measure.summary.Summary` reports, so a misspelt name is an error at load, not a silent None per trial.
SLA_METRICS: tuple[str, ...] = LATENCY_FIELDS
OBJECTIVE_METRICS: tuple[str, ...] = tuple(
    name for name, field in Summary.model_fields.items()
    if name not in ("seed", "n_boot", "concurrency", "offered_rate_per_s", "arrival_rate_per_s")  # load, not result
    and field.annotation in (int, float, float | None))


class SlaConstraint(FrozenModel):
    """One service-level limit: `metric` (a latency percentile in ms) must be <= `max_ms` at `concurrency`
    (None = at every level in the study's `concurrency` list). Checked on the median over re-measured runs."""

    model_config = ConfigDict(**FrozenModel.model_config, allow_inf_nan=False)

    metric: str = Field(description=f"one of {', '.join(SLA_METRICS)}")
    max_ms: float = Field(gt=0, description="the limit, milliseconds")
    concurrency: int | None = Field(None, ge=1, description="level the limit holds at; None = every level")

    @field_validator("metric")
    @classmethod
    def _known_metric(cls, value: str) -> str:
        if value not in SLA_METRICS:
            raise ValueError(f"unknown SLA metric {value!r}. Fix: use one of {list(SLA_METRICS)} (latency "
                             "percentiles in milliseconds, as pipeline.measure.summary.Summary reports them)")
        return value


class ObjectiveSettings(FrozenModel):
    metrics: list[str] = Field(default_factory=lambda: ["tput_tok_s"], min_length=1)
    modes: list[Literal["max", "min"]] = Field(default_factory=lambda: list[Literal["max", "min"]](["max"]),
                                               min_length=1)
    constraints: list[SlaConstraint] = Field(default_factory=list, description="SLA limits; a finalist that breaks "
                                             "one is refused, trials that break one are infeasible for the search")

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, value: list[str]) -> list[str]:
        bad = [m for m in value if m not in OBJECTIVE_METRICS]
        if bad:
            raise ValueError(f"unknown objective metric(s) {bad}. Fix: use names pipeline.measure.summary.Summary reports: "
                             f"{list(OBJECTIVE_METRICS)}")
        if len(set(value)) != len(value):
            raise ValueError(f"each objective metric may appear once, got {value}")
        return value

    @model_validator(mode="after")
    def _same_length(self) -> ObjectiveSettings:
        if len(self.metrics) != len(self.modes):
            raise ValueError(f"metrics and modes must have the same length, got {self.metrics} and {self.modes}")
        return self


EquivalenceMode = Literal["exact", "baseline-noise", "deterministic"]


class PromotionPolicy(FrozenModel):
    """How sure the tuner must be before replacing the baseline: the study file's `promotion:` section and the input
    of the pure decision (`pipeline.decide.decision.decide`). One type for both, so the file and the rule cannot drift."""

    model_config = ConfigDict(**FrozenModel.model_config, allow_inf_nan=False)  # an infinite margin decides nothing

    finalists: int = Field(1, ge=0, description="best trials re-measured against the baseline; 0 = search only: "
                                               "nothing is re-measured, so the study keeps the baseline")
    runs: int = Field(3, ge=3, description="re-measurements per finalist and baseline (a freshly started engine "
                                           "each); a MAD of fewer than 3 runs is meaningless")
    spread_limit: float = Field(1.15, gt=1, description="a config's runs must agree: when their fastest over slowest "
                                "throughput (at the first level) exceeds this, the run farthest from their median is "
                                "measured again in a fresh engine and replaced; the replaced run is recorded with why")
    spread_reruns: int = Field(2, ge=0, le=5, description="extra fresh runs per config that `spread_limit` may ask "
                               "for; 0 = keep the runs as measured (their spread is still printed)")
    margin: float = Field(0.03, ge=0, description="score must beat the baseline's median by this fraction")
    tie_tolerance: float = Field(0.01, ge=0, description="scores within this fraction of the best tie: fewer drafts "
                                                         "win")
    equivalence: EquivalenceMode = Field("exact", description=(
        "how greedy outputs are judged against the baseline's at the same concurrency: exact (token for token; "
        "the CPU engine is batch-invariant), baseline-noise (no more divergence than the baseline's own re-runs, "
        "a sign test at equivalence_alpha), deterministic (checked on engines started in the engine's "
        "deterministic-inference mode, throughput measured without it)"))
    equivalence_threshold: float = Field(1.0, description="exact only: share of greedy outputs identical to the "
                                         "baseline's")
    equivalence_alpha: float = Field(0.05, description="baseline-noise only: significance level of the sign test "
                                     "(the chance of refusing a lossless config, at most)")
    require_equivalence: bool = Field(True, description="a finalist that failed an equivalence check cannot win")
    promote_when_disturbed: bool = Field(True, description="when every re-run the decision rests on was measured "
                                         "in a disturbed window (other work held the CPU), still promote (the "
                                         "decision is marked provisional); false = keep the baseline then")

    @field_validator("tie_tolerance")
    @classmethod
    def _tie_fraction(cls, value: float) -> float:
        if not 0 <= value < 1:
            raise ValueError(f"must be a fraction in [0, 1) of the best score; got {value}. Fix: e.g. 0.01 for 1% "
                             "(1 or more would make every finalist a tie)")
        return value

    @field_validator("equivalence_threshold")
    @classmethod
    def _share(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError(f"must be a share in (0, 1]; got {value}. Fix: 1.0 for fp32 (outputs are bit-exact), "
                             "e.g. 0.9 for bf16 (0 would accept any output)")
        return value

    @field_validator("equivalence_alpha")
    @classmethod
    def _alpha(cls, value: float) -> float:
        if not 0 < value < 0.5:
            raise ValueError(f"must be a significance level in (0, 0.5); got {value}. Fix: e.g. 0.05 (at most 5% of "
                             "lossless configs refused) or 0.01")
        return value

    @model_validator(mode="after")
    def _threshold_is_exact_only(self) -> PromotionPolicy:
        # A share threshold was the only knob before the modes; under the other modes it would silently do nothing.
        if self.equivalence != "exact" and self.equivalence_threshold != 1.0:
            how = {"baseline-noise": "judges divergence against the baseline's own re-runs at the same level",
                   "deterministic": "requires identical outputs on deterministic-inference engines"}[self.equivalence]
            raise ValueError(
                f"equivalence_threshold={self.equivalence_threshold} applies to equivalence: exact only, got "
                f"equivalence: {self.equivalence}. Fix: remove equivalence_threshold ({self.equivalence} {how}), or "
                "set equivalence: exact")
        return self


def min_items(alpha: float) -> int:
    """The fewest untied outputs with which the sign test of `baseline-noise` (pipeline/decide/noise.py) can refuse
    a config at `alpha`: 2^-n < alpha."""
    return max(1, math.floor(math.log2(1 / alpha)) + 1)


def check_equivalence_setup(policy: PromotionPolicy, measure_prompts: int, deterministic_flags: list[str] | None,
                            engine_label: str) -> str | None:
    """Why the study's equivalence mode cannot work with its workload or engine (None: it can). Pure.

    `deterministic_flags`: what the engine kind adds to start in its deterministic-inference mode ([] = its decoding
    is batch-invariant already, None = it has no such mode)."""
    if policy.equivalence == "baseline-noise":
        need = min_items(policy.equivalence_alpha)
        if measure_prompts < need:
            return (f"promotion.equivalence=baseline-noise with workload.measure_prompts={measure_prompts}: the sign "
                    f"test at equivalence_alpha={policy.equivalence_alpha} needs at least {need} measured prompts to "
                    f"ever refuse a config (2^-n < alpha). Fix: measure_prompts >= {need}, or a larger alpha")
    if policy.equivalence == "deterministic" and deterministic_flags is None:
        return (f"promotion.equivalence=deterministic: {engine_label} has no deterministic-inference mode this tuner "
                "knows how to start. Fix: equivalence: baseline-noise, or exact")
    return None
