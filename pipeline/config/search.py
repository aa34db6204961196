"""How the study searches (`search:`): today's search over launches, or simulate-first (pipeline/simulate).

- `tpe`: every trial is a launch; Optuna's TPE proposes the next from the measured ones (pipeline/search/space).
- `simulate-first`: the baseline is launched first and answers the whole warm-up split; then the acceptance simulator
  replays its tokens through every draft-free config of the space (NGRAM trie + external corpus, greedy), a step-cost
  model fitted to the launches turns accept lengths into predicted figures, and only the best predicted configs are
  launched and measured as trials (`simulate.launches`, kept `simulate.min_distance` parameters apart). Every launch
  refits the cost model and re-ranks what is left; while the median prediction error of the launched configs exceeds
  `simulate.error_threshold`, each launch adds `simulate.widen_by` more (never past budget.max_trials). The decision and
  promotion are unchanged: only measured trials can win.
- `auto` (the default): simulate-first where the space can be simulated (only `none` and `ngram`, an engine whose
  `ngram` is SGLang's, temperature 0, objective metrics the simulator predicts), else tpe; the dry run and the study's
  log say which and why.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from serve.spec import FrozenModel

__all__ = ["SearchSettings", "SimulateSettings"]


class SimulateSettings(FrozenModel):
    """simulate-first's budget: what it simulates, what it launches, when it admits it was wrong."""

    model_config = ConfigDict(**FrozenModel.model_config, allow_inf_nan=False)

    launches: int = Field(1, ge=1, description="best predicted configs launched after the baseline (with the "
                          "baseline: 2 of the default 8 trials)")
    points: int = Field(5000, ge=1, description="configs the simulator evaluates: the whole space when it has no more "
                        "points, else a TPE search over the predictions")
    seconds: float = Field(120.0, gt=0, description="time cap of the simulated search (it stops at the cap)")
    min_distance: int = Field(2, ge=0, description="launched configs differ in at least this many searched "
                              "parameters (relaxed when too few such configs are left)")
    error_threshold: float = Field(0.10, gt=0, description="median |predicted - measured| / measured of the "
                                   "objective above which the study says its predictions miss and widens")
    widen_by: int = Field(1, ge=0, description="launches added after each launch while predictions miss")
    lag_rounds: int = Field(0, ge=0, description="closed loop: rounds between a reply and its successor joining "
                            "the engine's batch (0: the next round)")


class SearchSettings(FrozenModel):
    strategy: Literal["auto", "tpe", "simulate-first", "grid"] = Field(
        "auto", description="auto: simulate-first where the space can be simulated, else tpe; grid: every point of "
        "a small space launched in order after the baseline (budget.max_trials permitting), then tpe")
    simulate: SimulateSettings = Field(default_factory=SimulateSettings)
