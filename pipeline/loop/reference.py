"""What the served config was measured to do: its per-request figures per concurrency level and the request mix, from
the study that registered it. The pure part builds a `ReferenceProfile` from request rows (the columns of
`pipeline.measure.summary.REQUEST_SCHEMA`); `load_reference` reads those rows from MLflow for a registered version:
through `pipeline.records.cycles.measured_requests` (the re-runs of the chosen config, else the trial that
measured it).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import ConfigDict, Field

from pipeline.errors import PipelineError
from pipeline.loop.drift import METRICS, Metric, MetricReference, metric_reference
from pipeline.records.cycles import measured_requests
from serve.spec import FrozenModel

__all__ = ["LevelReference", "ReferenceProfile", "reference_from_rows", "load_reference", "MAX_LENGTHS"]

MAX_LENGTHS = 2000  # request lengths kept per field (a seeded subsample of a larger study)


class _Model(FrozenModel):
    model_config = ConfigDict(**FrozenModel.model_config, allow_inf_nan=False)


class LevelReference(_Model):
    level: int = Field(ge=1)
    figures: dict[Metric, MetricReference] = Field(default_factory=dict)


class ReferenceProfile(_Model):
    """The drift test's and the shift signal's reference for one registered version."""

    registered_model: str
    version: str
    study: str
    source: str = Field(description="'baseline' or the finalist the version is")
    workload: str
    workload_digest: str
    levels: tuple[LevelReference, ...]
    prompt_tokens: tuple[int, ...]
    completion_tokens: tuple[int, ...]
    runs: tuple[str, ...] = Field(description="MLflow run ids the figures come from")
    notes: tuple[str, ...] = ()

    def level(self, level: int) -> LevelReference | None:
        return next((item for item in self.levels if item.level == level), None)

    @property
    def level_numbers(self) -> list[int]:
        return [item.level for item in self.levels]


def _value(metric: Metric, row: Mapping[str, Any]) -> float | None:
    tokens = row.get("completion_tokens") or 0
    if metric == "accept_length":
        verify = row.get("spec_verify_ct")
        return tokens / verify if verify else None
    e2e = row.get("e2e_s") or 0.0
    return tokens / e2e if tokens > 0 and e2e > 0 else None


def reference_from_rows(rows: Iterable[Mapping[str, Any]], **identity: Any) -> ReferenceProfile:
    """Measured, successful requests -> per-level figures and lengths. `identity`: the `ReferenceProfile` fields
    other than levels and lengths (registered_model, version, study, source, workload, workload_digest, runs, notes).
    Pure."""
    measured = [r for r in rows if r.get("phase") == "measure" and not r.get("error")]
    levels = []
    for level in sorted({int(r["concurrency"]) for r in measured}):
        at = [r for r in measured if int(r["concurrency"]) == level]
        figures = {}
        for metric in METRICS:
            pairs = [(str(r["prompt_index"]), v) for r in at if (v := _value(metric, r)) is not None]
            found = metric_reference(metric, level, pairs)
            if found is not None:
                figures[metric] = found
        levels.append(LevelReference(level=level, figures=figures))
    rng = random.Random(0)

    def lengths(field: str) -> tuple[int, ...]:
        values = [int(r[field]) for r in measured]
        return tuple(sorted(rng.sample(values, MAX_LENGTHS) if len(values) > MAX_LENGTHS else values))

    return ReferenceProfile(levels=tuple(levels), prompt_tokens=lengths("prompt_tokens"),
                            completion_tokens=lengths("completion_tokens"), **identity)


def load_reference(tracker: Any, registered_model: str, version: str) -> ReferenceProfile:
    """The profile of `registered_model` version `version`, from its study's MLflow runs
    (`pipeline.records.cycles.measured_requests`). Raises `pipeline.errors.PipelineError` when they hold no
    measured requests."""
    serving, rows, runs, notes = measured_requests(tracker, registered_model, version)
    prov = serving.provenance
    if not rows:
        raise PipelineError(f"{registered_model} version {version}: no measured requests found in its study's MLflow "
                            f"runs (source {prov.source!r}); the drift test needs them")
    return reference_from_rows(rows, registered_model=registered_model, version=str(version), study=prov.study,
                               source=prov.source, workload=prov.workload, workload_digest=prov.workload_digest,
                               runs=tuple(runs), notes=tuple(notes))
