"""What one deploy-and-measure pass produced (a trial, one of its equivalence passes, a finalist re-run): its records,
the engine's account of what it ran, the windows, and the summary computed where the pass was measured
(`pipeline.trial.engine_pass.measure_config` fills it step by step). Pure data: the verdicts over it are
`pipeline.decide.equivalence.judge_pass`'s."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.measure.server_info import ServerInfo
from pipeline.measure.summary import RequestRecord, Summary
from pipeline.measure.window import Window
from pipeline.vocabulary.outcome import Ending, Outcome

__all__ = ["Measurement", "meaning_changed"]


@dataclass
class Measurement:
    """What one deploy-and-measure pass produced (a trial, or one finalist re-run)."""

    records: list[RequestRecord] = field(default_factory=list)
    summary: Summary | None = None  # of `records`, None when the pass measured none
    server_info: ServerInfo = field(default_factory=ServerInfo)
    diffs: dict[str, tuple[object, object]] = field(default_factory=dict)
    engine_log: str = ""
    failure: Ending | None = None
    timings: dict[str, float] = field(default_factory=dict)
    corpus: dict[str, float] = field(default_factory=dict)  # corpus documents/bytes/tokens/load seconds
    replica: str = ""  # where the engine started: "reused" live replica, the study's "standby", a "new" app
    launch: str = ""  # "new" engine launch, or "shared" with the previous config's (serve/replica/sharing.py)
    launches: int = 0  # engine launches this pass cost (a trial adds its equivalence passes': pipeline/trial/gate.py)
    windows: list[Window] = field(default_factory=list)  # every measurement window, the recorded one last

    @property
    def remeasured(self) -> int:
        """Windows measured again because other work disturbed them."""
        return max(0, len(self.windows) - 1)

    @property
    def ending(self) -> Ending:
        """How the pass ended for the config it was asked to measure: its failure; else INVALID where the engine ran
        something else (`meaning_changed`), whose figures measure another config; else COMPLETE."""
        changed = meaning_changed(self.diffs)
        if self.failure is None and changed:
            return Ending(Outcome.INVALID, changed)
        return self.failure or Ending(Outcome.COMPLETE, "")

    def failure_text(self) -> str | None:
        """`<OUTCOME>: <reason>` of a failed pass, None when it did not fail."""
        return self.failure.text() if self.failure else None


def meaning_changed(diffs: dict[str, tuple[object, object]]) -> str | None:
    """Why the engine ran another config than asked, from its effective-settings diff: another algorithm or another
    draft/tree shape. The running-request cap aside: it bounds the batch, not what a step computes."""
    serious = {k: v for k, v in diffs.items() if k != "max_running_requests"}
    if not serious:
        return None
    return "engine changed the requested settings: " + ", ".join(
        f"{k}: requested {a!r}, effective {b!r}" for k, (a, b) in serious.items())
