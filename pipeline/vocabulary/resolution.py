"""What the search hands a trial: a sampled point (Optuna params) as a validated `TrialConfig`, or the reasons it is
INVALID (`pipeline.search.space.resolve` builds it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.config import TrialConfig
from serve.spec import Violation

__all__ = ["Resolution"]


@dataclass(frozen=True)
class Resolution:
    """A sampled point turned into a TrialConfig, or the reasons it cannot be one (an INVALID trial)."""

    params: dict[str, Any]
    config: TrialConfig | None
    violations: list[Violation] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return self.config is not None and not self.violations
