"""The baseline's settle pass (pipeline.trial.engine_pass.settle_requests): as many requests as are measured, never a
measured prompt while a warm-up split exists (SGLang's radix cache would keep it until the measurement)."""

from __future__ import annotations

from pipeline.measure.load import LoadRequest
from pipeline.trial.engine_pass import settle_requests


def requests(*indexes: int) -> list[LoadRequest]:
    return [LoadRequest(i, f"prompt {i}", 8) for i in indexes]


def test_the_settle_pass_cycles_the_warm_up_split_to_the_measured_count_and_needs_no_flush():
    settle, flush_after = settle_requests(requests(10, 11, 12), requests(0, 1))
    assert [r.index for r in settle] == [0, 1, 0] and flush_after is False


def test_without_a_warm_up_split_it_sends_the_measured_prompts_then_asks_for_a_flush():
    settle, flush_after = settle_requests(requests(10, 11), [])
    assert [r.index for r in settle] == [10, 11] and flush_after is True
    assert settle_requests([], []) == ([], False)
