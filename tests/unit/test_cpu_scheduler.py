"""The scheduler's FIFO admission, one step per running request per round, max_running_requests bound, counters and
flush rule, with a decoder stand-in that only records the order of steps (no model)."""

from __future__ import annotations

import threading

from serve.engines.cpu.decode import Request, StepStats, StopRules
import pytest

from serve.engines.cpu.scheduler import QueueFull, Scheduler, Ticket, TooLarge
from serve.engines.cpu.verify import Sampling


class _Decoder:
    """Each request finishes after `steps` steps; every step after the first is a verify step emitting 2 tokens."""

    def __init__(self, gate: threading.Event) -> None:
        self.speculator: _Decoder | None = self  # counts as speculative
        self.log: list[str] = []
        self.released: list[str] = []
        self.resets = 0
        self.gate = gate

    def step(self, req: Request) -> StepStats:
        self.gate.wait(10)
        self.log.append(req.rid)
        verify = bool(req.output_ids)
        req.output_ids.extend([1, 1] if verify else [1])
        if len(req.output_ids) >= req.rules.max_new_tokens:
            req.finish_reason = {"type": "length", "length": req.rules.max_new_tokens}
        return StepStats(verify=verify, emitted=2 if verify else 1, proposed=3 if verify else 0, correct=int(verify))

    def step_many(self, reqs: list[Request]) -> list[StepStats]:
        return [self.step(req) for req in reqs]  # the log keeps the order of steps within a round

    def release(self, req: Request) -> None:
        self.released.append(req.rid)

    def reset(self) -> None:
        self.resets += 1


def _req(rid: str, tokens: int) -> Request:
    return Request(rid=rid, prompt_ids=[1, 2], sampling=Sampling(), rules=StopRules(max_new_tokens=tokens), seed=0)


def _run(max_running: int, requests: list[Request], decoder_type: type[_Decoder] | None = None):
    gate = threading.Event()
    decoder = (decoder_type or _Decoder)(gate)
    sched = Scheduler(decoder, max_running)
    done = threading.Event()
    finished: list[str] = []

    def sink(req, error):
        assert error is None
        if req.finished:
            finished.append(req.rid)
            if len(finished) == len(requests):
                done.set()

    for req in requests:  # all queued before the worker takes its first step
        sched.submit(req, sink)
    sched.start()
    gate.set()
    assert done.wait(10)
    sched.stop()
    return decoder, sched, finished


def test_round_robin_with_fifo_admission_under_the_bound():
    # a: 5 tokens = 3 steps, b: 3 tokens = 2 steps, c: 3 tokens = 2 steps; at most two run at once
    decoder, sched, finished = _run(2, [_req("a", 5), _req("b", 3), _req("c", 3)])
    assert decoder.log == ["a", "b", "a", "b", "a", "c", "c"]  # c waits until b leaves
    assert finished == ["b", "a", "c"] and sorted(decoder.released) == ["a", "b", "c"]


def test_counters_and_flush():
    decoder, sched, _ = _run(48, [_req("a", 5), _req("b", 3)])
    stats = sched.stats(speculative=True)
    assert stats["num_finished_requests"] == 2 and stats["completion_tokens"] == 8
    assert stats["spec_verify_ct"] == 3 and stats["spec_num_correct_drafts"] == 3
    assert stats["spec_num_proposed_drafts"] == 9
    assert "avg_spec_accept_length" not in stats  # SGLang: only after a 40-decode-batch window is folded in
    assert sched.flush() and decoder.resets == 1
    assert sched.stats(speculative=True)["spec_verify_ct"] == 0


def test_flush_is_refused_while_requests_wait():
    decoder = _Decoder(threading.Event())
    sched = Scheduler(decoder, 1)  # never started: the request stays queued
    sched.submit(_req("a", 3), lambda req, error: None)
    assert not sched.flush() and decoder.resets == 0


def _started(decoder, **bounds) -> Scheduler:
    sched = Scheduler(decoder, bounds.pop("max_running", 48), **bounds)
    sched.start()
    return sched


def _collect(sched: Scheduler, requests: list[Request],
             internal: bool = False) -> tuple[list[Ticket], list[str], threading.Event]:
    done = threading.Event()
    finished: list[str] = []

    def sink(req, error):
        if req.finished:
            finished.append(req.rid)
            if len(finished) == len(requests):
                done.set()

    tickets = [sched.submit(req, sink, internal=internal) for req in requests]
    return tickets, finished, done


def test_avg_spec_accept_length_appears_after_40_decode_batches_and_a_flush_resets_it():
    gate = threading.Event()
    gate.set()
    sched = _started(_Decoder(gate))
    try:
        # one request of 1 prefill + 39 verify steps (2 tokens each) = 79 tokens: 39 decode batches, no fold yet
        _, _, done = _collect(sched, [_req("a", 79)])
        assert done.wait(10)
        assert "avg_spec_accept_length" not in sched.stats(speculative=True)
        _, _, done = _collect(sched, [_req("b", 3)])  # 1 more verify step: the 40th decode batch folds the window
        assert done.wait(10)
        stats = sched.stats(speculative=True)
        assert stats["avg_spec_accept_length"] == 2.0 and stats["spec_verify_ct"] == 40
        assert sched.flush()
        assert "avg_spec_accept_length" not in sched.stats(speculative=True)
    finally:
        sched.stop()


def test_two_requests_in_one_round_are_one_decode_batch_of_size_two():
    gate = threading.Event()
    decoder = _Decoder(gate)
    sched = Scheduler(decoder, 2)
    # 2 requests x (1 prefill + 40 verify steps): 40 decode batches of 2 -> one fold holding 80 verify steps
    _, _, done = _collect(sched, [_req("a", 81), _req("b", 81)])
    sched.start()
    gate.set()
    try:
        assert done.wait(10)
        stats = sched.stats(speculative=True)
        assert stats["spec_verify_ct"] == 80 and stats["avg_spec_accept_length"] == 2.0
    finally:
        sched.stop()


def test_a_full_waiting_queue_refuses_the_next_request():
    sched = Scheduler(_Decoder(threading.Event()), 1, max_queued_requests=2)  # not started: everything waits
    sched.submit(_req("a", 3), lambda req, error: None)
    sched.submit(_req("b", 3), lambda req, error: None)
    with pytest.raises(QueueFull, match="--max-queued-requests"):
        sched.submit(_req("c", 3), lambda req, error: None)
    sched.submit(_req("health", 1), lambda req, error: None, internal=True)  # the health probe is never refused


def test_a_cancelled_waiting_request_frees_its_place_at_once():
    sched = Scheduler(_Decoder(threading.Event()), 1, max_queued_requests=1)
    ticket = sched.submit(_req("a", 3), lambda req, error: None)
    sched.cancel(ticket)
    assert sched.load() == (0, 0)
    sched.submit(_req("b", 3), lambda req, error: None)


def test_cancel_is_a_flag_on_the_ticket_not_the_object_address():
    """A late cancel (the client left just after its request finished) must not drop a later request that happens to
    live at the same address: here the very same Request object, submitted again."""
    gate = threading.Event()
    gate.set()
    sched = _started(_Decoder(gate), max_running=1)
    try:
        req = _req("a", 3)
        tickets, _, done = _collect(sched, [req])
        assert done.wait(10)
        sched.cancel(tickets[0] if tickets[0] is not None else req)  # (before the fix: cancel took the request)
        req.output_ids.clear()
        req.finish_reason = None
        _, finished, done = _collect(sched, [req])
        assert done.wait(10), "the re-submitted request was dropped by a stale cancel"
        assert finished == ["a"]
    finally:
        sched.stop()


def test_token_budget_refuses_what_can_never_fit_and_holds_back_what_does_not_fit_yet():
    gate = threading.Event()
    decoder = _Decoder(gate)
    sched = Scheduler(decoder, 48, max_total_tokens=10)  # prompt 2 + 5 new = 7 reserved per request
    with pytest.raises(TooLarge, match="--max-total-tokens=10"):
        sched.submit(_req("huge", 9), lambda req, error: None)
    _, finished, done = _collect(sched, [_req("a", 5), _req("b", 5)])
    sched.start()
    gate.set()
    try:
        assert done.wait(10)
    finally:
        sched.stop()
    assert decoder.log == ["a"] * 3 + ["b"] * 3  # b waited for a's tokens to be released: never both at once
    assert sched.stats(speculative=True)["reserved_tokens"] == 0


def test_watchers_see_every_step():
    gate = threading.Event()
    gate.set()
    sched = _started(_Decoder(gate))
    seen: list[int] = []
    unwatch = sched.watch(lambda: seen.append(1))
    try:
        _, _, done = _collect(sched, [_req("a", 5)])
        assert done.wait(10)
        unwatch()
    finally:
        sched.stop()
    assert len(seen) >= 3  # 3 steps (and the leave)


class _PlainDecoder(_Decoder):
    """No speculator: every step after the prefill decodes one token."""

    def __init__(self, gate: threading.Event) -> None:
        super().__init__(gate)
        self.speculator = None

    def step(self, req: Request) -> StepStats:
        self.gate.wait(10)
        self.log.append(req.rid)
        verify = bool(req.output_ids)
        req.output_ids.append(1)
        if len(req.output_ids) >= req.rules.max_new_tokens:
            req.finish_reason = {"type": "length", "length": req.rules.max_new_tokens}
        return StepStats(verify=verify, emitted=1, proposed=0)


def _counted(decoder_type: type[_Decoder], max_running: int, requests: list[Request]) -> dict:
    return _run(max_running, requests, decoder_type)[1].stats(False)


def test_lone_plain_decode_steps_are_timed_with_their_context_and_nothing_else_is():
    # one request at a time, 5 tokens: a prefill round, then 4 plain steps after 2, 3, 4 and 5 cached tokens
    solo = _counted(_PlainDecoder, 1, [_req("a", 5), _req("b", 5)])
    assert solo["solo_plain_rounds"] == 8 and solo["solo_plain_context"] == 2 * (2 + 3 + 4 + 5)
    assert solo["solo_plain_ms"] > 0
    # two in every round until the end: no lone rounds; speculative steps are never plain ones
    assert _counted(_PlainDecoder, 2, [_req("a", 3), _req("b", 3)])["solo_plain_rounds"] == 0
    assert _counted(_Decoder, 1, [_req("a", 5)])["solo_plain_rounds"] == 0
