"""What a decision's measurements are worth when other work shared the machine. Pure and unit-tested.

Each finalist-stage run records whether its recorded window was disturbed (`RunFigures.disturbed`, from the run's
`measurement_flag`: other work held the engine's cores, or the hypervisor took them, pipeline/measure/window.py); the
level table counts them per config (`LevelRow.disturbed_runs`). The runs the decision rests on are every re-run of
the baseline and of the finalists at every level. When some were disturbed the decision says so (a caveat in the
headline, the report, the MLflow study run and the registered version); when all were, the answer is provisional,
and `promotion.promote_when_disturbed` decides whether it still moves production.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.decide.levels import LevelsDecision

MEASUREMENT_TAG = "measurement"  # the study run's and the registered version's tag: `Disturbance.measurement`
CLEAN, PARTLY, DISTURBED = "clean", "partly-disturbed", "disturbed"  # `Disturbance.measurement`, a tag's value


@dataclass(frozen=True)
class Disturbance:
    """`disturbed` of the decision's `total` re-runs were measured in a disturbed window."""

    disturbed: int
    total: int

    @property
    def measurement(self) -> str:
        """`clean`, `partly-disturbed` or `disturbed` (every run): the study run's and the version's tag."""
        if not self.disturbed:
            return CLEAN
        return DISTURBED if self.disturbed >= self.total else PARTLY

    @property
    def provisional(self) -> bool:
        return self.total > 0 and self.disturbed >= self.total

    def caveat(self) -> str:
        """The headline's caveat; "" when no run was disturbed."""
        if not self.disturbed:
            return ""
        if self.provisional:
            return (f"provisional: all {self.total} re-runs this decision rests on were measured while other work "
                    "held the CPU (disturbed windows), so the speed-ups may be off either way; run the study again "
                    "on a quiet machine before trusting it")
        return (f"{self.disturbed} of the {self.total} re-runs this decision rests on were measured while other work "
                "held the CPU (disturbed windows); their figures may be off")


def disturbance(decision: LevelsDecision) -> Disturbance:
    """The disturbed share of the decision's re-runs (every config's runs at every level)."""
    rows = [row for result in decision.levels for row in result.rows]
    return Disturbance(disturbed=sum(row.disturbed_runs for row in rows),
                       total=sum(len(row.runs_tok_s) for row in rows))


def withheld_sentence(decision_sentence: str) -> str:
    """The sentence of a study that would promote on disturbed runs only, with `promotion.promote_when_disturbed`
    false: the baseline stays, and what the runs called for is said."""
    called = decision_sentence.rstrip(".")
    return (f"keep the baseline: every re-run was disturbed and promotion.promote_when_disturbed is false "
            f"(the disturbed runs said: {called}); run the study again on a quiet machine")


def withhold(decision: LevelsDecision, sentence: str) -> LevelsDecision:
    """`decision` with the baseline served at every level, its policy's text saying why (`withheld_sentence` of
    `sentence`, the decision's own); the levels' figures stay as measured."""
    policy = decision.policy.model_copy(update={"config": None, "up_to": None, "above": None, "unsplit": None,
                                                "text": withheld_sentence(sentence)})
    return decision.model_copy(update={"policy": policy})
