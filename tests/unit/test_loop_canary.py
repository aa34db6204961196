"""The canary decision (pipeline/loop/canary.py): candidate worse -> rollback, better -> promote, SLA breach ->
rollback, on live records of both arms; shares step up, and a lighter-loaded candidate is not promoted for that."""

from __future__ import annotations

import random

import pytest

from pipeline.config import PromotionPolicy, SlaConstraint
from pipeline.loop.canary import CanarySettings, block_throughputs, canary_decision
from serve.closed_loop.live import LiveRecord
from serve.spec import NgramSpec

SETTINGS = CanarySettings(min_requests_per_step=60, blocks=5)
POLICY = PromotionPolicy()
SPEC = NgramSpec(algorithm="ngram", num_draft_tokens=4)
LAST = len(SETTINGS.shares) - 1


def records(arm: str, n: int, tok_s: float, *, seed: int, concurrency: int = 1, errors: int = 0,
            ttft_s: float = 0.05, span_ms: int = 600_000) -> list[LiveRecord]:
    """`n` answers spread evenly over the same `span_ms` (so every arm and bucket covers the whole step)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        rate = tok_s * (1 + rng.uniform(-0.05, 0.05))
        out.append(LiveRecord(seq=i, t_ms=i * span_ms // n + rng.randint(0, 99), version="2" if arm == "candidate"
                              else "1", arm=arm, route="low", api="/v1/chat/completions", concurrency=concurrency,
                              status=500 if i < errors else 200, streamed=True, prompt_tokens=30, completion_tokens=64,
                              e2e_s=64 / rate, ttft_s=ttft_s, itl_s=(0.02, 0.03), spec_verify_ct=20))
    return out


def decide_step(production, candidate, step=LAST, constraints=(), elapsed_s=600.0):
    return canary_decision(SETTINGS, POLICY, list(constraints), step, production, candidate, SPEC, elapsed_s)


def test_a_faster_candidate_is_promoted_at_the_last_step():
    d = decide_step(records("production", 600, 20.0, seed=1), records("candidate", 300, 26.0, seed=2))
    assert d.action == "promote", d.reason
    assert d.decision is not None and d.decision.kind == "promote" and len(d.candidate.blocks) == 5
    assert "beats the bar" in d.reason and d.reason.startswith("canary step 3/3 (share 0.5)")


def test_a_slower_candidate_rolls_back_at_the_first_step_and_at_the_last():
    first = decide_step(records("production", 900, 20.0, seed=3), records("candidate", 100, 14.0, seed=4), step=0)
    last = decide_step(records("production", 600, 20.0, seed=3), records("candidate", 300, 14.0, seed=4))
    assert first.action == "rollback" and "clearly slower" in first.reason
    assert last.action == "rollback" and "does not beat the bar" in last.reason


def test_an_equal_candidate_steps_up_but_is_not_promoted():
    step = decide_step(records("production", 900, 20.0, seed=5), records("candidate", 100, 20.0, seed=6), step=0)
    last = decide_step(records("production", 600, 20.0, seed=5), records("candidate", 300, 20.0, seed=6))
    assert (step.action, step.next_share) == ("continue", 0.25)
    assert last.action == "rollback"


def test_an_sla_breach_rolls_back_even_a_faster_candidate():
    limit = SlaConstraint(metric="ttft_p90_ms", max_ms=100.0)
    d = decide_step(records("production", 600, 20.0, seed=7, ttft_s=0.05),
                    records("candidate", 300, 30.0, seed=8, ttft_s=0.2), constraints=[limit])
    assert d.action == "rollback"
    assert "candidate ttft_p90_ms 200.0 ms > limit 100 ms at every level (production 50.0 ms)" in d.reason


def test_a_limit_both_arms_break_is_not_the_candidates_fault_when_it_is_no_worse():
    limit = SlaConstraint(metric="ttft_p90_ms", max_ms=100.0)
    d = decide_step(records("production", 600, 20.0, seed=7, ttft_s=0.3),
                    records("candidate", 300, 26.0, seed=8, ttft_s=0.25), constraints=[limit])
    assert d.action == "promote", d.reason
    assert [v.ok for v in d.verdicts] == [False]


def test_more_errors_than_production_roll_back():
    d = decide_step(records("production", 600, 20.0, seed=9, errors=1), records("candidate", 300, 30.0, seed=10,
                                                                             errors=12))
    assert d.action == "rollback" and "candidate error rate 4.0% (12/300)" in d.reason


def test_a_step_waits_for_enough_requests_then_gives_up():
    short = records("candidate", 20, 30.0, seed=11)
    assert decide_step(records("production", 100, 20.0, seed=12), short, step=0, elapsed_s=60).action == "continue"
    late = decide_step(records("production", 100, 20.0, seed=12), short, step=0, elapsed_s=SETTINGS.max_step_s + 1)
    assert late.action == "rollback" and "not enough traffic" in late.reason


def test_a_lighter_loaded_candidate_is_compared_at_equal_concurrency():
    # Per bucket the two configs are equally fast; production carries most of its requests at 5-8 in flight.
    production = records("production", 120, 20.0, seed=13) + records("production", 480, 10.0, seed=14,
                                                                        concurrency=8)
    candidate = records("candidate", 250, 20.0, seed=15) + records("candidate", 50, 10.0, seed=16, concurrency=8)
    naive_p = sum(r.completion_tokens for r in production) / sum(r.e2e_s for r in production)
    naive_c = sum(r.completion_tokens for r in candidate) / sum(r.e2e_s for r in candidate)
    assert naive_c > 1.3 * naive_p  # what an unstratified comparison would see
    p_blocks, c_blocks = block_throughputs(production, candidate, 5)
    assert len(p_blocks) == 5 and all(abs(c / p - 1) < 0.1 for p, c in zip(p_blocks, c_blocks))
    assert decide_step(production, candidate).action == "rollback"


def test_canary_settings_name_the_rule_they_break():
    with pytest.raises(ValueError, match=r"shares must increase.*start_share=0.5, steps=\[0.25\]"):
        CanarySettings(start_share=0.5, steps=(0.25,))
    with pytest.raises(ValueError, match="blocks=5 is below promotion.runs=6"):
        canary_decision(SETTINGS, PromotionPolicy(runs=6), [], 0, [], [], SPEC, 0.0)
