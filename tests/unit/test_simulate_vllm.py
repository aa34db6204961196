"""simulate-first on `engine.kind: vllm` without vLLM: the strategy resolves it for the bundled vllm-ngram space, the
replay drafts each step as vLLM's proposer does (pipeline/simulate/vllm_ngram.py, held to vLLM's own per-step
counters in tests/engines/test_vllm_engine.py) at any concurrency, and the verify-cost probe's vLLM dialect: its
calls and bodies, its answers' checks, the LM head measured apart and read by the cost model."""

from __future__ import annotations

import random
from typing import Literal

import pytest

from pipeline.config import TrialConfig, load_study
from pipeline.measure.load import LoadRequest
from pipeline.measure.shape import CONTEXT_TOKENS, Call, assemble, body, calls, check_answer, plan_for, table_problem
from pipeline.measure.vllm_probe import VLLM_WIDTHS
from pipeline.measure.summary import RequestRecord
from pipeline.search.space import load_space
from pipeline.search.strategy import resolve_strategy
from pipeline.simulate.cost import CostModel, round_table
from pipeline.simulate.replay import Answer, ClosedLoop, Phase, Round, replay
from pipeline.simulate.simulator import Simulator, base_cost
from pipeline.simulate.vllm_ngram import replay_request
from serve.engines import engine_for
from serve.spec import VllmNgramSpec


def test_a_vllm_ngram_space_is_simulated_first_and_an_unreplayed_method_is_launched(tmp_path):
    study = load_study(None, {"engine.kind": "vllm", "search_space": "vllm-ngram"})
    strategy = resolve_strategy(study, load_space(study.search_space_path()))
    assert strategy.name == "simulate-first", strategy.reason
    other = tmp_path / "other.yaml"  # an algorithm the simulator does not replay (vLLM has none other yet)
    other.write_text("algorithms: [none, vllm_ngram, eagle]\nbranches:\n  vllm_ngram:\n"
                     "    num_speculative_tokens: {type: int, low: 1, high: 4}\n  eagle:\n"
                     "    num_steps: {type: fixed, value: 2}\n")
    fallback = resolve_strategy(study, load_space(other))
    assert fallback.name == "tpe" and "EAGLE" in fallback.reason


def stream(seed: int, length: int) -> list[int]:
    """Phrases repeated in random order with noise between them: matches of every length, and misses."""
    rng = random.Random(seed)
    phrases = [[rng.randrange(50) for _ in range(rng.randrange(2, 7))] for _ in range(4)]
    out: list[int] = []
    while len(out) < length:
        out += rng.choice(phrases) if rng.random() < 0.8 else [rng.randrange(50)]
    return out[:length]


@pytest.mark.parametrize("k,low,high", [(3, 2, 4), (1, 1, 1), (8, 1, 6), (5, 4, 5)])
@pytest.mark.parametrize("concurrency", [1, 3])
def test_the_replay_drafts_and_accepts_per_request_what_vllms_proposer_does(k, low, high, concurrency):
    answers = tuple(Answer(tuple(stream(s, 30)), tuple(stream(s + 100, 20))) for s in range(5))
    spec = VllmNgramSpec(num_speculative_tokens=k, prompt_lookup_min=low, prompt_lookup_max=high)
    result = replay(spec, [Phase("measure", answers, ClosedLoop(concurrency))])
    drafted = 0
    for request, answer in zip(result.requests, answers):
        expected = replay_request(answer.prompt_ids, answer.output_ids, len(answer.output_ids), k, low, high, 10**9)
        # vLLM's counters: one spec step per step with a draft, its length and its accepted prefix
        got = [(s.tree, s.kept - 1) for s in request.steps if s.tree]
        assert [d for d, _ in got] == [d for d, _ in expected.steps]
        # accepted drafts are cut at the answer's end (the answer is what the request emits); vLLM counts them
        assert [a for _, a in got][:-1] == [a for _, a in expected.steps][:-1]
        # every decode step emits its accepted drafts and one token of its own, up to the answer's end
        assert sum(s.kept for s in request.steps) + 1 == len(answer.output_ids) and all(s.kept for s in request.steps)
        drafted += sum(d for d, _ in got)
    assert drafted  # the streams do repeat


def test_vllm_verifies_the_last_draft_whole_and_a_round_is_as_wide_as_its_mean_query():
    # prompt 1 2 3 1 2 3 1 2, answer 3 1 2: after the prefill's 3, the suffix [2, 3] drafts 1 2 3 (K=3): 1 and 2 are
    # the answer's, the third runs past its end; vLLM verifies all 3 (llama-server would have cut the draft)
    a = Answer((1, 2, 3, 1, 2, 3, 1, 2), (3, 1, 2))
    result = replay(VllmNgramSpec(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=2),
                    [Phase("measure", (a,), ClosedLoop(1))])
    (request,) = result.requests
    assert [(s.kept, s.tree) for s in request.steps] == [(2, 3)]
    assert [r.width for r in result.rounds if r.batch] == [4]  # the root and 3 draft rows


def record(i: int, phase: Literal["warmup", "measure", "reference"], prompt: tuple[int, ...],
           output: tuple[int, ...], start: float, ttft: float, e2e: float) -> RequestRecord:
    return RequestRecord(request_id=f"{phase}-{i}", phase=phase, prompt_index=i, concurrency=1, start_s=start,
                         ttft_s=ttft, e2e_s=e2e, prompt_tokens=len(prompt), completion_tokens=len(output),
                         finish_reason="length", output_ids=output, prompt_ids=prompt)


def test_a_config_is_predicted_from_the_baselines_tokens_and_the_measured_lm_head():
    # the answer repeats its prompt: the n-gram drafts are accepted, so a step emits several tokens
    prompt, out = (5, 6, 7, 8, 9, 10, 11, 12), (5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8)
    base = [record(0, "measure", prompt, out, 0.0, 0.05, 0.05 + 11 * 0.04)]
    # 40 ms a plain step; widths cost 2 ms a query row; the LM head 5 ms a row
    table = {"batches": [1], "widths": [1, 2, 4, 8], "ms": [[40.0, 42.0, 46.0, 54.0]], "lm_head_rows": [1, 8],
             "lm_head_ms": [5.0, 40.0], "context_tokens": 128, "long_context_tokens": 512,
             "short_context_ms": 40.0, "long_context_ms": 40.0, "as_measured": True}
    sim = Simulator({0: Answer(prompt, out)}, (), [LoadRequest(0, "", len(out))])
    cost = sim.fitted(base_cost(base, {"round_cost": table}, 1), [(TrialConfig(), base)])
    assert cost.shape == "measured" and cost.k == 1.0 and cost.o_ms == pytest.approx(0.0, abs=1e-9)
    spec = VllmNgramSpec(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)
    fast = sim.predict(TrialConfig(spec=spec), cost)
    plain = sim.predict(TrialConfig(), cost)
    assert fast["accept_len"] > 2 and fast["tput_tok_s"] > plain["tput_tok_s"]
    # a verify of 5 rows: the width's cell plus the LM head's 4 rows beyond the root's (5 ms each)
    assert cost.shape_of(Round((), 5, (4,), (20,))) == pytest.approx(48.0 + 20.0)


def test_the_vllm_probe_extends_cached_contexts_and_measures_the_lm_head_apart():
    plan = plan_for(engine_for("vllm"), [1])
    assert (plan.dialect, plan.all_rows, plan.widths, plan.head_rows) == ("openai", False, VLLM_WIDTHS, VLLM_WIDTHS)
    every = calls(plan)
    assert [c.width for c in every if c.context == CONTEXT_TOKENS and c.generate == 1] == list(VLLM_WIDTHS)
    assert Call(1, 10, 1, 0) in every and Call(1, 10, 1, 0, True) in every  # 9 LM-head rows, and their twin
    route, payload = body(plan, Call(2, 3, 1, 0, True), [[1, 2, 3], [4, 5, 6]])
    assert route == "/v1/completions" and payload["prompt"] == [[1, 2, 3], [4, 5, 6]]
    assert payload["prompt_logprobs"] == 0 and payload["max_tokens"] == 1 and payload["ignore_eos"] is True
    assert "prompt_logprobs" not in body(plan, Call(2, 3, 9, CONTEXT_TOKENS), [[1], [2]])[1]

    def answer(choices: int, generated: int, logprobs: int = 0) -> dict:
        return {"choices": [{"prompt_logprobs": [None] * logprobs}] * choices,
                "usage": {"completion_tokens": generated}}

    extend = Call(2, 4, 1, CONTEXT_TOKENS)
    assert check_answer(plan, extend, answer(2, 2), cached=2 * CONTEXT_TOKENS) is None
    assert (check_answer(plan, extend, answer(2, 2), cached=CONTEXT_TOKENS) or "").startswith("cache miss")
    assert (check_answer(plan, extend, answer(2, 2), cached=None) or "").startswith("cache miss")
    assert "choice(s)" in (check_answer(plan, extend, answer(1, 2), cached=2 * CONTEXT_TOKENS) or "")
    head = Call(1, 5, 1, 0, True)
    assert check_answer(plan, head, answer(1, 1, 5)) is None  # a fresh prompt: no hit to check
    assert "prompt logprobs" in (check_answer(plan, head, answer(1, 1, 0)) or "")


def probe_times(plan, noise=lambda c: 0.0) -> dict[Call, float]:
    """Each call's time: 100 ms outside the forward, a decode step 30 ms, a query row 1 ms, an LM-head row 3 ms, 10 ms
    more a step at the long context, plus `noise(call)`."""
    return {c: 100.0 + 30.0 * (c.generate - 1) + 1.0 * (c.width - 1) + (3.0 * (c.width - 1) if c.rows else 0.0)
            + (10.0 * (c.generate - 1) if c.context > CONTEXT_TOKENS else 0.0) + noise(c) for c in calls(plan)}


def test_the_vllm_table_adds_the_lm_heads_rows_to_the_cells():
    plan = plan_for(engine_for("vllm"), [1])
    table = assemble(plan, probe_times(plan))
    assert table["ms"][0][:3] == [30.0, 31.0, 32.0] and table["lm_head_ms"][:3] == [3.0, 6.0, 9.0]
    assert table["long_context_ms"] == 40.0 and table_problem(table) is None
    model = CostModel(shape="measured", table=round_table({"round_cost": table}), k=1.0)
    # a verify of 1 + 4 draft rows at the table's context: cell(1, 5) + lm(5) - lm(1)
    assert model.shape_of(Round((), 5, (4,), (128,))) == pytest.approx(34.0 + 15.0 - 3.0)


def test_noisy_columns_are_read_as_their_lines_and_a_row_at_no_cost_is_refused():
    plan = plan_for(engine_for("vllm"), [1])
    # +-20 ms on alternate calls: larger than a row's cost, as on the shared box
    table = assemble(plan, probe_times(plan, lambda c: 20.0 * ((c.width + c.rows) % 2)))
    assert table["ms_measured"][0] != table["ms"][0]  # the cells as measured stay in the record
    slopes = table["slopes"]
    assert slopes["query_row_ms"][0] == pytest.approx(1.0, abs=1.5) and slopes["lm_head_row_ms"] > 0
    assert all(b >= a for a, b in zip(table["ms"][0], table["ms"][0][1:]))  # a line: more rows never cost less
    assert table_problem(table) is None
    # the LM head's rows cheaper the more there are: noise, refused (the probe measures again)
    falling = assemble(plan, probe_times(plan, lambda c: -4.0 * c.width if c.rows else 0.0))
    assert falling["lm_head_ms"] == [0.0] * len(VLLM_WIDTHS) and "no cost" in (table_problem(falling) or "")


def test_a_vllm_space_replays_in_the_studys_process_not_in_workers():
    # 160 configs replayed in 0.4 s here, 5 s through two worker processes (their starts): none is spread
    answers = {0: Answer(tuple(stream(0, 60)), tuple(stream(1, 12)))}
    sim = Simulator(answers, (), [LoadRequest(0, "", 12)])
    configs = [TrialConfig(spec=VllmNgramSpec(num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=m))
               for k in range(1, 9) for m in range(1, 8)]
    assert sim.prepare(configs, workers=2) == 0
    assert all(sim.predict(c, CostModel(shape="prior", k=30.0))["tput_tok_s"] > 0 for c in configs)
