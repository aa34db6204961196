"""The early-stopping rule (pipeline/decide/stopping.py) on synthetic surfaces: a clearly slow config stops early, a noisy
winner never stops, and the edge cases (too few requests, zero spread, failed requests, bad input)."""

import math

import numpy as np
import pytest

from pipeline.measure.summary import RequestRecord
from pipeline.decide.stopping import BaselineFigures, Decision, Rule, StoppingPolicy, VerifyCost, check, t_quantile

TOKENS = 24
# A CPU engine verify-cost curve (fp32 forward, 2 threads, `benchmarks/cpu_engine_ab.py --only verify` at commit 04695d1).
CURVE = VerifyCost(sizes=tuple(range(1, 17)), relative=(1.00, 0.99, 1.19, 1.45, 1.38, 1.75, 1.78, 1.78, 1.88, 2.05,
                                                         2.17, 2.17, 2.31, 2.39, 2.47, 2.07))
BASE = BaselineFigures(tput_tok_s=10.0, sigma=0.03, runs=3, step_s=0.09)


def record(i, tput, accept=None, error=None, tokens=TOKENS):
    return RequestRecord(request_id=f"r{i}", phase="measure", prompt_index=i, concurrency=1, start_s=float(i),
                         ttft_s=0.05, e2e_s=tokens / tput, prompt_tokens=12, completion_tokens=tokens,
                         spec_verify_ct=max(1, round(tokens / accept)) if accept else None,
                         finish_reason="error" if error else "length", error=error)


def simulate(rng, mean, n, request_sd, run_sd, accept=None):
    run = run_sd * rng.standard_normal()
    return [record(i, mean * math.exp(run + request_sd * rng.standard_normal()), accept) for i in range(n)]


def first_stop(records, total, draft_tokens=0, curve=None, base=BASE):
    for k in range(1, len(records) + 1):
        result = check(base, records[:k], total_requests=total, draft_tokens=draft_tokens, max_new_tokens=TOKENS,
                       verify_cost=curve)
        if result.stop:
            return k, result
    return None, result


def test_a_clearly_slow_config_is_stopped_early_by_its_throughput():
    rng = np.random.default_rng(0)
    for _ in range(20):
        k, result = first_stop(simulate(rng, 5.0, 16, 0.1, 0.03), 16)
        assert k is not None and k <= 8, result.reason  # half the measurement saved at least
        assert result.rule is Rule.STATISTICAL and result.decision is Decision.STOP
        assert result.statistical_high_tok_s < result.baseline_low_tok_s
        assert "upper confidence bound" in result.reason and f"after {k} of 16" in result.reason


def test_a_low_accept_length_with_a_dear_verify_is_stopped_by_the_analytic_bound_where_throughput_is_no_proof():
    # draft 8 (N = 9, 1.88x a decode step) accepting 1.1 tokens per step: ~0.65x the baseline's decode speed at
    # best, while its throughput figures (9 tok/s, as if measured on a faster run) cannot be told from 10 tok/s.
    records = [record(i, 9.0, accept=1.1) for i in range(16)]
    k, result = first_stop(records, 16, draft_tokens=8, curve=CURVE)
    assert k is not None and k < 16 and result.rule is Rule.ANALYTIC, result.reason
    assert result.analytic_high_tok_s < result.baseline_low_tok_s
    assert "accept length so far" in result.reason
    assert first_stop(records, 16, draft_tokens=0)[0] is None  # the statistical rule alone never stops it
    # Without a curve (SGLang: cost 1, the baseline's step time) the same accept length is no proof.
    assert first_stop(records, 16, draft_tokens=8, curve=None)[0] is None


def test_the_analytic_bound_allows_for_perfect_acceptance_of_the_remaining_requests():
    one = [record(0, 6.0, accept=1.3)]
    early = check(BASE, one, total_requests=4, draft_tokens=2, max_new_tokens=TOKENS, verify_cost=CURVE)
    late = check(BASE, one, total_requests=1, draft_tokens=2, max_new_tokens=TOKENS, verify_cost=CURVE)
    assert early.analytic_high_tok_s is not None and late.analytic_high_tok_s is not None
    assert early.analytic_high_tok_s > late.analytic_high_tok_s
    assert early.decision is Decision.CONTINUE  # 3 perfect requests could still lift accept length towards 3


@pytest.mark.parametrize("speedup", [1.0, 1.02, 1.1, 1.5])
def test_a_noisy_winner_is_never_stopped(speedup):
    """Candidates at least as fast as the baseline, with per-request spread 20% and the run effect, over many
    seeds and every look; the analytic rule with the true accept length too."""
    rng = np.random.default_rng(int(speedup * 100))
    stops = 0
    for _ in range(400):
        records = simulate(rng, 10.0 * speedup, 8, 0.2, BASE.sigma, accept=2.5)
        k, _ = first_stop(records, 8, draft_tokens=3, curve=CURVE)
        stops += k is not None
    assert stops == 0


def test_the_false_stop_rate_at_equal_speed_stays_within_the_stated_bound():
    policy = StoppingPolicy()
    rng = np.random.default_rng(5)
    looks, seeds, stops = 4 - policy.min_requests + 1, 2000, 0
    for _ in range(seeds):
        stops += first_stop(simulate(rng, 10.0, 4, 0.3, BASE.sigma), 4)[0] is not None
    assert stops / seeds <= 2 * policy.alpha * looks


def test_too_few_requests_give_no_statistical_bound():
    result = check(BASE, [record(0, 1.0)], total_requests=4, draft_tokens=0, max_new_tokens=TOKENS)
    assert result.decision is Decision.CONTINUE and result.statistical_high_tok_s is None
    assert "no bound yet" in result.reason
    assert check(BASE, [], total_requests=4, draft_tokens=0, max_new_tokens=TOKENS).partial_tok_s is None


def test_zero_spread_is_floored_so_two_identical_requests_prove_nothing_close_to_the_baseline():
    same = [record(i, 9.0) for i in range(2)]
    assert not check(BASE, same, total_requests=4, draft_tokens=0, max_new_tokens=TOKENS).stop
    no_noise = BaselineFigures(tput_tok_s=10.0, sigma=0.0)
    floored = check(no_noise, [record(i, 9.0) for i in range(4)], total_requests=4, draft_tokens=0,
                    max_new_tokens=TOKENS)
    unfloored = check(no_noise, [record(i, 9.0) for i in range(4)], total_requests=4, draft_tokens=0,
                      max_new_tokens=TOKENS, policy=StoppingPolicy(request_spread_floor=0.0))
    assert not floored.stop and unfloored.stop  # the floor is what keeps 4 identical figures from being proof


def test_failed_requests_are_left_out_and_never_stop_a_trial():
    records = [record(0, 9.0, error="boom"), record(1, 9.5, error="lost"), record(2, 10.0)]
    result = check(BASE, records, total_requests=4, draft_tokens=0, max_new_tokens=TOKENS)
    assert result.decision is Decision.CONTINUE and result.requests == 1 and "2 failed, left out" in result.reason
    slow = [record(i, 1.0, error="x") for i in range(4)]
    assert not check(BASE, slow, total_requests=4, draft_tokens=0, max_new_tokens=TOKENS).stop


def test_bad_input_names_the_field_and_the_value():
    with pytest.raises(ValueError, match="total_requests=0"):
        check(BASE, [], total_requests=0, draft_tokens=0, max_new_tokens=TOKENS)
    with pytest.raises(ValueError, match="3 measured records but total_requests=2"):
        check(BASE, [record(i, 9.0) for i in range(3)], total_requests=2, draft_tokens=0, max_new_tokens=TOKENS)
    with pytest.raises(ValueError, match="tput_tok_s"):
        BaselineFigures(tput_tok_s=0.0, sigma=0.1)
    with pytest.raises(ValueError, match="equal length"):
        VerifyCost(sizes=(1, 2), relative=(1.0,))
    with pytest.raises(ValueError, match="increasing"):
        VerifyCost(sizes=(2, 1), relative=(1.0, 1.0))
    with pytest.raises(ValueError, match="extra"):
        StoppingPolicy.model_validate({"alpah": 0.1})


def test_verify_cost_reads_server_info_and_never_goes_below_a_decode_step():
    info = {"verify_cost": {"sizes": [1, 2, 4, 8], "ms": [100, 92, 150, 200], "relative": [1.0, 0.92, 1.5, 2.0],
                            "source": "cache"}}
    curve = VerifyCost.from_server_info(info)
    assert curve is not None
    assert VerifyCost.from_server_info({"verify_cost": None}) is None
    assert [curve.cost(n) for n in (1, 2, 3, 4, 7, 8, 16)] == [1.0, 1.0, 1.0, 1.5, 1.5, 2.0, 2.0]


def test_t_quantiles_match_published_tables():
    for df, p, value in ((1, 0.999, 318.309), (2, 0.999, 22.327), (3, 0.975, 3.182), (4, 0.999, 7.173),
                         (10, 0.95, 1.812), (30, 0.999, 3.385)):
        assert t_quantile(p, df) == pytest.approx(value, abs=1e-3)
