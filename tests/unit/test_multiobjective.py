"""Several objectives: finalists come from the Pareto front and the decision says which objective picked."""

from __future__ import annotations

import optuna
import pytest

from pipeline.decide.pareto import choose_finalists, pareto_front
from pipeline.vocabulary.outcome import Outcome
from pipeline.vocabulary.row import TrialRow
from tests.rows import trial_row


def row(name: str, tput: float, ttft: float, outcome: Outcome = Outcome.COMPLETE, feasible: bool | None = None
        ) -> TrialRow:
    return trial_row(name, outcome=outcome, feasible=feasible, tput_tok_s=tput, ttft_p50_ms=ttft)


ROWS = [
    row("baseline", 10, 50),
    row("fast", 20, 90),
    row("balanced", 15, 60),
    row("dominated", 14, 95),       # slower and later than "balanced"
    row("failed", 99, 1, outcome=Outcome.UNHEALTHY),
    row("infeasible", 30, 40, feasible=False),
]


def test_front_matches_optuna_best_trials() -> None:
    metrics, modes = ["tput_tok_s", "ttft_p50_ms"], ["max", "min"]
    ours = {r.name for r in pareto_front(ROWS, metrics, modes)}
    assert ours == {"baseline", "fast", "balanced"}
    study = optuna.create_study(directions=["maximize", "minimize"])
    for r in ROWS:
        if r.complete and r.feasible is not False:
            study.add_trial(optuna.trial.create_trial(values=[r.figures["tput_tok_s"], r.figures["ttft_p50_ms"]],
                                                      user_attrs={"name": r.name}))
    assert {t.user_attrs["name"] for t in study.best_trials} == ours


def test_finalists_from_front_ordered_by_first_objective() -> None:
    choice = choose_finalists(ROWS, ["tput_tok_s", "ttft_p50_ms"], ["max", "min"], count=2, exclude=["baseline"])
    assert choice.names == ("fast", "balanced")
    assert "dominated" not in choice.front
    assert choice.pick_metric == "tput_tok_s"
    assert "Pareto front" in choice.explanation and "final pick uses tput_tok_s" in choice.explanation
    # ordered by a minimised first objective, the lower latency comes first
    latency_first = choose_finalists(ROWS, ["ttft_p50_ms", "tput_tok_s"], ["min", "max"], 1, exclude=["baseline"])
    assert latency_first.names == ("balanced",)


def test_single_objective_is_top_n_and_bad_input_is_refused() -> None:
    choice = choose_finalists(ROWS, ["tput_tok_s"], ["max"], count=2, exclude=["baseline"])
    assert choice.names == ("fast", "balanced") and choice.front == ()
    assert "dominated" not in choice.names  # 14 < 15
    with pytest.raises(ValueError, match="same length"):
        pareto_front(ROWS, ["tput_tok_s"], ["max", "min"])
    with pytest.raises(ValueError, match="count"):
        choose_finalists(ROWS, ["tput_tok_s"], ["max"], count=0)


def test_levels_decision_carries_the_pick_explanation() -> None:
    from pipeline.decide.levels import Candidate, LevelInput, RunFigures, decide_levels

    choice = choose_finalists(ROWS, ["tput_tok_s", "ttft_p50_ms"], ["max", "min"], count=2, exclude=["baseline"])
    figs = lambda t: tuple(RunFigures(tput_tok_s=t) for _ in range(3))  # noqa: E731
    decision = decide_levels([LevelInput(level=1, baseline=figs(10), candidates=tuple(
        Candidate(id=n, runs=figs(t), equivalent=True, draft_tokens=4) for n, t in (("fast", 20), ("balanced", 15))
    ))], finalists=choice.explanation)
    assert decision.levels[0].winner == "fast"
    assert "Pareto front" in decision.reason and "final pick uses tput_tok_s" in decision.reason
