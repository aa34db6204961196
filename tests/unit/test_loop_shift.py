"""The workload-shift signal (pipeline/loop/shift.py): KS on request lengths, n-gram overlap of the live text with the
tuned-on workload, each flagged only past its documented threshold."""

from __future__ import annotations

import random

import pytest

from pipeline.loop.shift import ShiftSettings, ks_distance, ks_pvalue, length_shift, ngrams, shift_report, text_shift

SETTINGS = ShiftSettings()


def test_ks_distance_of_two_small_samples_by_hand():
    # F_a jumps at 1, 2, 3 by 1/3; F_b at 2, 3, 4, 5 by 1/4. At x=1: |1/3 - 0| ; at x=3: |1 - 1/2| = 1/2 (the max).
    assert ks_distance([1, 2, 3], [2, 3, 4, 5]) == pytest.approx(0.5)
    assert ks_distance([1, 1, 2], [1, 1, 2]) == 0.0


def test_the_p_value_falls_as_the_samples_grow_for_one_distance():
    assert ks_pvalue(0.2, 20, 20) > 0.3 > ks_pvalue(0.2, 100, 100) > 1e-3 > ks_pvalue(0.2, 1000, 1000)
    assert ks_pvalue(0.0, 50, 50) == 1.0


def test_lengths_from_the_same_distribution_are_not_a_shift_and_longer_prompts_are():
    rng = random.Random(0)
    study = [rng.randint(20, 60) for _ in range(200)]
    same = length_shift("prompt_tokens", study, [rng.randint(20, 60) for _ in range(3000)], SETTINGS)
    longer = length_shift("prompt_tokens", study, [rng.randint(50, 200) for _ in range(3000)], SETTINGS)
    assert same is not None and not same.shifted
    assert longer is not None and longer.shifted and longer.live_median > longer.reference_median
    assert length_shift("prompt_tokens", study, study[:5], SETTINGS) is None  # too few live requests


def _texts(vocabulary: list[str], count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(vocabulary) for _ in range(30)) for _ in range(count)]


def test_text_from_the_workloads_vocabulary_overlaps_and_new_text_does_not():
    old = [f"w{i}" for i in range(12)]
    new = [f"z{i}" for i in range(12)]
    study = _texts(old, 60, 1)
    same = text_shift(study, _texts(old, 60, 2), SETTINGS)
    moved = text_shift(study, _texts(new, 60, 3), SETTINGS)
    assert same is not None and not same.shifted and same.ratio is not None and same.ratio > 0.8
    assert moved is not None and moved.shifted and moved.overlap == 0.0
    assert text_shift(study, study[:10], SETTINGS) is None


def test_ngrams_are_words_and_punctuation_lower_cased():
    assert ngrams("Def add(a, b):", 2) == {("def", "add"), ("add", "("), ("(", "a"), ("a", ","), (",", "b"),
                                           ("b", ")"), (")", ":")}


def test_the_report_names_what_shifted_and_what_could_not_be_tested():
    rng = random.Random(4)
    report = shift_report({"prompt_tokens": [rng.randint(10, 20) for _ in range(100)], "completion_tokens": [8] * 3},
                          {"prompt_tokens": [rng.randint(100, 200) for _ in range(100)], "completion_tokens": [8] * 50},
                          [], [], SETTINGS)
    assert report.shifted
    assert report.summary.startswith("workload SHIFTED: prompt_tokens: median")
    assert "completion_tokens: too few requests to test" in report.summary
    assert "text: not tested" in report.summary
