"""pipeline.decide.equivalence: greedy outputs of a trial against the baseline, matched by prompt_index."""

from __future__ import annotations

import pytest

from pipeline.decide.equivalence import check_equivalence, common_prefix
from pipeline.measure.summary import RequestRecord, records_from_json, records_json, to_table


def out(prompt: int, ids, *, phase="measure", error=None, n=0) -> RequestRecord:
    return RequestRecord(
        request_id=f"p{prompt}-{n}-{phase}", phase=phase, prompt_index=prompt, concurrency=1, start_s=float(n),
        ttft_s=None if error else 0.1, e2e_s=1.0, prompt_tokens=5, completion_tokens=len(ids),
        finish_reason="error" if error else "length", error=error, output_ids=tuple(ids))


BASE = [out(0, [1, 2, 3, 4, 5]), out(1, [7, 8, 9, 10, 11])]


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], []) == 0


def test_identical_outputs_pass():
    r = check_equivalence(BASE, [out(1, [7, 8, 9, 10, 11]), out(0, [1, 2, 3, 4, 5])], threshold=1.0)
    assert r.passed and r.identical_share == 1.0
    assert (r.n_prompts, r.n_identical, r.n_compared) == (2, 2, 2)
    assert r.mean_prefix_tokens == 5.0 and r.mean_prefix_fraction == 1.0
    assert r.first_divergence == {}
    assert r.reason.startswith("passed: 2/2 outputs identical")


def test_divergence_position_and_prefix_means():
    # prompt 1 diverges at token 3 of 5: prefix means (5 + 3) / 2 = 4 tokens, (1 + 3/5) / 2 = 0.8.
    r = check_equivalence(BASE, [out(0, [1, 2, 3, 4, 5]), out(1, [7, 8, 9, 99, 11])], threshold=1.0)
    assert not r.passed
    assert r.identical_share == 0.5
    assert r.first_divergence == {1: 3}
    assert r.mean_prefix_tokens == 4.0
    assert r.mean_prefix_fraction == pytest.approx(0.8)
    assert "prompt 1 at token 3" in r.reason and "1/2 outputs identical (50.0%) < required 100.0%" in r.reason


def test_a_share_threshold_below_one_can_pass_with_a_divergence():
    r = check_equivalence(BASE, [out(0, [1, 2, 3, 4, 5]), out(1, [7, 8, 9, 99, 11])], threshold=0.5)
    assert r.passed and r.first_divergence == {1: 3}


def test_full_sequences_are_compared_an_early_stop_is_a_divergence():
    # Candidate stopped after 3 tokens (EOS): diverges at 3, fraction 3/5 of the longer output.
    r = check_equivalence(BASE[:1], [out(0, [1, 2, 3])], threshold=1.0)
    assert not r.passed
    assert r.first_divergence == {0: 3}
    assert r.mean_prefix_fraction == pytest.approx(0.6)


def test_missing_and_failed_prompts_count_against_the_share():
    cand = [out(0, [1, 2, 3, 4, 5]), out(1, [7, 8, 9, 10, 11], error="timeout"), out(2, [4, 4])]
    r = check_equivalence(BASE, cand, threshold=1.0)
    # Prompts {0, 1, 2}: only 0 is shown identical.
    assert (r.n_prompts, r.n_identical, r.n_compared) == (3, 1, 1)
    assert r.identical_share == pytest.approx(1 / 3)
    assert r.missing_in_candidate == (1,) and r.missing_in_baseline == (2,)
    assert not r.passed
    assert "no successful candidate output for prompts [1]" in r.reason


def test_warmup_outputs_are_ignored():
    cand = [out(0, [1, 2, 3, 4, 5]), out(1, [7, 8, 9, 10, 11]), out(5, [0, 0], phase="warmup")]
    assert check_equivalence(BASE, cand, threshold=1.0).passed


def test_repeated_prompt_is_identical_only_if_every_repeat_matches():
    base = [out(0, [1, 2, 3], n=0), out(0, [1, 2, 3], n=1)]
    assert check_equivalence(base, [out(0, [1, 2, 3], n=0), out(0, [1, 2, 3], n=1)], threshold=1.0).passed
    r = check_equivalence(base, [out(0, [1, 2, 3], n=0), out(0, [1, 9, 3], n=1)], threshold=1.0)
    assert not r.passed
    assert r.first_divergence == {0: 1}
    assert r.inconsistent == (0,)


def test_tables_are_accepted():
    r = check_equivalence(to_table(BASE), to_table([out(0, [1, 2, 3, 4, 5]), out(1, [7, 8, 9, 10, 11])]),
                          threshold=1.0)
    assert r.passed


def test_nothing_to_compare_does_not_pass():
    r = check_equivalence([], [], threshold=1.0)
    assert not r.passed and r.n_prompts == 0
    assert "cannot be shown" in r.reason


@pytest.mark.parametrize("threshold", [0.0, 1.5, -1, True])
def test_threshold_outside_zero_one_is_rejected(threshold):
    with pytest.raises(ValueError, match="threshold .* must be in \\(0, 1\\]"):
        check_equivalence(BASE, BASE, threshold=threshold)


def test_a_pass_kept_as_json_reads_back_as_the_same_measured_requests():
    warm = out(2, [4, 4], phase="warmup")
    assert records_from_json(records_json([*BASE, warm])) == BASE  # a pass's artifact holds its measured requests
