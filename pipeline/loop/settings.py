"""The loop's settings (`python -m pipeline.loop --settings FILE`, YAML): when cycles start, and the canary's, the drift
test's, the shift signal's and the promotion rule's thresholds (docs/loop.md)."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from pipeline.config import PromotionPolicy, SlaConstraint
from pipeline.loop.canary import CanarySettings
from pipeline.loop.drift import DriftSettings
from pipeline.loop.shift import ShiftSettings
from serve.spec import FrozenModel

__all__ = ["LoopSettings"]


class LoopSettings(FrozenModel):
    """One loop's settings; the command line sets `registered_model`, `state_dir`, `every_s`, `on_drift` and
    `min_gap_s`, a `--settings` file the rest."""

    model_config = ConfigDict(**FrozenModel.model_config, allow_inf_nan=False)

    registered_model: str
    state_dir: str
    every_s: float | None = Field(6 * 3600.0, gt=0, description="start a cycle this long after the last one; None "
                                                                "= on drift only")
    on_drift: bool = Field(True, description="start a cycle on a drift alarm")
    min_gap_s: float = Field(3600.0, ge=0, description="no drift-started cycle sooner than this after the last")
    canary: CanarySettings = Field(default_factory=CanarySettings)
    drift: DriftSettings = Field(default_factory=DriftSettings)
    shift: ShiftSettings = Field(default_factory=ShiftSettings)
    promotion: PromotionPolicy = Field(default_factory=PromotionPolicy)
    constraints: tuple[SlaConstraint, ...] = ()
    start_timeout_s: float = Field(900.0, gt=0, description="a candidate not serving after this rolls back")
    experiment: str | None = None
