"""The step-cost model and the predicted figures: the round table's interpolation, the fit's one-launch and
two-launch cases (recovering known parameters), the prefill line, and a closed loop timed by hand."""

from __future__ import annotations

from typing import Literal

import pytest

from pipeline.config import TrialConfig
from pipeline.measure.load import LoadRequest
from pipeline.measure.summary import RequestRecord
from pipeline.simulate.cost import CostModel, Launch, RoundTable, fit_cost, prefill_fit, round_table
from pipeline.simulate.predict import predicted_metrics, timed
from pipeline.simulate.replay import Answer, ClosedLoop, Phase, Round, replay
from pipeline.simulate.simulator import Simulator, base_cost
from serve.spec import NgramSpec, NoSpec

TABLE = RoundTable(batches=[1, 2], widths=[1, 4], ms=[[10.0, 16.0], [14.0, 30.0]], lm_head_rows=[1, 8],
                   lm_head_ms=[1.0, 8.0], context_tokens=128, long_context_tokens=512, short_context_ms=10.0,
                   long_context_ms=13.84)


def test_the_round_table_interpolates_and_charges_the_lm_head_and_the_context():
    # b=1, w=2: a third of the way from 10 to 16 -> 12; logits of 1 + 1 real rows: +1 ms of head over the table's
    # one root row; context 256: +0.001 per token over 128 (13.84 / 10 - 1 = 0.384 over 384 tokens) -> x1.128
    assert TABLE.verify_ms(1, 2, 2, 128) == pytest.approx(13.0)
    assert TABLE.verify_ms(1, 2, 2, 256) == pytest.approx(13.0 * 1.128)
    assert TABLE.verify_ms(2, 4, 2, 128) == pytest.approx(30.0)  # 2 roots, no real node: the table's own rows
    assert TABLE.verify_ms(4, 4, 4, 128) == pytest.approx(58.0)  # batch 4: extrapolated, 30 + 2 x (30 - 16)
    assert round_table({"round_cost": TABLE.model_dump()}) == TABLE
    assert round_table({"sizes": [1]}) is None and round_table(None) is None


def rounds(width: int, n: int) -> tuple[Round, ...]:
    return tuple(Round((), width, (0,), (100,)) for _ in range(n))


def test_one_launch_fixes_the_scale_and_two_recover_both_parameters():
    prior = CostModel(shape="prior", k=1.0)
    # one plain launch: 10 rounds measured 200 ms in all -> k = 20 ms a step, no per-request term
    one = fit_cost(prior, [Launch(200.0, (rounds(1, 10),))])
    assert (one.k, one.o_ms, one.launches) == (pytest.approx(20.0), 0.0, 1)
    # measured shape: k stays 1, the rest is the per-request cost: (200 - 10 x 15) / 10 = 5 ms
    measured = CostModel(shape="measured", table=RoundTable(
        batches=[1], widths=[1, 8], ms=[[15.0, 22.0]], lm_head_rows=[1, 2], lm_head_ms=[0.0, 0.0],
        context_tokens=100, long_context_tokens=200, short_context_ms=15.0, long_context_ms=15.0), k=1.0)
    assert fit_cost(measured, [Launch(200.0, (rounds(1, 10),))]).o_ms == pytest.approx(5.0)
    # k = 2, o = 3 behind two launches of other widths: recovered
    truth = prior.model_copy(update={"k": 2.0, "o_ms": 3.0})
    a, b = rounds(1, 10), rounds(9, 4)
    launches = [Launch(sum(truth.seconds(r) for r in a) * 1000, (a,)),
                Launch(sum(truth.seconds(r) for r in b) * 1000, (b,))]
    fitted = fit_cost(prior, launches)
    assert (fitted.k, fitted.o_ms) == (pytest.approx(2.0), pytest.approx(3.0))


def test_the_prefill_line_and_its_degenerate_cases():
    assert prefill_fit([10, 20, 30], [0.011, 0.021, 0.031]) == (pytest.approx(1.0), pytest.approx(1.0))
    assert prefill_fit([10, 10], [0.004, 0.006]) == (pytest.approx(5.0), 0.0)  # one length: the median
    assert prefill_fit([10, 20], [0.02, 0.01]) == (pytest.approx(15.0), 0.0)  # no negative slope
    # a free fit's intercept below 0: the best line with p0 >= 0 goes through the origin (not the free slope with p0
    # cut to 0, which prices every prefill |intercept| too high)
    xs, ts = [208, 172, 167, 198], [0.432, 0.375, 0.386, 0.609]
    p0, p1 = prefill_fit(xs, ts)
    assert p0 == 0.0 and p1 == pytest.approx(sum(x * t * 1000 for x, t in zip(xs, ts)) / sum(x * x for x in xs))
    assert p1 * 208 < 520  # the free slope (3.19 ms a token) with p0 cut to 0 said 663 ms for 208 tokens
    with pytest.raises(ValueError, match="TTFT"):
        prefill_fit([], [])


def test_a_closed_loop_timed_by_hand():
    # two requests of 1 prefill + 3 steps at concurrency 1; prefill 30 ms, step 20 ms, gap 2 ms between them
    a = Answer((1, 2), (3, 4, 5, 6))
    model = CostModel(shape="prior", k=20.0, p0_ms=30.0, gap_s=0.002)
    requests = timed(replay(NoSpec(), [Phase("measure", (a, a), ClosedLoop(1))]), model)
    assert [(r.arrival_s, r.first_token_s, r.finished_s) for r in requests] == [
        pytest.approx((0.0, 0.03, 0.09)), pytest.approx((0.092, 0.122, 0.182))]
    figures = predicted_metrics(requests, speculative=False)
    assert figures["tput_tok_s"] == pytest.approx(8 / 0.182)
    assert figures["ttft_p50_ms"] == pytest.approx(30.0) and figures["itl_p50_ms"] == pytest.approx(20.0)
    assert "accept_len" not in figures


def record(i: int, phase: Literal["warmup", "measure", "reference"], prompt: tuple[int, ...], output: tuple[int, ...],
           start: float, ttft: float, e2e: float) -> RequestRecord:
    return RequestRecord(request_id=f"{phase}-{i}", phase=phase, prompt_index=i, concurrency=1, start_s=start,
                         ttft_s=ttft, e2e_s=e2e, prompt_tokens=len(prompt), completion_tokens=len(output),
                         finish_reason="length", output_ids=output, prompt_ids=prompt)


def test_the_simulator_calibrates_on_the_baseline_and_predicts_a_faster_speculative_config():
    # baseline: 2 measured requests of 6 tokens, 30 ms TTFT, 20 ms a step, the second 2 ms after the first
    out = (4, 5, 6, 4, 5, 6)
    base = [record(0, "measure", (1, 2, 3), out, 0.0, 0.03, 0.13),
            record(1, "measure", (1, 2, 3), out, 0.132, 0.03, 0.13)]
    items = [LoadRequest(i, "", 6) for i in range(2)]
    sim = Simulator({r.prompt_index: Answer(r.prompt_ids or (), r.output_ids) for r in base}, (), items)
    plain = TrialConfig()
    cost = sim.fitted(base_cost(base, None, 1), [(plain, base)])
    assert (cost.k, cost.p0_ms, cost.gap_s) == (pytest.approx(20.0), pytest.approx(30.0), pytest.approx(0.002))
    assert sim.predict(plain, cost)["tput_tok_s"] == pytest.approx(12 / 0.262)  # the baseline's own window back
    fast = sim.predict(TrialConfig(spec=NgramSpec(num_draft_tokens=4, max_bfs_breadth=1, max_trie_depth=4)), cost)
    assert fast["accept_len"] > 1 and fast["tput_tok_s"] > 12 / 0.262


def test_a_noisy_cell_below_a_narrower_or_smaller_one_is_read_as_that_one():
    # w=4 measured faster than w=1 (noise) at b=1, and b=2 faster than b=1 at w=1: both raised
    noisy = TABLE.model_copy(update={"ms": [[10.0, 8.0], [9.0, 30.0]]})
    assert noisy.verify_ms(1, 4, 1, 128) == pytest.approx(10.0)
    assert noisy.verify_ms(2, 1, 2, 128) == pytest.approx(10.0)
    assert noisy.verify_ms(2, 4, 2, 128) == pytest.approx(30.0)


def test_open_loop_arrivals_queue_behind_a_busy_engine():
    from pipeline.config import ArrivalSettings

    a = Answer((1, 2), (3, 4, 5, 6))  # prefill 30 ms + 3 steps of 20 ms: 90 ms a request alone
    model = CostModel(shape="prior", k=20.0, p0_ms=30.0)
    items = [LoadRequest(0, "", 4)] * 6
    figures = {}
    for rate in (1.0, 200.0):
        arrival = ArrivalSettings(mode="poisson", rate_per_s=rate, max_duration_s=60)
        sim = Simulator({0: a}, (), items, arrival=arrival, seed=3)
        figures[rate] = sim.predict(TrialConfig(), model)
    assert figures[1.0]["e2e_p50_ms"] == pytest.approx(90.0)  # ~1 s apart: nobody waits
    assert figures[200.0]["e2e_p50_ms"] > 150.0  # 5 ms apart: they share rounds and wait behind prefills
    assert figures[1.0]["tput_tok_s"] < figures[200.0]["tput_tok_s"]


def test_every_launch_refits_the_prefill_on_all_ttfts():
    out = (4, 5, 6, 4, 5, 6)
    base = [record(0, "measure", (1, 2, 3), out, 0.0, 0.03, 0.13)]
    later = [record(0, "measure", (1, 2, 3), out, 0.0, 0.01, 0.11)]  # the same prompt, a faster first token
    sim = Simulator({0: Answer((1, 2, 3), out)}, (), [LoadRequest(0, "", 6)])
    start = base_cost(base, None, 1)
    assert start.p0_ms == pytest.approx(30.0)
    both = sim.fitted(start, [(TrialConfig(), base), (TrialConfig(), later)])
    assert both.p0_ms == pytest.approx(20.0)  # the median of 30 and 10 ms
