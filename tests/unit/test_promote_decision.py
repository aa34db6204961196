"""pipeline.decide.decision (docs/design.md, "Promotion"). Scores are hand-computed: score = median - 1.4826 * MAD; the bar is the baseline
MEDIAN + max(margin x median, 1.4826 x MAD)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipeline.config import PromotionPolicy
from pipeline.decide.decision import Finalist, decide, run_stats
from serve.spec import NgramSpec

BASE = [100.0, 100.0, 100.0]  # median 100, MAD 0; default bar = 100 + 3% = 103


def fin(fid: str, runs, *, drafts: int = 3, equivalent: bool = True) -> Finalist:
    return Finalist(id=fid, throughputs=tuple(runs), draft_tokens=drafts, equivalent=equivalent)


def by_id(decision, fid):
    return next(c for c in decision.candidates if c.id == fid)


def test_run_stats_median_mad_score():
    # [10, 12, 15]: median 12, |dev| = 2, 0, 3 -> MAD 2, score 12 - 2.9652 = 9.0348.
    s = run_stats([15, 10, 12])
    assert (s.median, s.mad) == (12, 2)
    assert s.score == pytest.approx(9.0348)


def test_promotes_a_clear_winner():
    d = decide(BASE, [fin("ngram-k4", [120, 121, 119])])
    assert d.kind == "promote" and d.winner == "ngram-k4"
    assert d.bar == pytest.approx(103.0)
    # median 120, MAD 1 -> score 118.5174
    assert by_id(d, "ngram-k4").score == pytest.approx(118.5174)
    assert by_id(d, "ngram-k4").lost_because is None
    assert d.reason.startswith("promote: 'ngram-k4' scored 118.52")


def test_keep_baseline_when_nothing_beats_it():
    d = decide(BASE, [fin("a", [102, 102, 102]), fin("b", [90, 95, 100])])
    assert d.kind == "keep_baseline" and d.winner is None
    assert "does not beat the bar 103.00" in by_id(d, "a").lost_because
    assert d.reason.startswith("keep baseline: no finalist beats the bar 103.00")
    assert "'a' scored 102.00" in d.reason


def test_keep_baseline_when_the_best_fails_equivalence():
    d = decide(BASE, [fin("fast-but-wrong", [150, 150, 150], equivalent=False), fin("slow", [101, 101, 101])])
    assert d.kind == "keep_baseline"
    assert "failed an equivalence check" in by_id(d, "fast-but-wrong").lost_because
    assert "disqualified for failing an equivalence check: ['fast-but-wrong']" in d.reason


def test_a_disqualified_best_does_not_block_an_equivalent_finalist_that_beats_the_bar():
    d = decide(BASE, [fin("fast-but-wrong", [150, 150, 150], equivalent=False), fin("ok", [110, 110, 110])])
    assert d.winner == "ok"


def test_equivalence_can_be_waived_by_policy():
    d = decide(BASE, [fin("bf16", [150, 150, 150], equivalent=False)],
               PromotionPolicy(require_equivalence=False))
    assert d.winner == "bf16"
    assert "FAILED an equivalence check" in d.reason


def test_noise_eats_the_gain():
    # Median 150 but MAD 50: score 150 - 74.13 = 75.87 < 103. A steady +10% finalist wins instead.
    d = decide(BASE, [fin("noisy", [100, 150, 200]), fin("steady", [110, 110, 111])])
    assert by_id(d, "noisy").score == pytest.approx(75.87)
    assert d.winner == "steady"
    d = decide(BASE, [fin("noisy", [100, 150, 200])])
    assert d.kind == "keep_baseline"


# --- issue #15 item 11: the bar never drops below the baseline's median ----------------------------------------

def test_a_noisy_baseline_never_lowers_the_bar_below_its_median():
    # Baseline [80, 100, 120]: median 100, MAD 20 -> noise 29.652 > 3% margin; bar 129.652. The old rule (bar = the
    # baseline's noise-lowered score 70.35 + 3%) promoted a steady 90, slower than the baseline's median.
    d = decide([80, 100, 120], [fin("slower", [90, 90, 90])])
    assert d.kind == "keep_baseline" and d.winner is None
    assert d.bar == pytest.approx(129.652)
    assert "baseline median 100.00 + its noise 1.4826 x MAD = 29.65" in by_id(d, "slower").lost_because


def test_a_noisy_baseline_raises_the_bar_by_its_noise_not_just_the_margin():
    # 120 beats median + 3% (103) but not median + noise (129.65): the gain is within the baseline's scatter.
    assert decide([80, 100, 120], [fin("a", [120, 120, 120])]).kind == "keep_baseline"
    assert decide([80, 100, 120], [fin("a", [130, 130, 130])]).winner == "a"


def test_a_failed_baseline_rerun_reported_as_zero_keeps_the_baseline():
    # Baseline [100, 0, 0]: the old rule gave median 0, bar 0 and promoted anything.
    d = decide([100, 0, 0], [fin("a", [90, 90, 90])])
    assert d.kind == "keep_baseline" and d.bar is None
    assert d.reason.startswith("keep baseline: 2 of 3 baseline re-run(s) failed")
    assert "re-run the promotion" in d.reason
    assert "baseline re-run(s) failed" in by_id(d, "a").lost_because


def test_one_failed_baseline_rerun_invalidates_even_a_clear_win():
    d = decide([100, 100, 100], [fin("a", [200] * 3)], baseline_failures=["final-baseline-run1: engine died"])
    assert d.kind == "keep_baseline"
    assert "final-baseline-run1: engine died" in d.reason


def test_a_finalist_with_a_failed_rerun_cannot_win():
    d = decide(BASE, [fin("flaky", [200, 0, 200]), fin("steady", [110] * 3)])
    assert d.winner == "steady"
    assert "1 of its re-runs failed" in by_id(d, "flaky").lost_because
    assert "disqualified for a failed re-run: ['flaky']" in d.reason
    d = decide(BASE, [fin("flaky", [200] * 3).model_copy(update={"failures": ("run2: timeout",)})])
    assert d.kind == "keep_baseline" and "run2: timeout" in by_id(d, "flaky").lost_because


def test_tie_prefers_fewer_draft_tokens():
    # Best 130; the 1% tie band is [128.7, 130]. 'k4' (129) ties and has fewer drafts than 'k8'; 'k2' (128) is
    # outside the band despite its even fewer drafts.
    d = decide(BASE, [fin("k8", [130] * 3, drafts=7), fin("k4", [129] * 3, drafts=3), fin("k2", [128] * 3, drafts=1)])
    assert d.winner == "k4"
    assert "more draft tokens (7 > 3)" in by_id(d, "k8").lost_because
    assert "trails the best, 'k8' (130.00), by more than the 1.0% tie tolerance" in by_id(d, "k2").lost_because
    assert "chosen over ['k8']" in d.reason


def test_without_a_tie_the_higher_score_wins_even_with_more_drafts():
    d = decide(BASE, [fin("k8", [130] * 3, drafts=7), fin("k4", [120] * 3, drafts=3)])
    assert d.winner == "k8"


def test_margin_edge_must_be_beaten_strictly():
    policy = PromotionPolicy(margin=0.25)  # bar = 125 exactly
    assert decide(BASE, [fin("a", [125] * 3)], policy).kind == "keep_baseline"
    assert decide(BASE, [fin("a", [125.5] * 3)], policy).winner == "a"


def test_draft_tokens_come_from_the_spec():
    f = Finalist(id="ng", throughputs=(1, 2, 3), equivalent=True, spec=NgramSpec(num_draft_tokens=5))
    assert f.n_draft_tokens == 4


def test_no_finalists_keeps_the_baseline():
    d = decide(BASE, [])
    assert d.kind == "keep_baseline" and d.reason == "keep baseline: no finalists were given"


# --- bad input --------------------------------------------------------------------------------------------------

def test_too_few_finalist_runs_names_the_finalist_and_count():
    with pytest.raises(ValueError, match=r"finalist 'k4' has 2 throughput run\(s\); policy.runs=3"):
        decide(BASE, [fin("k4", [120, 121])])


def test_too_few_baseline_runs():
    with pytest.raises(ValueError, match=r"baseline has 2 throughput run\(s\)"):
        decide([100, 100], [fin("a", [120] * 3)])


def test_min_runs_below_three_is_rejected():
    with pytest.raises(ValidationError, match="runs"):
        PromotionPolicy(runs=2)


def test_duplicate_finalist_ids():
    with pytest.raises(ValueError, match="finalist id 'a' appears twice"):
        decide(BASE, [fin("a", [120] * 3), fin("a", [121] * 3)])


@pytest.mark.parametrize("runs", [(100, -1, 100), (100, float("nan"), 100)])
def test_bad_throughput_values(runs):
    with pytest.raises(ValidationError):
        fin("a", runs)


def test_finalist_needs_spec_or_draft_tokens_and_they_must_agree():
    with pytest.raises(ValidationError, match="give spec or draft_tokens"):
        Finalist(id="x", throughputs=(1, 2, 3), equivalent=True)
    with pytest.raises(ValidationError, match="draft_tokens=2 disagrees with its spec, which asks for 4"):
        Finalist(id="x", throughputs=(1, 2, 3), equivalent=True, spec=NgramSpec(num_draft_tokens=5), draft_tokens=2)


def test_policy_rejects_unknown_keys():
    with pytest.raises(ValidationError, match="extra"):
        PromotionPolicy.model_validate({"margins": 0.1})


def test_the_study_file_and_the_decision_share_one_policy_type():
    from pipeline.config import load_study

    policy = load_study(None, {"promotion.margin": 0.25}).promotion
    assert isinstance(policy, PromotionPolicy)
    assert decide(BASE, [fin("a", [125] * 3)], policy).kind == "keep_baseline"
