"""What every trial of a study shares (`TrialContext`), the study's `Engine` among it: resolved from its kind once,
where the context is built, and handed on rather than looked up again by kind."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.config import StudyConfig
from pipeline.measure.load import LoadRequest
from pipeline.records.tracking import Tracker
from serve.engines import engine_for
from serve.engines.base import Engine

__all__ = ["TrialContext"]


@dataclass(frozen=True)
class TrialContext:
    """What every trial of a study shares. Picklable: it travels to Tune's trial processes."""

    study: StudyConfig
    output_dir: str
    serve_url: str
    tracker: Tracker
    parent_run_id: str
    warmup: tuple[LoadRequest, ...]
    measure: tuple[LoadRequest, ...]
    # simulate-first (pipeline/search/simulate_first.py): prompts the baseline answers after its measurement, in a
    # `reference` phase, so that the simulator has every warm-up answer; empty otherwise
    reference: tuple[LoadRequest, ...] = ()
    # the study's engine kind as behaviour: what its engine pins, its deterministic flags, its own figures
    engine: Engine = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", engine_for(self.study.engine.kind))  # frozen: set once, here

    def with_flags(self, flags: Sequence[str]) -> TrialContext:
        """This context, its engines started with `flags` added to `engine.extra_flags` (the deterministic passes
        of `pipeline.trial.gate`)."""
        engine = self.study.engine.model_copy(update={"extra_flags": [*self.study.engine.extra_flags, *flags]})
        return dataclasses.replace(self, study=self.study.model_copy(update={"engine": engine}))
