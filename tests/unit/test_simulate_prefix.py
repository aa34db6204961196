"""The engine's prefix cache in the simulator (pipeline/simulate/prefix.py): which engines have one, what a prompt
hits, the uncached tokens of recorded requests, and a prefill priced by them -- cheaper when its prefix was cached,
unchanged for an engine without a cache (the CPU engine)."""

from __future__ import annotations

from typing import Literal

import pytest

from pipeline.config import TrialConfig
from pipeline.measure.load import LoadRequest
from pipeline.measure.summary import RequestRecord
from pipeline.simulate.cost import CostModel
from pipeline.simulate.predict import timed
from pipeline.measure.server_info import ServerInfo
from pipeline.simulate.prefix import HeldPrefixes, PrefixCache, prefix_cache_of, uncached_tokens
from pipeline.simulate.replay import Answer, ClosedLoop, Phase, replay
from pipeline.simulate.simulator import Simulator, base_cost
from serve.spec import NgramSpec, NoSpec

SHARED = tuple(range(100, 140))  # a long prefix the templated prompts share
OUT = (7, 8, 9, 7, 8, 9)
OTHER = tuple(range(1, 23))  # a prompt that shares nothing with the others


def prompt(tail: int) -> tuple[int, ...]:
    return (*SHARED, tail, tail + 1)


def record(i: int, phase: Literal["warmup", "measure", "reference"], ids: tuple[int, ...], start: float,
           ttft: float, e2e: float = 0.13) -> RequestRecord:
    return RequestRecord(request_id=f"{phase}-{i}", phase=phase, prompt_index=i, concurrency=1, start_s=start,
                         ttft_s=ttft, e2e_s=e2e, prompt_tokens=len(ids), completion_tokens=len(OUT),
                         finish_reason="length", output_ids=OUT, prompt_ids=ids)


def test_the_engines_own_server_info_says_whether_it_has_a_prefix_cache():
    # SGLang reports its resolved server arguments; the CPU engine and llama-server report no such field
    assert prefix_cache_of(ServerInfo.parse({"disable_radix_cache": False, "page_size": 1})) == PrefixCache(page_size=1)
    assert prefix_cache_of(ServerInfo.parse({"disable_radix_cache": False, "page_size": 16})) == PrefixCache(page_size=16)
    assert prefix_cache_of(ServerInfo.parse({"disable_radix_cache": False, "page_size": None})) == PrefixCache()
    assert prefix_cache_of(ServerInfo.parse({"disable_radix_cache": True, "page_size": 1})) is None  # --disable-radix-cache
    assert prefix_cache_of(ServerInfo.parse({"engine": "cpu", "speculative_algorithm": None, "verify_cost": {}})) is None
    assert prefix_cache_of(None) is None


def test_a_hit_is_the_longest_held_prefix_in_pages_and_never_the_whole_prompt():
    held = HeldPrefixes(PrefixCache())
    assert held.hit((1, 2, 3)) == 0
    held.hold((1, 2, 3, 4, 5))
    held.hold((1, 2, 9))
    assert held.hit((1, 2, 3, 4, 6)) == 4 and held.uncached((1, 2, 3, 4, 6)) == 1
    assert held.hit((1, 2, 9, 9)) == 3
    assert held.hit((1, 2, 3)) == 2  # held whole: one token is still computed, for the first token's logits
    paged = HeldPrefixes(PrefixCache(page_size=2))
    paged.hold((1, 2, 3, 4, 5))
    assert paged.hit((1, 2, 3, 7)) == 2  # 3 tokens match: one whole page of 2


def test_recorded_requests_count_what_the_warm_up_and_earlier_requests_left_cached():
    records = [record(0, "warmup", prompt(1), 0.0, 0.5), record(1, "warmup", prompt(3), 0.2, 0.2),
               record(0, "measure", prompt(5), 0.0, 0.2), record(1, "measure", prompt(5), 0.2, 0.1),
               record(2, "reference", prompt(9), 0.0, 0.5)]
    # the first measured prompt shares the 40-token prefix; the second is the first one again: all but its last
    assert uncached_tokens(records, PrefixCache()) == [2, 1]
    assert uncached_tokens(records, PrefixCache(), flushed_after_warmup=True) == [42, 1]
    assert uncached_tokens(records, None) == [42, 42]  # no cache: every prompt token
    # concurrency 2: the second request arrived before the first one's prefill ended, so found nothing of it
    overlapped = [record(0, "measure", prompt(5), 0.0, 0.3), record(1, "measure", prompt(5), 0.1, 0.3)]
    assert uncached_tokens(overlapped, PrefixCache()) == [42, 42]


def test_the_same_request_is_priced_cheaper_when_its_prefix_was_cached():
    warm, measured = Answer(prompt(1), OUT), Answer(prompt(5), OUT)
    phases = [Phase("warmup", (warm,), ClosedLoop(1)), Phase("measure", (measured,), ClosedLoop(1))]
    model = CostModel(shape="prior", k=20.0, p0_ms=30.0, p1_ms=10.0)
    cold = replay(NoSpec(), phases)
    cached = replay(NoSpec(), phases, prefix=PrefixCache())
    assert cold.rounds[6].prefills == (42,) and cached.rounds[6].prefills == (2,)  # the measured request's prefill
    ttft = {name: [r.first_token_s - r.arrival_s for r in timed(result, model)]
            for name, result in (("cold", cold), ("cached", cached))}
    assert ttft["cold"] == [pytest.approx(0.03 + 0.42)] and ttft["cached"] == [pytest.approx(0.03 + 0.02)]
    # the warm-up's own prefill found nothing cached either way
    assert cold.rounds[0].prefills == cached.rounds[0].prefills == (42,)


def study_records() -> list[RequestRecord]:
    """A baseline whose TTFT is 30 ms + 10 ms per uncached token, 20 ms a step: its first measured prompt differs
    from the warm-up's in the last two tokens (2 uncached of 42), its second shares nothing (22 of 22)."""
    return [record(0, "warmup", prompt(1), 0.0, 0.45), record(0, "measure", prompt(5), 0.0, 0.05, 0.15),
            record(1, "measure", OTHER, 0.152, 0.25, 0.35)]


def test_the_prefill_line_is_fitted_on_uncached_tokens_and_predicts_the_launch():
    base = study_records()
    answers = {0: Answer(prompt(5), OUT), 1: Answer(OTHER, OUT), 9: Answer(prompt(1), OUT)}
    warmup, measure = [LoadRequest(9, "", 6)], [LoadRequest(0, "", 6), LoadRequest(1, "", 6)]
    cache = prefix_cache_of(ServerInfo.parse({"disable_radix_cache": False, "page_size": 1}))
    start = base_cost(base, None, 1, prefix=cache)
    assert (start.p0_ms, start.p1_ms) == (pytest.approx(30.0), pytest.approx(10.0))  # 2 and 22 uncached tokens
    by_prompt = base_cost(base, None, 1)  # every prompt 42 or 22 tokens long: the slope comes out negative
    assert by_prompt.p1_ms == 0.0
    sim = Simulator(answers, warmup, measure, prefix=cache)
    config = TrialConfig(warmup_requests=1)
    cost = sim.fitted(start, [(config, base)])
    assert (cost.p0_ms, cost.p1_ms, cost.k) == (pytest.approx(30.0), pytest.approx(10.0), pytest.approx(20.0))
    figures = sim.predict(config, cost)
    assert figures["ttft_p50_ms"] == pytest.approx(30.0 + 10.0 * (2 + 22) / 2)  # the baseline's own TTFTs back
    assert figures["tput_tok_s"] == pytest.approx(12 / 0.502)  # its own window: 0.152 + 0.35
    fast = sim.predict(TrialConfig(warmup_requests=1, spec=NgramSpec(num_draft_tokens=4, max_bfs_breadth=1,
                                                                     max_trie_depth=4)), cost)
    assert fast["tput_tok_s"] > figures["tput_tok_s"]


def test_an_engine_without_a_prefix_cache_is_predicted_as_before():
    base = study_records()
    answers = {0: Answer(prompt(5), OUT), 1: Answer(OTHER, OUT), 9: Answer(prompt(1), OUT)}
    warmup, measure = [LoadRequest(9, "", 6)], [LoadRequest(0, "", 6), LoadRequest(1, "", 6)]
    cpu_info = ServerInfo.parse({"engine": "cpu", "verify_cost": None})
    config = TrialConfig(warmup_requests=1, spec=NgramSpec(num_draft_tokens=4, max_bfs_breadth=1, max_trie_depth=4))
    before = Simulator(answers, warmup, measure)  # what the simulator was before it knew of prefix caches
    cost_before = before.fitted(base_cost(base, None, 1), [(TrialConfig(warmup_requests=1), base)])
    after = Simulator(answers, warmup, measure, prefix=prefix_cache_of(cpu_info))
    cost_after = after.fitted(base_cost(base, None, 1, prefix=prefix_cache_of(cpu_info)),
                              [(TrialConfig(warmup_requests=1), base)])
    assert cost_after == cost_before
    assert after.predict(config, cost_after) == before.predict(config, cost_before)
    assert all(r.prefills in ((), (42,), (22,)) for r in after.replay(config).rounds)  # whole prompts charged
