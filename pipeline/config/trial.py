"""`TrialConfig`: one point to measure (what the engine is told plus how the trial drives it), and its validation."""

from __future__ import annotations

from pydantic import Field

from serve.engines import algorithms_of, engine_for
from serve.spec import FrozenModel, NoSpec, SpecConfig, Violation, validate_spec


class TrialConfig(FrozenModel):
    """One configuration to deploy and measure: what the engine is told plus how the trial drives it."""

    spec: SpecConfig = Field(default_factory=NoSpec)
    warmup_requests: int = Field(0, ge=0, description="requests sent after the flush and before measuring")
    max_running_requests: int | None = Field(None, ge=1, description="engine batch bound; None = engine default")
    concurrency: int = Field(1, ge=1, description="client requests in flight while measuring")


def validate_trial(trial: TrialConfig, engine: str = "cpu") -> list[Violation]:
    """Every reason this trial must not be deployed on `engine`; empty means valid. Pure."""
    found = list(validate_spec(trial.spec))
    # Engines implement different algorithms; static knowledge of the engine kind, so validation, not preflight.
    supported = algorithms_of(engine)
    if trial.spec.algorithm not in supported:
        found.append(Violation(
            "spec.algorithm", f"{engine_for(engine).label} implements only {sorted(supported)}",
            f"algorithm={trial.spec.algorithm}"))
    return found
