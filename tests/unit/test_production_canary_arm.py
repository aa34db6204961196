"""The canary's candidate arm at the endpoint (serve/closed_loop/candidate_arm.py) and production taking over from a
failed candidate (serve/closed_loop/failover.py): issue 42 items 7 and 8.

`ServeFree` is the arm with Serve's two calls (deploy the candidate's app, delete it) replaced, the only parts that
need a Ray cluster; tests/end_to_end/test_production_loop.py runs the real ones."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from serve.closed_loop.candidate_arm import LEASE_CHECK_S, CanaryArm
from serve.closed_loop.control import CandidateRef, CanaryStart
from serve.closed_loop.failover import Takeover, resumable
from serve.http_errors import EngineUnavailable
from serve.production.settings import ProductionSettings


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class ServeFree(CanaryArm):
    deleted = 0

    def deploy_blocking(self, start: CanaryStart) -> Any:
        return "candidate handle"

    def delete_blocking(self, wait: bool = True) -> None:
        self.deleted += 1


START = CanaryStart(candidate=CandidateRef(registered_model="m", version="2"), share=0.5, lease_s=60)


async def running(arm: CanaryArm) -> None:
    arm.start(START)
    await arm.deploying  # type: ignore[misc]
    assert arm.state == "running"


async def settled(arm: CanaryArm) -> None:
    if arm.tearing_down is not None:
        await arm.tearing_down


def test_a_status_poll_does_not_revive_an_expired_lease():
    # issue 42 item 7: any admin call renewed the lease before it was checked, so `promote --canary status` polling
    # kept an abandoned canary alive forever
    async def scenario() -> ServeFree:
        clock = Clock()
        arm = ServeFree(ProductionSettings(config_file="x.json"), clock=clock)
        await running(arm)
        clock.t += 30
        arm.called()  # a poll within the lease renews it
        clock.t += 61
        arm.called()  # the next comes after the lease ran out: too late
        await settled(arm)
        return arm

    arm = asyncio.run(scenario())
    assert (arm.state, arm.reason, arm.deleted) == ("off", "lease expired", 1)


def test_the_lease_is_checked_on_a_timer_without_any_request():
    # issue 42 item 7: it was checked on generation requests only; with no traffic an abandoned canary ran forever
    async def scenario() -> ServeFree:
        clock = Clock()
        arm = ServeFree(ProductionSettings(config_file="x.json"), clock=clock)
        await running(arm)
        clock.t += 61  # nobody calls anything from here on
        deadline = time.monotonic() + 10 * LEASE_CHECK_S + 30
        while arm.state == "running" and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # polling a condition under a deadline
        await settled(arm)
        return arm

    arm = asyncio.run(scenario())
    assert (arm.state, arm.reason) == ("off", "lease expired")


def test_a_failed_candidate_ends_the_canary_failed_with_the_reason():
    async def scenario() -> ServeFree:
        arm = ServeFree(ProductionSettings(config_file="x.json"))
        await running(arm)
        arm.candidate_failed("the engine is unavailable (the engine exited with code -9)")
        arm.candidate_failed("the same failure, seen by a second request")
        assert arm.pick() is None  # no request goes to it from the first failure on
        await settled(arm)
        return arm

    arm = asyncio.run(scenario())
    assert arm.state == "failed" and arm.deleted == 1
    assert arm.reason == "the candidate's engine failed: the engine is unavailable (the engine exited with code -9)"


class Stream:
    """A Serve streaming call past its status item: `events` (bytes) then, if `dies`, the engine's failure."""

    def __init__(self, events: list[bytes], dies: bool = False) -> None:
        self.events, self.dies, self.cancelled = list(events), dies, False

    def cancel(self) -> None:
        self.cancelled = True

    async def __anext__(self) -> bytes:
        if self.events:
            return self.events.pop(0)
        if self.dies:
            raise EngineUnavailable("the engine exited with code -9")
        raise StopAsyncIteration


def chat(text: str, finish: str | None = None) -> bytes:
    chunk = {"id": "c", "object": "chat.completion.chunk",
             "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


ANSWER = ["The", " sky", " is", " blue", "."]
PRODUCTION = [b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n',
              *[chat(t) for t in ANSWER[:-1]], chat(ANSWER[-1], "stop"), b"data: [DONE]\n\n"]


def run(takeover: Takeover) -> tuple[str, list[bytes]]:
    async def drain() -> list[bytes]:
        out = []
        while True:
            try:
                out.append(await takeover.__anext__())
            except StopAsyncIteration:
                return out

    chunks = asyncio.run(drain())
    text = ""
    for event in b"".join(chunks).split(b"\n\n"):
        if event.startswith(b"data: {"):
            delta = json.loads(event[6:])["choices"][0]["delta"]
            text += delta.get("content") or ""
    return text, chunks


def test_production_finishes_a_greedy_stream_the_candidate_left_mid_answer():
    # issue 42 item 8: a killed candidate's streams ended in error events, and its new requests got 503s
    failures: list[str] = []
    candidate = Stream([chat("The"), chat(" sky") + chat(" i")[:10]], dies=True)  # dies mid-event

    async def restart() -> Stream:
        return Stream(PRODUCTION)

    text, chunks = run(Takeover(candidate, restart, True, failures.append))
    assert text == "The sky is blue." and chunks[-1].endswith(b"data: [DONE]\n\n")
    assert b"error" not in b"".join(chunks) and candidate.cancelled
    assert failures == ["the engine is unavailable (the engine exited with code -9)"]


def test_a_candidate_that_fails_before_its_first_event_is_replaced_whole_even_when_sampled():
    async def restart() -> Stream:
        return Stream(PRODUCTION)

    text, _ = run(Takeover(Stream([], dies=True), restart, False, lambda why: None))
    assert text == "The sky is blue."


def test_a_sampled_stream_or_a_different_answer_still_ends_in_an_error():
    async def restart() -> Stream:
        return Stream([chat("The"), chat(" sea"), b"data: [DONE]\n\n"])

    with pytest.raises(EngineUnavailable, match="exited with code -9"):  # sampled: production's text may differ
        run(Takeover(Stream([chat("The")], dies=True), restart, False, lambda why: None))
    with pytest.raises(EngineUnavailable, match="differs from the part already sent"):
        run(Takeover(Stream([chat("The"), chat(" sky")], dies=True), restart, True, lambda why: None))


def test_only_greedy_single_choice_requests_are_resumable():
    assert resumable({"temperature": 0}) and resumable({"temperature": 0.0, "n": 1})
    for data in ({}, {"temperature": 0.7}, {"temperature": False}, {"temperature": 0, "n": 2},
                 {"temperature": 0, "logprobs": True}, {"temperature": 0, "echo": True}):
        assert not resumable(data), data
