"""The headline and the level table a serving team reads: the decision in one sentence, the speed-up per level with
its spread, what to deploy, and a level where no config meets a limit said as such with the figures."""

from __future__ import annotations

import pytest

from pipeline.config import SlaConstraint
from pipeline.decide.headline import (ADVICE, Deploy, impossible_lines, level_table, levels_headline, row_status,
                                      search_only_headline, served_at)
from pipeline.decide.levels import BASELINE, Candidate, LevelInput, RunFigures, decide_levels

NAME = "ngram BFS d4 b2 depth18 warm1"
ID = "ngram-BFS-d4-b2-depth18-warm1"
DEPLOY = Deploy("/out/deploy/engine_command.sh")


def runs(*tputs: float, ttft: float = 100.0) -> tuple[RunFigures, ...]:
    return tuple(RunFigures(tput_tok_s=t, ttft_p50_ms=ttft, ttft_p99_ms=ttft * 1.5) for t in tputs)


def level(n: int, base: tuple[float, ...], cand: tuple[float, ...], base_ttft: float = 100.0,
          cand_ttft: float = 100.0, equivalent: bool = True) -> LevelInput:
    return LevelInput(level=n, baseline=runs(*base, ttft=base_ttft), candidates=(
        Candidate(id=ID, runs=runs(*cand, ttft=cand_ttft), equivalent=equivalent, draft_tokens=3),))


def decide(*levels: LevelInput, constraints=()):
    return decide_levels(list(levels), constraints=list(constraints), labels={ID: NAME})


def test_a_switch_level_reads_as_one_sentence_with_the_speed_up_and_its_spread_per_level() -> None:
    decision = decide(level(1, (10, 10.2, 9.8), (12.4, 12.0, 12.9)), level(4, (30, 31, 29), (27, 28, 29)))
    head = levels_headline(decision, Deploy("/out/deploy/engine_command.sh", "/out/deploy/engine_command_high.sh", 1))
    assert head.kind == "promote"
    assert head.decision == (f"serve '{NAME}' up to 1 in flight (1.24x at 1), the baseline above 1: speculation "
                             "does not pay there (0.93x at 4).")
    assert head.levels[0] == f"1 in flight: '{NAME}' 12.4 tok/s vs the baseline's 10.0 = 1.24x (runs 1.20x-1.29x)"
    assert head.levels[1].startswith("4 in flight: the baseline, 30.0 tok/s; best finalist")
    assert "0.93x (runs 0.90x-0.97x)" in head.levels[1] and "needs a noise-adjusted score above" in head.levels[1]
    assert head.impossible == ()
    assert head.deploy == (f"run /out/deploy/engine_command.sh ('{NAME}' up to the switch); above 1 in flight "
                           "/out/deploy/engine_command_high.sh")
    text = head.text()
    assert text.splitlines()[0].startswith("decision: PROMOTE -- serve ")
    assert "Deploy: run /out/deploy/engine_command.sh" in text and "final-" not in text and ID not in text
    assert head.markdown().startswith("**Decision (PROMOTE):** serve")


def test_a_level_where_no_config_meets_a_limit_is_said_as_such_with_the_figures() -> None:
    """The case that printed `WINNER BROKEN`: at 4 in flight both configs break the TTFT limit."""
    limit = SlaConstraint(metric="ttft_p99_ms", max_ms=200.0, concurrency=4)
    decision = decide(level(1, (10, 10, 10), (15, 15, 15)), level(4, (30, 31, 29), (40, 41, 39), base_ttft=300.0,
                                                                   cand_ttft=350.0), constraints=[limit])
    head = levels_headline(decision, DEPLOY)
    assert head.impossible == ("no config meets ttft_p99_ms <= 200 ms at 4 in flight (best: the baseline 450 ms); "
                               f"{ADVICE}",)
    assert "Not possible: no config meets ttft_p99_ms <= 200 ms at 4 in flight" in head.text()
    four = decision.levels[1]
    assert [row_status(decision, four, row) for row in four.rows] == ["SERVED (fallback)", "refused"]
    table = level_table(decision)
    assert "WINNER" not in table and "BROKEN" not in table
    assert "breaks ttft_p99_ms <= 200 ms: 450 ms" in table and "breaks ttft_p99_ms <= 200 ms: 525 ms" in table
    assert table.splitlines()[-1] == "limits: ttft_p99_ms <= 200 ms at 4 in flight"
    assert NAME in table and ID not in table


def test_the_best_figure_names_the_config_closest_to_the_limit_and_the_baseline_too() -> None:
    limit = SlaConstraint(metric="ttft_p99_ms", max_ms=100.0)
    decision = decide(level(1, (10, 10, 10), (15, 15, 15), base_ttft=300.0, cand_ttft=200.0), constraints=[limit])
    assert impossible_lines(decision, decision.levels[0]) == [
        f"no config meets ttft_p99_ms <= 100 ms at 1 in flight (best: '{NAME}' 300 ms, the baseline 450 ms); {ADVICE}"]
    assert levels_headline(decision, DEPLOY).decision.startswith(
        "keep the baseline: every finalist breaks an SLA limit at 1 in flight")


def test_a_served_fallback_that_breaks_a_limit_another_config_meets_is_named() -> None:
    limit = SlaConstraint(metric="ttft_p99_ms", max_ms=200.0)
    # the finalist meets the limit but is slower: the baseline is served, over the limit
    decision = decide(level(1, (10, 10, 10), (9, 9, 9), base_ttft=300.0, cand_ttft=100.0), constraints=[limit])
    (line,) = impossible_lines(decision, decision.levels[0])
    assert line == (f"the baseline is served at 1 in flight as the fallback and breaks ttft_p99_ms <= 200 ms (450 ms); "
                    f"'{NAME}' meet(s) it but is not faster by the promotion rule")


def test_limits_that_each_hold_somewhere_but_never_together() -> None:
    limits = [SlaConstraint(metric="ttft_p99_ms", max_ms=200.0), SlaConstraint(metric="ttft_p50_ms", max_ms=120.0)]
    # the baseline meets the p99 limit and breaks the p50 one; the finalist the other way round
    entry = LevelInput(level=2, baseline=(RunFigures(tput_tok_s=10, ttft_p50_ms=150, ttft_p99_ms=150),) * 3,
                       candidates=(Candidate(id=ID, runs=(RunFigures(tput_tok_s=12, ttft_p50_ms=100,
                                                                     ttft_p99_ms=300),) * 3, equivalent=True,
                                             draft_tokens=3),))
    decision = decide_levels([entry], constraints=limits, labels={ID: NAME})
    (line,) = impossible_lines(decision, decision.levels[0])
    assert line.startswith("no config meets every limit at once at 2 in flight (each is met by some config: "
                           "the baseline breaks ttft_p50_ms <= 120 ms;")
    assert line.endswith(ADVICE)


@pytest.mark.parametrize("case, words", [
    ("below the bar", "no finalist beats it by the promotion margin and its noise at 1 in flight (best: "),
    ("not equivalent", "no finalist is eligible at 1 in flight"),
    ("baseline failed", "a baseline re-run failed"),
])
def test_keep_baseline_says_why_in_the_sentence(case: str, words: str) -> None:
    if case == "below the bar":
        decision = decide(level(1, (10, 10, 10), (10.1, 10.1, 10.1)))
    elif case == "not equivalent":
        decision = decide(level(1, (10, 10, 10), (15, 15, 15), equivalent=False))
    else:
        decision = decide(level(1, (10, 0, 10), (15, 15, 15)))
    head = levels_headline(decision, DEPLOY)
    assert head.kind == "keep_baseline" and head.decision.startswith("keep the baseline: ")
    assert words in head.decision, head.decision
    assert served_at(decision, 1) == BASELINE
    assert head.deploy == "run /out/deploy/engine_command.sh (the baseline)"


def test_one_config_at_every_level() -> None:
    decision = decide(level(1, (10, 10, 10), (15, 15, 15)), level(4, (30, 30, 30), (36, 36, 36)))
    assert levels_headline(decision, DEPLOY).decision == (
        f"serve '{NAME}': faster than the baseline at every measured level (1.50x at 1, 1.20x at 4).")


def test_a_search_only_study_shows_the_baseline_and_the_fastest_trial_as_a_hint() -> None:
    head = search_only_headline("keep baseline: promotion.finalists is 0, so nothing was re-measured", 10.76, 1,
                                DEPLOY, best=(NAME, 1.2))
    assert head.kind == "keep_baseline"
    assert head.decision == "keep baseline: promotion.finalists is 0, so nothing was re-measured."
    assert head.levels == (f"1 in flight: the baseline, 10.8 tok/s (one search measurement); fastest trial "
                           f"'{NAME}' 1.20x in its single measurement",)
    none = search_only_headline("no baseline measurement completed: nothing can be promoted", None, 1, None)
    assert none.kind == "no_baseline" and none.levels == () and none.deploy == "nothing to deploy"


def test_the_search_baseline_gap_pools_the_search_run_with_the_reruns():
    from pipeline.study.finalize import baseline_gap

    pooled, gap = baseline_gap(25.5, [30.4, 32.4, 31.0])
    assert pooled == 30.7  # median of 25.5, 30.4, 31.0, 32.4
    assert round(gap, 4) == -0.1774  # the search run, 17.7% below the re-runs' median (31.0)
    assert baseline_gap(30.0, [30.0]) == (30.0, 0.0)


def test_the_search_baseline_gap_leaves_out_reruns_that_measured_nothing():
    """A re-run that failed (launch failed, engine unhealthy) records 0 tok/s; the gap is over the ones that measured,
    and a study whose baseline re-runs all failed is not stopped by a division by zero (a vLLM suffix study was)."""
    from pipeline.study.finalize import baseline_gap

    assert baseline_gap(5.0, [10.0, 0.0, 0.0]) == (7.5, -0.5)
    with pytest.raises(ValueError, match="no re-run"):
        baseline_gap(5.0, [0.0, 0.0])


def test_the_gap_at_equal_step_speed_takes_out_what_the_windows_step_timer_measured():
    """Study q1 on a 2-core AMD EPYC: the search's baseline 26.81 tok/s at steps 1.04x its calibration, the re-runs
    25.70, 24.50, 22.51 at 1.11x, 1.16x, 1.23x: +9.4% raw, -1.9% at equal step speed. A run that failed is left out;
    without every window's step ratio there is no such figure."""
    from pipeline.decide.spread import gap_at_equal_steps

    runs = [(25.70, 1.11), (24.50, 1.16), (22.51, 1.23)]
    steady = gap_at_equal_steps((26.81, 1.04), runs)
    assert steady is not None and round(steady, 3) == -0.019  # 27.88 against the median of 28.53, 28.42, 27.69
    assert gap_at_equal_steps((26.81, 1.04), [*runs, (0.0, None)]) == steady
    # a search window that ran slow steps reads as the machine's, not the config's: equal at equal speed
    assert gap_at_equal_steps((20.0, 1.5), [(30.0, 1.0), (30.0, 1.0)]) == 0.0
    assert gap_at_equal_steps((26.81, None), runs) is None
    assert gap_at_equal_steps((26.81, 1.04), [(25.70, 1.11), (24.50, None)]) is None
