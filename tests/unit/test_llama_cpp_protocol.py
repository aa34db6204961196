"""SGLang /generate <-> llama-server /completion mapping and the spec counters derived from `timings`."""

import pytest

from serve.engines.llama_cpp import protocol
from serve.engines.shim_routes import Totals


def test_completion_body_maps_sglang_fields_and_sampling_defaults():
    body = protocol.completion_body({"text": "hi", "stream": True,
                                     "sampling_params": {"max_new_tokens": 7, "temperature": 0, "stop": "\n"}})
    assert body["prompt"] == "hi" and body["n_predict"] == 7 and body["temperature"] == 0.0 and body["stream"]
    assert body["return_tokens"] and body["stop"] == ["\n"]
    assert (body["top_k"], body["top_p"], body["min_p"]) == (0, 1.0, 0.0)  # SGLang's, not llama.cpp's 40/0.95/0.05
    assert protocol.completion_body({"input_ids": [1, 2], "sampling_params": {}})["prompt"] == [1, 2]


@pytest.mark.parametrize("body, field", [
    ({"sampling_params": {}}, "text"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": []}, "sampling_params"),
    ({"input_ids": ["a"]}, "input_ids"),
])
def test_bad_bodies_name_the_field(body, field):
    with pytest.raises(protocol.BadRequest, match=field):
        protocol.completion_body(body)


def test_counters_follow_sglang_definitions():
    # 24 tokens: 1 from the prompt pass, 23 from decode steps; 15 accepted drafts => 8 verify steps
    meta = protocol.meta_info({"tokens_predicted": 24, "tokens_evaluated": 30, "stop_type": "limit",
                               "timings": {"draft_n": 20, "draft_n_accepted": 15, "cache_n": 4}}, True, 0.5)
    assert meta["spec_verify_ct"] == 8 and meta["spec_accept_length"] == 24 / 8
    assert (meta["spec_num_correct_drafts"], meta["spec_num_proposed_drafts"]) == (15, 20)
    assert meta["finish_reason"] == {"type": "length", "length": 24}
    assert (meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"]) == (30, 24, 4)
    # no drafts proposed at all: every decode step verified nothing, accept length = completion / decode steps
    plain = protocol.spec_counters(10, {})
    assert plain["spec_verify_ct"] == 9 and plain["spec_num_proposed_drafts"] == 0


def test_no_spec_keys_for_the_baseline_or_a_prefill_only_request():
    assert "spec_verify_ct" not in protocol.meta_info({"tokens_predicted": 5, "timings": {}}, False, 0.1)
    assert protocol.spec_counters(1, {"draft_n": 0}) == {}
    # accepted drafts cut by max_new_tokens: never a zero or negative step count
    assert protocol.spec_counters(4, {"draft_n": 8, "draft_n_accepted": 6})["spec_verify_ct"] == 1


def test_finish_reasons():
    assert protocol.finish_reason({"stop_type": "eos"}) == {"type": "stop", "matched": None}
    assert protocol.finish_reason({"stop_type": "word", "stopping_word": "\n"}) == {"type": "stop", "matched": "\n"}


def test_totals_reset_and_average():
    totals = Totals()
    assert "avg_spec_accept_length" not in totals.internal_state()
    totals.add({"completion_tokens": 10, "spec_verify_ct": 5})
    totals.add({"completion_tokens": 6, "spec_verify_ct": 3})
    assert totals.internal_state()["avg_spec_accept_length"] == 2.0
