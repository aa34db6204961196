"""pipeline.decide.noise and the equivalence modes (`pipeline.decide.equivalence.judge`) on hand-made outputs: the
baseline against itself, the sign test of `baseline-noise` (lossless drift passes, wrong tokens fail, equal run counts
on both sides), and its false-reject rate and power on a simulated engine whose outputs flip at random near-ties."""

from __future__ import annotations

import random
from typing import cast

import pytest

from pipeline.config import PromotionPolicy
from pipeline.config.policy import min_items
from pipeline.decide.equivalence import Gate, StoredBaseline, judge, judge_pass
from pipeline.decide.noise import (agreement, binomial_tail, noise_test, pair_divergence, run_outputs,
                                   self_divergence)
from pipeline.measure.measurement import Measurement
from pipeline.measure.summary import RequestRecord
from pipeline.vocabulary.outcome import Outcome
from serve.spec import NgramSpec, NoSpec

BASE = {(p, 0): tuple(range(10 * p, 10 * p + 10)) for p in range(8)}


def changed(outputs, at: dict[int, int], fill: int = -1):
    """`outputs` with prompt p's tokens from position at[p] on replaced (a divergence at that position)."""
    return {k: (v[:at[k[0]]] + (fill,) * (len(v) - at[k[0]]) if k[0] in at else v) for k, v in outputs.items()}


def records(outputs, *, fail=()):
    return [RequestRecord(request_id=f"r{p}-{n}", phase="measure", prompt_index=p, concurrency=4, start_s=float(i),
                          ttft_s=0.1, e2e_s=1.0, prompt_tokens=5, completion_tokens=len(ids),
                          finish_reason="length", error="boom" if p in fail else None, output_ids=ids)
            for i, ((p, n), ids) in enumerate(sorted(outputs.items()))]


def test_agreement_and_binomial_tail():
    assert agreement((1, 2, 3, 4), (1, 2, 9, 4)) == 0.5
    assert agreement((), ()) == 1.0 and agreement((1,), (2,)) == 0.0
    assert agreement((1, 2), (1, 2, 3, 4)) == 0.5  # an early stop is a divergence at the shorter length
    assert binomial_tail(5, 5) == 1 / 32 and binomial_tail(0, 5) == 1.0 and binomial_tail(6, 5) == 0.0
    assert binomial_tail(2, 4) == pytest.approx(11 / 16)
    assert min_items(0.05) == 5 and binomial_tail(5, 5) < 0.05 < binomial_tail(4, 4)


def test_the_baseline_against_itself_reports_identical_share_positions_and_token_agreement():
    other = changed(BASE, {1: 6, 5: 2})
    third = changed(BASE, {1: 6})
    figures = self_divergence(8, [BASE, other, third])
    assert (figures.level, figures.runs, figures.pairs) == (8, 3, 24)
    # pairs: base-other differ on 1 (at 6) and 5 (at 2); base-third on 1 (at 6); other-third on 5 (at 2)
    assert figures.divergent == 4 and figures.identical_share == pytest.approx(20 / 24)
    assert figures.first_divergence_positions == (2, 2, 6, 6) and figures.first_divergence_p50 == 4.0
    assert figures.token_agreement == pytest.approx((240 - 4 - 8 - 4 - 8) / 240)
    assert pair_divergence(BASE, [BASE]).identical_share == 1.0
    # a prompt another run lost counts as no agreement there, not as identical
    assert pair_divergence(BASE, [{k: v for k, v in BASE.items() if k != (0, 0)}]).divergent == 1


def test_a_cycled_prompt_is_one_item_per_occurrence_and_failed_requests_are_not_items():
    outs = {(0, 0): (1, 2), (0, 1): (1, 3), (1, 0): (4,)}
    assert run_outputs(records(outs)) == outs
    assert run_outputs(records(outs, fail=(1,))) == {(0, 0): (1, 2), (0, 1): (1, 3)}


def test_lossless_drift_like_the_baselines_own_passes():
    other = changed(BASE, {1: 6, 5: 3})  # the baseline's second run drifts on two prompts
    candidate = changed(BASE, {2: 4, 6: 7}, fill=-2)  # the candidate on two others: as noisy, not more
    verdict = noise_test(BASE, [other], [candidate], alpha=0.05)
    assert verdict.passed and (verdict.worse, verdict.better, verdict.ties) == (2, 2, 4)
    assert verdict.p_value == pytest.approx(11 / 16)


def test_wrong_tokens_fail_against_any_noise():
    wrong = changed(BASE, {p: 0 for p in range(8)}, fill=-2)  # the first token of every answer is wrong
    other = changed(BASE, {1: 6, 5: 3})
    verdict = noise_test(BASE, [other], [wrong], alpha=0.05)
    assert not verdict.passed and verdict.worse == 8 and verdict.p_value == 1 / 256
    assert "worse than the baseline's own re-runs on 8 of 8" in verdict.reason


def test_a_config_diverging_earlier_on_every_prompt_fails_even_where_the_baseline_drifts_too():
    other = changed(BASE, {p: 8 for p in range(8)})  # the baseline drifts late on every prompt
    early = changed(BASE, {p: 2 for p in range(8)}, fill=-2)
    assert not noise_test(BASE, [other], [early], alpha=0.05).passed
    late = changed(BASE, {p: 9 for p in range(8)}, fill=-2)  # later than the baseline's own drift: better
    assert noise_test(BASE, [other], [late], alpha=0.05).passed


def test_equal_run_counts_on_both_sides():
    others = [changed(BASE, {1: 6}), changed(BASE, {5: 3})]
    verdict = noise_test(BASE, others, [BASE], alpha=0.05)  # one candidate run: one baseline run's noise
    assert verdict.runs_compared == 1 and verdict.worse == 0 and verdict.better == 1
    assert noise_test(BASE, others, [BASE, BASE, BASE], alpha=0.05).runs_compared == 2


def test_without_the_baselines_noise_nothing_is_claimed():
    verdict = noise_test(BASE, [], [BASE], alpha=0.05)
    assert not verdict.passed and verdict.reason.startswith("not compared: no other baseline run")
    with pytest.raises(ValueError, match="alpha"):
        noise_test(BASE, [BASE], [BASE], alpha=0.5)


def test_judge_per_mode():
    other = changed(BASE, {1: 6, 5: 3})
    drift = changed(BASE, {2: 4, 6: 7}, fill=-2)
    exact = judge("exact", records(BASE), [records(drift)])
    assert exact.mode == "exact" and not exact.passed and exact.noise is None
    noisy = judge("baseline-noise", records(BASE), [records(drift)], baseline_others=[records(other)])
    assert noisy.passed and noisy.noise is not None and noisy.identical_share == 0.75
    assert noisy.reason.startswith("passed: worse than the baseline's own re-runs on 2 of 4")
    deterministic = judge("deterministic", records(BASE), [records(BASE), records(drift)])
    assert deterministic.mode == "deterministic" and not deterministic.passed  # the worst run decides


def test_a_trials_gate_compares_with_the_baselines_noise_pass_and_without_one_claims_nothing():
    other = changed(BASE, {1: 6, 5: 3})
    drift = changed(BASE, {2: 4, 6: 7}, fill=-2)
    gate = Gate(setting="baseline-noise", algorithm="ngram", temperature=0.0, threshold=1.0, alpha=0.05)
    assert gate.stored_pass == "noise" and gate.reference_pass is None
    trial = Measurement(records=records(drift))
    without = judge_pass(trial, gate, StoredBaseline(tput_tok_s=10.0, requests=tuple(records(BASE))))
    assert (without.outcome, without.report) == (Outcome.COMPLETE, None)
    assert without.reason == "not compared: the baseline has no second pass to measure its own noise with"
    baseline = StoredBaseline(tput_tok_s=10.0, requests=tuple(records(BASE)), noise=tuple(records(other)))
    noisy = judge_pass(trial, gate, baseline)
    assert noisy.outcome is Outcome.COMPLETE and noisy.reason == "" and noisy.report == judge(
        "baseline-noise", records(BASE), [records(drift)], baseline_others=[records(other)])
    wrong = judge_pass(Measurement(records=records(changed(BASE, dict.fromkeys(range(8), 0), fill=-3))), gate,
                       baseline)
    assert wrong.outcome is Outcome.NOT_EQUIVALENT and wrong.reason.startswith("failed: ")
    # the same mode on a batch-invariant engine runs as itself; `deterministic` without flags runs as `exact`
    assert Gate(setting="deterministic", algorithm="ngram", temperature=0.0, threshold=1.0, alpha=0.05).mode == "exact"


def test_the_policy_keeps_the_threshold_for_exact_only():
    assert PromotionPolicy(equivalence_threshold=0.9).equivalence == "exact"
    with pytest.raises(ValueError, match="applies to equivalence: exact only"):
        PromotionPolicy(equivalence="baseline-noise", equivalence_threshold=0.9)
    with pytest.raises(ValueError, match="significance level"):
        PromotionPolicy(equivalence="baseline-noise", equivalence_alpha=0.7)


def _simulated_run(hazards, base_len: int, rng: random.Random, tail: int, scale: float = 1.0):
    """One run of a simulated engine: each item flips at a near-tie with probability hazard x scale per token, and
    emits a run-specific continuation after it (a flip never comes back)."""
    out = {}
    for k, h in enumerate(hazards):
        flip = next((t for t in range(base_len) if rng.random() < h * scale), base_len)
        out[(k, 0)] = tuple(range(flip)) + (tail,) * (base_len - flip)
    return out


def test_false_reject_rate_is_at_most_alpha_and_a_noisier_config_is_caught():
    """2000 simulated checks of 64 prompts x 64 tokens, every run drawing its flips independently from one hazard per
    prompt (0 to 1% per token): a candidate that is another draw of the same noise is refused at most alpha of the
    time; one flipping three times as often is refused in most checks."""
    rng = random.Random(7)
    alpha, checks = 0.05, 2000
    rejected = caught = 0
    for i in range(checks):
        hazards = [rng.uniform(0.0, 0.01) for _ in range(64)]
        ref, other, same = (_simulated_run(hazards, 64, rng, tail=-(n + 1)) for n in range(3))
        rejected += not noise_test(ref, [other], [same], alpha=alpha).passed
        if i < 200:
            worse = _simulated_run(hazards, 64, rng, tail=-9, scale=3.0)
            caught += not noise_test(ref, [other], [worse], alpha=alpha).passed
    se = (alpha * (1 - alpha) / checks) ** 0.5
    assert rejected / checks <= alpha + 3 * se, rejected / checks
    assert caught / 200 > 0.8, caught / 200


def test_a_not_equivalent_trial_never_tells_the_search_its_measurement():
    # Issue 40 item 3: under baseline-noise the reference measures decode kernels and a trial verify kernels over a
    # tree mask, so a NOT_EQUIVALENT verdict is not a false reject by luck alone: the worst value, as in every mode.
    from pipeline.config import load_study
    from pipeline.trial.gate import effective_mode

    assert [o for o in Outcome if o.reports_measurement] == [Outcome.COMPLETE, Outcome.PRUNED]
    # the CPU engine in fp32 is batch-invariant: deterministic equivalence is exact equivalence, no extra launch
    assert effective_mode(load_study(None, {"promotion.equivalence": "deterministic"})) == "exact"


def test_finalist_runs_are_judged_against_the_baseline_at_their_own_level():
    """The finalists stage compared every level's runs with the search level's baseline outputs; a batch-dependent
    engine gives the baseline other outputs at another level, so a lossless finalist failed there. Now each level's
    runs are judged against the baseline's runs at that level, in every mode."""
    from types import SimpleNamespace

    from pipeline.config import TrialConfig, load_study
    from pipeline.study.finalists import Pass, judge_level
    from pipeline.trial.lifecycle import Checked
    from pipeline.trial.context import TrialContext

    def passes(level, outputs_per_run, spec=None):
        config = TrialConfig(spec=spec or NgramSpec(num_draft_tokens=4), concurrency=level)
        return [Pass(f"r{k}", level, config, Checked(Measurement(records=records(o)), Outcome.COMPLETE, ""), 0.0)
                for k, o in enumerate(outputs_per_run)]

    at_one = changed(BASE, {p: 3 for p in range(8)}, fill=-5)  # the engine's outputs at concurrency 1
    base = {8: passes(8, [BASE, BASE, BASE], NoSpec()), 1: passes(1, [at_one, at_one, at_one], NoSpec())}
    for mode in ("exact", "baseline-noise"):
        study = load_study(None, {"promotion.equivalence": mode, "workload.measure_prompts": 8})
        ctx = cast(TrialContext, SimpleNamespace(study=study))  # judge_level reads only the context's study
        for level, outputs in ((8, BASE), (1, at_one)):
            verdicts = judge_level(ctx, TrialConfig(spec=NgramSpec(num_draft_tokens=4)),
                                   passes(level, [outputs] * 3), base[level])
            assert all(v[0] for v in verdicts), (mode, level, verdicts)
        wrong = judge_level(ctx, TrialConfig(spec=NgramSpec(num_draft_tokens=4)), passes(1, [BASE] * 3), base[1])
        assert not any(v[0] for v in wrong), (mode, wrong)
