"""Which of a config's re-runs is measured again (pipeline/decide/spread.py). Pure."""

from __future__ import annotations

import pytest

from pipeline.decide.spread import spread, suspect_run


def test_runs_within_the_limit_are_kept():
    assert suspect_run([44.73, 45.05, 41.0], 1.15) is None


def test_the_run_farthest_from_the_median_is_the_suspect():
    suspect = suspect_run([30.90, 44.73, 45.05], 1.15)  # one NGRAM re-run of a default study on AMD EPYC
    assert suspect is not None and suspect.index == 0
    assert suspect.median_tok_s == pytest.approx(44.73) and suspect.spread == pytest.approx(45.05 / 30.90)
    assert "1.45x below the runs' median 44.73" in suspect.line(1.15), suspect.line(1.15)


def test_a_fast_outlier_is_a_suspect_too():
    suspect = suspect_run([20.0, 20.5, 30.0], 1.15)
    assert suspect is not None and suspect.index == 2 and "above" in suspect.line(1.15)


def test_distance_is_a_ratio_and_ties_take_the_first():
    # 10 and 40 are both 2x from the median 20: the first is taken
    suspect = suspect_run([10.0, 20.0, 40.0], 1.15)
    assert suspect is not None and suspect.index == 0


def test_failed_runs_neither_count_nor_are_suspects():
    assert suspect_run([0.0, 30.0, 45.0], 1.15) is None  # two measured runs: neither can be told to be the odd one
    suspect = suspect_run([0.0, 30.0, 45.0, 44.0], 1.15)
    assert suspect is not None and suspect.index == 1
    assert spread([0.0, 30.0, 45.0]) == pytest.approx(1.5) and spread([0.0, 30.0]) is None
