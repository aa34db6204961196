"""Per-level promotion: a finalist that wins at low concurrency and loses at high gives a switch level."""

from __future__ import annotations

import pytest

from pipeline.config import PromotionPolicy, SlaConstraint
from pipeline.decide.headline import level_table
from pipeline.decide.levels import Candidate, LevelInput, RunFigures, decide_levels


def runs(*tputs: float, ttft: float = 100.0) -> tuple[RunFigures, ...]:
    return tuple(RunFigures(tput_tok_s=t, ttft_p50_ms=ttft, ttft_p99_ms=ttft * 1.5, itl_p50_ms=20.0) for t in tputs)


def level(n: int, base: tuple[float, ...], **cands: tuple[float, ...]) -> LevelInput:
    return LevelInput(level=n, baseline=runs(*base),
                      candidates=tuple(Candidate(id=k, runs=runs(*v), equivalent=True, draft_tokens=4)
                                       for k, v in cands.items()))


def test_wins_at_1_loses_at_8_gives_a_switch_level() -> None:
    decision = decide_levels([
        level(8, (100, 101, 99), fast=(80, 81, 79)),
        level(1, (10, 10.1, 9.9), fast=(15, 15.2, 14.8)),
        level(4, (40, 40.5, 39.5), fast=(48, 48.4, 47.6)),
    ], PromotionPolicy())
    assert [r.level for r in decision.levels] == [1, 4, 8]
    assert [r.winner for r in decision.levels] == ["fast", "fast", None]
    assert decision.policy.config == "fast"
    assert decision.policy.up_to == 4
    assert decision.policy.above is None
    assert "speculation off above 4" in decision.policy.text
    rows = {(r.level, row.id): row for r in decision.levels for row in r.rows}
    assert rows[(1, "fast")].speedup == pytest.approx(1.5)
    assert rows[(8, "fast")].speedup == pytest.approx(0.8)
    assert rows[(8, "baseline")].winner
    table = level_table(decision)  # what a study prints: the served config marked, never a "winner"
    assert "SERVED" in table and "WINNER" not in table


def test_second_config_wins_above_the_switch() -> None:
    decision = decide_levels([
        level(1, (10, 10, 10), deep=(15, 15, 15), shallow=(11, 11, 11)),
        level(8, (100, 100, 100), deep=(80, 80, 80), shallow=(110, 110, 110)),
    ])
    assert (decision.policy.config, decision.policy.up_to, decision.policy.above) == ("deep", 1, "shallow")


def test_one_config_everywhere_and_baseline_everywhere() -> None:
    everywhere = decide_levels([level(1, (10, 10, 10), a=(15, 15, 15)), level(4, (40, 40, 40), a=(50, 50, 50))])
    assert (everywhere.policy.config, everywhere.policy.up_to) == ("a", None)
    nowhere = decide_levels([level(1, (10, 10, 10), a=(9, 9, 9)), level(4, (40, 40, 40), a=(50, 50, 50))])
    assert nowhere.policy.config is None
    assert "won only at higher levels" in nowhere.policy.text


def test_faster_finalist_over_the_ttft_limit_is_refused_with_figure_and_limit() -> None:
    limit = SlaConstraint(metric="ttft_p99_ms", max_ms=200.0, concurrency=1)
    entry = LevelInput(level=1, baseline=runs(10, 10, 10, ttft=100.0), candidates=(
        Candidate(id="fast-slow-start", runs=runs(20, 20, 20, ttft=300.0), equivalent=True, draft_tokens=4),
        Candidate(id="modest", runs=runs(12, 12, 12, ttft=110.0), equivalent=True, draft_tokens=4),
    ))
    decision = decide_levels([entry], PromotionPolicy(), [limit])
    result = decision.levels[0]
    assert result.winner == "modest"
    refused = next(r for r in result.rows if r.id == "fast-slow-start")
    # ttft_p99 = 1.5 x 300 ms: the reason carries the figure and the limit
    assert refused.refused is not None and "450.0 ms > limit 200 ms" in refused.refused
    assert "fast-slow-start" in result.reason and "450.0 ms" in result.reason
    assert all(v.ok for v in next(r for r in result.rows if r.id == "modest").verdicts)


def test_limit_at_another_level_does_not_refuse_here() -> None:
    limit = SlaConstraint(metric="ttft_p99_ms", max_ms=200.0, concurrency=8)
    decision = decide_levels([level(1, (10, 10, 10), fast=(20, 20, 20))], constraints=[limit])
    assert decision.levels[0].winner == "fast"


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="no concurrency levels"):
        decide_levels([])
    with pytest.raises(ValueError, match="distinct"):
        decide_levels([level(1, (1, 1, 1)), level(1, (1, 1, 1))])
    with pytest.raises(ValueError, match="reserved"):
        level(1, (1, 1, 1), baseline=(2, 2, 2))


def test_every_finalist_refused_keeps_the_baseline_and_says_so() -> None:
    limit = SlaConstraint(metric="ttft_p50_ms", max_ms=50.0)
    decision = decide_levels([level(1, (10, 10, 10), fast=(20, 20, 20))], constraints=[limit],
                             finalists="finalists: ['fast'], from the Pareto front; the final pick uses tput_tok_s")
    result = decision.levels[0]
    assert result.winner is None and decision.policy.config is None
    assert result.reason.startswith("keep baseline: every finalist breaks an SLA limit")
    assert "100.0 ms > limit 50 ms" in result.reason
    assert "final pick uses tput_tok_s" in decision.reason
