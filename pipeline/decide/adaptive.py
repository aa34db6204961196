"""The tuned adaptive config of a study's winner: SGLang's adaptive speculation (`--speculative-adaptive`, EAGLE and
EAGLE3 with topk 1) picks `num_steps` at runtime per batch-size bucket from candidate steps; its default tiers are
SGLang's guess (`serve.spec.DEFAULT_ADAPTIVE_STEPS`). A study measured the candidates at its own concurrency levels,
so when the served config is adaptive, the per-level table says what each bucket should offer:

- a level where no speculative config beat the baseline (equivalent and above the bar) gets `[0]`: no drafting there;
- elsewhere, the steps of every equivalent static EAGLE-family chain (topk 1) of the winner's algorithm that beat the
  baseline at that level, plus SGLang's default candidates for that batch size when the adaptive winner itself beat
  it there (it ran those); SGLang's default candidates where neither says more.

Buckets are the study's levels (a batch routes to the largest bucket at or below its size, so the lowest level also
serves smaller batches). The engine command in `deploy/` names the file (serve/engines/sglang/engine.py); SGLang's own loader
(`_load_adaptive_config`) checks it when the study writes it. Pure.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

from pipeline.decide.levels import BASELINE, LevelsDecision
from serve.spec import DEFAULT_ADAPTIVE_STEPS, Eagle3Spec, EagleSpec, SpecConfig

__all__ = ["default_steps_at", "tuned_adaptive_steps"]


def default_steps_at(batch_size: int) -> tuple[int, ...]:
    """SGLang's default candidates for a batch of this size (its routing: the largest bucket at or below it, else
    the smallest bucket)."""
    buckets = sorted(DEFAULT_ADAPTIVE_STEPS)
    index = max(0, bisect.bisect_right(buckets, batch_size) - 1)
    return DEFAULT_ADAPTIVE_STEPS[buckets[index]]


def _adaptive(spec: SpecConfig | None) -> bool:
    return isinstance(spec, (EagleSpec, Eagle3Spec)) and spec.adaptive


def tuned_adaptive_steps(decision: LevelsDecision, served: str,
                         specs: Mapping[str, SpecConfig]) -> dict[int, tuple[int, ...]] | None:
    """Candidate steps per level for the served config `served` (a config id of `decision`, `specs` by id); None
    when it is not an adaptive EAGLE/EAGLE3 config (module docstring)."""
    winner = specs.get(served)
    if served == BASELINE or not isinstance(winner, (EagleSpec, Eagle3Spec)) or not winner.adaptive:
        return None
    out: dict[int, tuple[int, ...]] = {}
    for result in decision.levels:
        beat = [c.id for c in result.decision.candidates if c.beats_baseline and c.equivalent]
        if not beat:
            out[result.level] = (0,)
            continue
        steps: set[int] = set()
        for config_id in beat:
            spec = specs.get(config_id)
            if spec is None or spec.algorithm != winner.algorithm:
                continue
            if _adaptive(spec):
                steps.update(default_steps_at(result.level))
                continue
            chain_steps = getattr(spec, "num_steps", None) if getattr(spec, "topk", None) == 1 else None
            if isinstance(chain_steps, int):
                steps.add(chain_steps)
        out[result.level] = tuple(sorted(steps)) or default_steps_at(result.level)
    return out
