"""What every trial of a study shares (`TrialContext`) and what one deploy-and-measure pass produced (`Measurement`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from pipeline.config import StudyConfig
from pipeline.measure.load import LoadRequest
from pipeline.measure.server_info import ServerInfo
from pipeline.measure.summary import RequestRecord
from pipeline.measure.window import Window
from pipeline.records.tracking import Tracker
from pipeline.vocabulary.outcome import Ending

__all__ = ["Measurement", "TrialContext"]


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

    def with_flags(self, flags: Sequence[str]) -> TrialContext:
        """This context, its engines started with `flags` added to `engine.extra_flags` (the deterministic passes
        of `pipeline.trial.gate`)."""
        engine = self.study.engine.model_copy(update={"extra_flags": [*self.study.engine.extra_flags, *flags]})
        return dataclasses.replace(self, study=self.study.model_copy(update={"engine": engine}))


@dataclass
class Measurement:
    """What one deploy-and-measure pass produced (a trial, or one finalist re-run)."""

    records: list[RequestRecord] = field(default_factory=list)
    server_info: ServerInfo = field(default_factory=ServerInfo)
    diffs: dict[str, tuple[object, object]] = field(default_factory=dict)
    engine_log: str = ""
    failure: Ending | None = None
    timings: dict[str, float] = field(default_factory=dict)
    corpus: dict[str, float] = field(default_factory=dict)  # corpus documents/bytes/tokens/load seconds
    replica: str = ""  # where the engine started: "reused" live replica, the study's "standby", a "new" app
    launch: str = ""  # "new" engine launch, or "shared" with the previous config's (serve/replica/sharing.py)
    launches: int = 0  # engine launches this pass cost (equivalence passes add theirs: pipeline/trial/gate.py)
    windows: list[Window] = field(default_factory=list)  # every measurement window, the recorded one last

    @property
    def remeasured(self) -> int:
        """Windows measured again because other work disturbed them."""
        return max(0, len(self.windows) - 1)

    def failure_text(self) -> str | None:
        """`<OUTCOME>: <reason>` of a failed pass, None when it did not fail."""
        return self.failure.text() if self.failure else None
