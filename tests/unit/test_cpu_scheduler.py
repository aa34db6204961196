"""The scheduler's FIFO admission, round-robin turns, max_running_requests bound, counters and flush rule, with a
decoder stand-in that only records the order of steps (no model)."""

from __future__ import annotations

import threading

from serve.engines.cpu.decode import Request, StepStats, StopRules
from serve.engines.cpu.scheduler import Scheduler
from serve.engines.cpu.verify import Sampling


class _Decoder:
    """Each request finishes after `steps` steps; every step after the first is a verify step emitting 2 tokens."""

    def __init__(self, gate: threading.Event) -> None:
        self.speculator = self  # counts as speculative
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
        return StepStats(verify=verify, emitted=2 if verify else 1, proposed=3 if verify else 0)

    def release(self, req: Request) -> None:
        self.released.append(req.rid)

    def reset(self) -> None:
        self.resets += 1


def _req(rid: str, tokens: int) -> Request:
    return Request(rid=rid, prompt_ids=[1, 2], sampling=Sampling(), rules=StopRules(max_new_tokens=tokens), seed=0)


def _run(max_running: int, requests: list[Request]):
    gate = threading.Event()
    decoder = _Decoder(gate)
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
    assert stats["avg_spec_accept_length"] == 2.0 and stats["spec_num_proposed_drafts"] == 9
    assert sched.flush() and decoder.resets == 1
    assert sched.stats(speculative=True)["spec_verify_ct"] == 0


def test_flush_is_refused_while_requests_wait():
    decoder = _Decoder(threading.Event())
    sched = Scheduler(decoder, 1)  # never started: the request stays queued
    sched.submit(_req("a", 3), lambda req, error: None)
    assert not sched.flush() and decoder.resets == 0
