"""FIFO queue + one worker thread that decodes the running requests round-robin.

What batching the engine does (and does not do):
- Requests wait in one FIFO queue. At the start of every round the worker admits waiting requests, oldest first,
  while fewer than `max_running_requests` are running.
- A round gives every running request exactly one step, in admission order: its prefill, or one draft + verify step
  (= one target forward, plus the draft model's forwards for STANDALONE). There is no cross-request batched forward:
  two running requests take about twice as long per round as one, so throughput does not grow with concurrency;
  latency is shared fairly. SGLang batches the running requests into one forward per step instead.
- Finished or cancelled requests leave at once; their KV caches are dropped.

Server-wide counters (since start or the last flush), updated after every step:
`avg_spec_accept_length` = (tokens emitted by all verify steps) / (number of verify steps), over every request,
finished or still running. Per request, the emitted tokens of its verify steps are completion_tokens - 1 (the first
token comes from the prefill), so over finished requests it equals
sum(spec_num_correct_drafts + spec_verify_ct) / sum(spec_verify_ct) = sum(completion_tokens - 1) / sum(spec_verify_ct).
(SGLang's is the same ratio but folded in only every 40 decode iterations; here it is exact at every moment.)
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from serve.engines.cpu.decode import Decoder, Request

__all__ = ["Scheduler", "Counters"]

log = logging.getLogger("serve.engines.cpu")

# called on the worker thread after every step of the request (and once with an error string if a step raised)
Sink = Callable[[Request, str | None], None]


@dataclass
class Counters:
    num_finished_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec_verify_ct: int = 0
    spec_emitted_tokens: int = 0
    spec_num_correct_drafts: int = 0
    spec_num_proposed_drafts: int = 0
    steps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))  # (time, tokens)

    def as_dict(self, speculative: bool) -> dict:
        out = {
            "num_finished_requests": self.num_finished_requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "last_gen_throughput": self._throughput(),
        }
        if speculative:
            ct = self.spec_verify_ct
            out.update({
                "avg_spec_accept_length": self.spec_emitted_tokens / ct if ct else None,
                "spec_verify_ct": ct,
                "spec_emitted_tokens": self.spec_emitted_tokens,
                "spec_num_correct_drafts": self.spec_num_correct_drafts,
                "spec_num_proposed_drafts": self.spec_num_proposed_drafts,
            })
        return out

    def _throughput(self) -> float | None:
        # tokens per second over the last <= 64 steps (SGLang reports its last log interval)
        if len(self.steps) < 2:
            return None
        elapsed = self.steps[-1][0] - self.steps[0][0]
        return sum(n for _, n in list(self.steps)[1:]) / elapsed if elapsed > 0 else None


class Scheduler:
    def __init__(self, decoder: Decoder, max_running_requests: int) -> None:
        self.decoder = decoder
        self.max_running = max_running_requests
        self.counters = Counters()
        self._waiting: collections.deque[tuple[Request, Sink]] = collections.deque()
        self._running: list[tuple[Request, Sink]] = []
        self._cancelled: set[int] = set()
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="cpu-engine-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def submit(self, req: Request, sink: Sink) -> None:
        with self._cond:
            self._waiting.append((req, sink))
            self._cond.notify_all()

    def cancel(self, req: Request) -> None:
        """Drop a request (client gone); it leaves at its next turn."""
        with self._cond:
            self._cancelled.add(id(req))

    def load(self) -> tuple[int, int]:
        with self._cond:
            return len(self._running), len(self._waiting)

    def flush(self) -> bool:
        """Reset the n-gram trie and the counters; refused (False) unless idle, as SGLang's /flush_cache."""
        with self._cond:
            if self._running or self._waiting:
                return False
            if self.decoder.speculator is not None:
                self.decoder.speculator.reset()
            self.counters = Counters()
            return True

    def stats(self, speculative: bool) -> dict:
        with self._cond:
            out = self.counters.as_dict(speculative)
            out["num_running_reqs"] = len(self._running)
            out["num_waiting_reqs"] = len(self._waiting)
            return out

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._running and not self._waiting:
                    self._cond.wait()
                if self._stop:
                    return
                while self._waiting and len(self._running) < self.max_running:
                    self._running.append(self._waiting.popleft())
                batch = list(self._running)
            for item in batch:
                self._turn(*item)

    def _turn(self, req: Request, sink: Sink) -> None:
        if id(req) in self._cancelled:
            self._leave(req, sink)
            return
        try:
            stats = self.decoder.step(req)
        except Exception as err:  # a model error must not kill the worker: fail this request, keep serving
            log.exception("request %s failed", req.rid)
            self._leave(req, sink)
            sink(req, f"{type(err).__name__}: {err}")
            return
        with self._cond:
            c = self.counters
            c.steps.append((time.monotonic(), stats.emitted))
            if stats.verify and self.decoder.speculator is not None:
                c.spec_verify_ct += 1
                c.spec_emitted_tokens += stats.emitted
                c.spec_num_correct_drafts += stats.emitted - 1
                c.spec_num_proposed_drafts += stats.proposed
            if req.finished:
                c.num_finished_requests += 1
                c.prompt_tokens += len(req.prompt_ids)
                c.completion_tokens += len(req.output_ids)
        if req.finished:
            self._leave(req, sink)
        sink(req, None)

    def _leave(self, req: Request, sink: Sink) -> None:
        self.decoder.release(req)
        with self._cond:
            self._running = [item for item in self._running if item[0] is not req]
            self._cancelled.discard(id(req))
