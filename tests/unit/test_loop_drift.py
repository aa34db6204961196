"""The drift test (pipeline/loop/drift.py): no alarm on stationary traffic at the stated rate, an alarm within a
bounded number of requests after a step change, and a detector that survives a restart. The rates come from the
seeded simulation of `pipeline.loop.drift_check` (one test per claim, many seeds inside)."""

from __future__ import annotations

import pytest

from pipeline.loop.drift import (DetectorState, DriftSettings, MetricReference, boundaries, metric_reference, update,
                                 verdict)
from pipeline.loop.drift_check import delays, false_alarms

SETTINGS = DriftSettings()


@pytest.mark.parametrize("population", ["accept", "tput", "mixed"])
def test_stationary_traffic_raises_no_alarm_at_the_stated_rate(population):
    # docs/loop.md states 0.05-0.20% of stationary 20,000-request streams alarm (1-4 of 2000 per population, from
    # `python -m pipeline.loop.drift_check --seeds 2000`). Here 100 seeded studies x 5000 requests each: at that rate
    # no alarm is expected (an alarm in 1 of 100 would be 5x the stated rate at a quarter of the length).
    assert false_alarms(SETTINGS, range(100), population=population, requests=5000) == 0


def test_a_40_percent_drop_in_accept_length_alarms_within_200_requests():
    found = delays(SETTINGS, range(1000, 1100), drop=0.4, at=300, population="accept", requests=800)
    within = [d for d in found if d is not None and d <= 200]
    assert len(within) >= 95, sorted(d if d is not None else -1 for d in found)
    assert all(d is None or d > 0 for d in found)  # no seed alarmed before the step


def test_a_small_drop_inside_the_tolerance_band_is_not_drift():
    found = delays(SETTINGS, range(2000, 2050), drop=0.03, at=100, population="accept", requests=3000)
    assert found.count(None) == 50


def reference(mean: float = 2.0, sd: float = 0.4, se: float = 0.05, prompts: int = 16) -> MetricReference:
    return MetricReference(metric="accept_length", level=1, requests=prompts * 3, prompts=prompts, mean=mean, sd=sd,
                           se=se)


def test_boundaries_widen_with_the_references_uncertainty():
    tight, loose = boundaries(reference(se=0.01), SETTINGS), boundaries(reference(se=0.2), SETTINGS)
    assert tight[0] == pytest.approx(2.0 - 2.0 * 0.01 - 0.05 * 2.0)
    assert loose[0] < tight[0] and loose[0] - loose[1] == pytest.approx(0.15 * 2.0)


def test_the_reference_counts_prompts_not_repeated_runs():
    # 4 prompts measured 3 times each: the mean's uncertainty comes from the 4 prompt means, not 12 requests.
    values = [(str(p), v + run * 0.001) for run in range(3) for p, v in enumerate([1.0, 2.0, 3.0, 4.0])]
    ref = metric_reference("accept_length", 4, values)
    assert ref is not None and ref.prompts == 4 and ref.requests == 12
    assert ref.se == pytest.approx(0.6455, abs=1e-3)  # stdev([1, 2, 3, 4]) = 1.291, over sqrt(4) prompts
    assert metric_reference("accept_length", 1, []) is None


def test_a_detector_fed_in_pieces_across_restarts_equals_one_fed_at_once():
    values = [2.0 - 0.01 * (i % 7) - (0.9 if i > 100 else 0.0) for i in range(300)]
    ref, start = reference(), DetectorState(metric="accept_length", bucket=1)
    whole = update(start, ref, SETTINGS, values)
    state = start
    for first in range(0, 300, 37):  # each piece saved and read back, as the loop's state file does
        state = DetectorState.model_validate_json(update(state, ref, SETTINGS, values[first:first + 37])
                                                  .model_dump_json())
    assert state == whole
    assert whole.alarm_at is not None and 100 < whole.alarm_at <= 140


def test_the_verdict_says_the_figures_it_decided_on():
    state = update(DetectorState(metric="accept_length", bucket=4), reference(), SETTINGS, [1.0] * 64)
    said = verdict(state, reference(), SETTINGS)
    assert said.alarm and said.drop == pytest.approx(0.5)
    assert said.text.startswith("DRIFT: accept length at concurrency 3-4 (study level 1): live mean 1 over 64")
    assert "CUSUM" in said.text and "of 8" in said.text
