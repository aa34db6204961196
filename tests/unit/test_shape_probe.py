"""The verify-cost probe over an engine's HTTP API (pipeline/measure/shape.py), its pure parts: the plan per engine
kind and study, the calls and their bodies in each dialect, the answers' checks, the table built from the calls'
times -- the calls' own costs cancel, whatever they are -- its trust check, and which attempt is kept. The probe
against a real engine: tests/engines/test_shape_probe_engines.py."""

from __future__ import annotations

import pytest

from pipeline.measure.shape import (CONTEXT_TOKENS, DECODE_TOKENS, LONG_CONTEXT_TOKENS, WIDTHS, Attempt, Call, Prompts,
                                    assemble, body, calls, check_answer, choose, dips, plan_for, table_problem)
from pipeline.measure.server_info import ServerInfo
from pipeline.measure.window import Window
from pipeline.simulate.cost import CostModel, round_table
from pipeline.simulate.replay import Round
from serve.engines import engine_for


def test_the_plan_measures_the_batches_the_study_puts_in_flight_in_the_engines_dialect():
    assert plan_for(engine_for("sglang"), [1]).batches == (1,)
    assert plan_for(engine_for("sglang"), [2]).batches == (1, 2)
    assert plan_for(engine_for("sglang"), [1, 4]).batches == (1, 2, 4)  # the finalists' levels are predicted too
    assert plan_for(engine_for("sglang"), [8], max_running=2).batches == (1, 2)  # never past the engine's cap
    sglang, llama = plan_for(engine_for("sglang"), [1]), plan_for(engine_for("llama_cpp"), [1])
    assert (sglang.dialect, sglang.all_rows) == ("generate", True)
    assert (llama.dialect, llama.all_rows) == ("completion", False)


def test_each_pass_times_the_step_pairs_and_every_width():
    sglang = calls(plan_for(engine_for("sglang"), [2]))
    assert Call(2, 1, 1, CONTEXT_TOKENS) in sglang and Call(2, 1, DECODE_TOKENS, CONTEXT_TOKENS) in sglang
    assert [c.width for c in sglang if c.rows and c.batch == 2] == list(WIDTHS)  # width 1 with every row's logits
    assert sglang[-2:] == [Call(1, 1, 1, LONG_CONTEXT_TOKENS), Call(1, 1, DECODE_TOKENS, LONG_CONTEXT_TOKENS)]
    llama = calls(plan_for(engine_for("llama_cpp"), [1]))
    assert not any(c.rows for c in llama)
    assert [c.width for c in llama if c.generate == 1 and c.context == CONTEXT_TOKENS] == list(WIDTHS)  # no twin


def test_the_bodies_ask_for_one_batched_call_with_every_rows_logits_where_the_api_has_them():
    prompts = [[1, 2, 3], [4, 5, 6]]
    route, sglang = body(plan_for(engine_for("sglang"), [2]), Call(2, 2, 1, 1, rows=True), prompts)
    assert route == "/generate" and sglang["input_ids"] == prompts
    assert sglang["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True}
    assert sglang["return_logprob"] is True and sglang["logprob_start_len"] == 1
    assert "return_logprob" not in body(plan_for(engine_for("sglang"), [2]), Call(2, 1, 9, 1), prompts)[1]
    route, llama = body(plan_for(engine_for("llama_cpp"), [2]), Call(2, 2, 9, 1), prompts)
    assert route == "/completion" and llama["prompt"] == prompts and llama["n_predict"] == 9
    assert llama["cache_prompt"] is True and llama["ignore_eos"] is True


def sglang_answer(cached: int, generated: int = 1) -> dict:
    return {"text": "x", "meta_info": {"cached_tokens": cached, "completion_tokens": generated}}


def test_an_answer_is_a_sample_only_when_every_request_extended_its_cached_context():
    plan, call = plan_for(engine_for("sglang"), [2]), Call(2, 4, 1, CONTEXT_TOKENS)
    assert check_answer(plan, call, [sglang_answer(CONTEXT_TOKENS)] * 2) is None
    assert (check_answer(plan, call, [sglang_answer(CONTEXT_TOKENS), sglang_answer(3)]) or "").startswith("cache miss")
    assert "expected 2 result(s)" in (check_answer(plan, call, [sglang_answer(CONTEXT_TOKENS)]) or "")
    assert "generated 2 token(s)" in (check_answer(plan, call, [sglang_answer(CONTEXT_TOKENS, 2)] * 2) or "")
    llama = plan_for(engine_for("llama_cpp"), [1])
    one = {"tokens_predicted": 1, "timings": {"cache_n": CONTEXT_TOKENS}}
    assert check_answer(llama, Call(1, 4, 1, CONTEXT_TOKENS), one) is None  # one prompt: one object, not a list
    assert check_answer(llama, Call(1, 4, 1, CONTEXT_TOKENS), {**one, "timings": {"cache_n": 0}}) is not None


def truth_times(plan, outside) -> dict[Call, float]:
    """What each call of a pass takes on an engine whose step of b requests costs 40 + 10 b ms, each extra query
    row 3 ms a request (2x that past 256 tokens of context), and `outside(b)` per call outside the forward."""
    def step(b, context):
        return (40.0 + 10.0 * b) * (2.0 if context > 256 else 1.0)

    def extend(b, w, context):
        return step(b, context) + 3.0 * b * (w - 1)

    return {c: outside(c.batch) + extend(c.batch, c.width, c.context) + (c.generate - 1) * step(c.batch, c.context)
            + (1.5 if c.rows else 0.0) for c in calls(plan)}


def test_the_table_holds_forward_costs_whatever_each_call_costs_outside_the_forward():
    plan = plan_for(engine_for("sglang"), [1, 4])
    table = assemble(plan, truth_times(plan, lambda b: 30.0 + 4.0 * b))
    assert table == assemble(plan, truth_times(plan, lambda b: 200.0 * b))  # the outside cost cancels
    for i, b in enumerate(plan.batches):
        assert table["ms"][i] == pytest.approx([40.0 + 10.0 * b + 3.0 * b * (w - 1) for w in WIDTHS])
    assert table["short_context_ms"] == pytest.approx(50.0) and table["long_context_ms"] == pytest.approx(100.0)
    assert table_problem(table) is None
    # the step-cost model reads it unchanged: a round of one request x 4 queries, 2 real draft nodes
    model = CostModel(shape="measured", table=round_table({"round_cost": table}), k=1.0)
    assert model.shape_of(Round((), 4, (2,), (CONTEXT_TOKENS,))) == pytest.approx(50.0 + 9.0)


def test_a_step_at_no_cost_is_refused_and_a_dip_is_named_and_kept_as_measured():
    plan = plan_for(engine_for("sglang"), [1])
    table = assemble(plan, truth_times(plan, lambda b: 30.0))
    assert "no cost" in (table_problem({**table, "short_context_ms": -2.0}) or "")
    assert "no cost" in (table_problem({**table, "ms": [[0.0, *table["ms"][0][1:]]]}) or "")
    # torch's fp32 GEMM on 3 rows is slower than on 4: a dip the engine reproduces, named, not smoothed away
    dipped = {**table, "ms": [[50.0, 53.0, 80.0, 59.0, *table["ms"][0][4:]]]}
    assert table_problem(dipped) is None
    assert dips(dipped) == "not monotone: 1 request(s) x width 4 measured 59.0 ms, below a narrower width's 80.0 ms"
    model = CostModel(shape="measured", table=round_table({"round_cost": dipped}), k=1.0)
    assert model.shape_of(Round((), 4, (3,), (CONTEXT_TOKENS,))) == pytest.approx(59.0)
    assert model.shape_of(Round((), 3, (2,), (CONTEXT_TOKENS,))) == pytest.approx(80.0)
    assert dips(table) is None
    plan = plan_for(engine_for("sglang"), [2])
    two = assemble(plan, truth_times(plan, lambda b: 30.0))
    assert "below a smaller batch's" in (dips({**two, "ms": [two["ms"][0], [x / 2 for x in two["ms"][1]]]}) or "")


def window(wait: float | None, disturbed: bool | None) -> Window:
    return Window(wall_s=10.0, wait_share=wait, disturbed=disturbed)


def test_the_first_clean_attempt_is_kept_else_the_least_disturbed_monotone_one():
    table = {"ms": [[1.0]]}
    clean = Attempt(table, window(0.05, False), None)
    busy, busier = Attempt(table, window(0.3, True), None), Attempt(table, window(0.6, True), None)
    bent = Attempt(table, window(0.01, False), "a step measured at no cost: ...")
    assert choose([busy, clean]) is clean
    assert choose([busier, bent, busy]) is busy
    assert choose([bent]) is bent
    assert choose([Attempt(None, window(None, None), "missed")]) is None
    assert Attempt(table, window(None, None), None).clean  # unchecked (no usage route): nothing says it was disturbed


def test_every_call_extends_its_fixed_context_with_tokens_no_earlier_call_cached():
    prompts = Prompts(seed=0)
    first, second = prompts.of(Call(2, 3, 1, 8)), prompts.of(Call(2, 3, 1, 8))
    assert [p[:8] for p in first] == [p[:8] for p in second] == [prompts.prefix(8, 0), prompts.prefix(8, 1)]
    assert prompts.prefix(8, 0) != prompts.prefix(8, 1) and all(len(p) == 11 for p in first + second)
    starts = [p[8] for p in first + second]
    assert len(set(starts)) == 4


def test_the_probe_runs_only_where_the_engine_reported_no_table():
    assert ServerInfo.parse({"verify_cost": {"round_cost": {"ms": [[1.0]]}}}).has_round_table
    assert not ServerInfo().has_round_table
    assert not ServerInfo.parse({"verify_cost": {"relative": [1.0]}}).has_round_table
