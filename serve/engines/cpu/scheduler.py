"""FIFO queue + one worker thread that steps all running requests together, one round at a time.

What batching the engine does (and does not do):
- Requests wait in one FIFO queue. At the start of every round the worker admits waiting requests, oldest first,
  while fewer than `max_running_requests` are running and the token budget has room (below).
- A round gives every running request exactly one step (`Decoder.step_many`): new requests their prefill, one by one;
  the others one draft + verify step each, all verified in ONE target forward where the runner batches (the fast
  Llama path: every weight matmul over all requests' query rows, attention per request against its own cache;
  STANDALONE's draft-model forwards stay per request). Like SGLang's decode batch, a round's cost grows less than
  linearly with the number of running requests, so throughput rises with concurrency while each request's
  inter-token latency grows; on HF modules (Gemma 3) the forwards stay one per request.
- Finished or cancelled requests leave at once; their KV caches are dropped. Cancelling sets a flag on the
  request's `Ticket` (never a key derived from the object's address, which a later request may reuse).

Bounds (so that no client can make the engine grow without limit):
- `max_queued_requests` waiting requests at most (SGLang's `--max-queued-requests`); one more raises `QueueFull`
  (the server answers 429 with Retry-After; SGLang answers 503 "The request queue is full.").
- `max_total_tokens` (SGLang's `--max-total-tokens`, the KV pool): a running request reserves prompt_tokens +
  max_new_tokens; a waiting request is admitted only when its reservation fits beside the running ones (one request
  always runs when nothing else does). A request whose reservation alone exceeds the budget raises `TooLarge` (400).
- Internal requests (the `/health` probe) skip both bounds and the counters, as SGLang's `log_metrics=False`.

Server-wide counters (since start or the last flush):
- Exact, engine-only extras, updated after every step: `spec_verify_ct`, `spec_emitted_tokens`,
  `spec_num_correct_drafts`, `spec_num_proposed_drafts`, `num_finished_requests`, `prompt_tokens`,
  `completion_tokens`. Over finished requests, spec_emitted_tokens / spec_verify_ct
  = sum(completion_tokens - 1) / sum(spec_verify_ct).
- `avg_spec_accept_length`, as SGLang 0.5.23 reports it (`metrics_reporter.py` `update_spec_metrics`,
  `report_decode_stats`; `internal_state.py` `_average_accept_length`): a round with at least one verify step is one
  "decode batch"; it adds its verify steps (SGLang's batch size) and their accepted drafts + 1 each (before a stop
  rule's cut, as SGLang's `get_num_generated_tokens`) to a window; every
  `DECODE_LOG_INTERVAL` (40) decode batches the window is folded into the totals; the key is present only once the
  totals hold a verify step, as totals_emitted / totals_verify_steps. So the last < 40 batches are missing, and
  right after start or a flush (which resets window, totals and the batch count) the key is absent.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from serve.engines.cpu.decode import Request, StepStats

__all__ = ["Scheduler", "Stepper", "Counters", "Ticket", "QueueFull", "TooLarge", "DECODE_LOG_INTERVAL",
           "DEFAULT_MAX_QUEUED_REQUESTS"]

log = logging.getLogger("serve.engines.cpu")

DECODE_LOG_INTERVAL = 40  # SGLang's --decode-log-interval default
DEFAULT_MAX_QUEUED_REQUESTS = 128

# called on the worker thread after every step of the request (and once with an error string if a step raised)
Sink = Callable[[Request, str | None], None]


class Resettable(Protocol):
    def reset(self) -> None: ...


class Stepper(Protocol):
    """What the scheduler drives: `Decoder` in the engine, a stand-in that records the order of steps in tests.
    `step_many` gets each round's running requests in admission order and returns one result per request (its
    `StepStats` or the exception its step raised); `release` when a request leaves; `speculator` is None without
    speculative decoding, else reset on flush. A `begin_round()`, where defined, runs before each round."""

    @property
    def speculator(self) -> Resettable | None: ...
    def step_many(self, reqs: list[Request]) -> Sequence[StepStats | Exception]: ...
    def release(self, req: Request) -> None: ...


class QueueFull(RuntimeError):
    """The waiting queue holds `max_queued_requests`: try again later."""


class TooLarge(ValueError):
    """The request's prompt + max_new_tokens exceed the whole token budget: it could never run."""


@dataclass(eq=False)
class Ticket:
    """One submitted request and its scheduling state."""

    req: Request
    sink: Sink
    internal: bool = False
    reserved: int = 0
    cancelled: bool = False


@dataclass
class Counters:
    num_finished_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec_verify_ct: int = 0
    spec_emitted_tokens: int = 0
    spec_num_correct_drafts: int = 0
    spec_num_proposed_drafts: int = 0
    decode_batches: int = 0  # SGLang's forward_ct_decode
    window_verify: int = 0  # SGLang's spec_num_forward_ct (this log interval)
    window_emitted: int = 0  # spec_num_accept_tokens
    total_verify: int = 0  # spec_total_num_forward_ct (folded)
    total_emitted: int = 0  # spec_total_num_accept_tokens
    # Rounds of one request decoding one token (no prefill, no drafts): the rounds the engine's round table prices
    # directly (its plain step), timed here, so a measurement window can compare what its steps cost with what the
    # engine measured on a quiet machine (pipeline/measure/window.py). Ours, not SGLang's.
    solo_plain_rounds: int = 0
    solo_plain_s: float = 0.0
    solo_plain_context: int = 0  # the sum of those rounds' context lengths (tokens in the cache before the step)
    steps: collections.deque = field(default_factory=lambda: collections.deque(maxlen=64))  # (time, tokens)

    def end_round(self, verify: int, emitted: int) -> None:
        if not verify:
            return
        self.window_verify += verify
        self.window_emitted += emitted
        self.decode_batches += 1
        if self.decode_batches % DECODE_LOG_INTERVAL == 0:
            self.total_verify += self.window_verify
            self.total_emitted += self.window_emitted
            self.window_verify = self.window_emitted = 0

    def as_dict(self, speculative: bool) -> dict:
        out = {
            "num_finished_requests": self.num_finished_requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "last_gen_throughput": self._throughput(),
            "solo_plain_rounds": self.solo_plain_rounds,
            "solo_plain_ms": self.solo_plain_s * 1000.0,
            "solo_plain_context": self.solo_plain_context,
        }
        if speculative:
            if self.total_verify > 0:
                out["avg_spec_accept_length"] = self.total_emitted / self.total_verify
            out.update({
                "spec_verify_ct": self.spec_verify_ct,
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
    def __init__(self, decoder: Stepper, max_running_requests: int,
                 max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS, max_total_tokens: int | None = None) -> None:
        self.decoder = decoder
        self.max_running = max_running_requests
        self.max_queued = max_queued_requests
        self.max_total_tokens = max_total_tokens
        self.counters = Counters()
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._running: list[Ticket] = []
        self._reserved = 0
        self._watchers: list[Callable[[], None]] = []
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

    def submit(self, req: Request, sink: Sink, internal: bool = False) -> Ticket:
        """Queue `req`; raise QueueFull or TooLarge (see the module docstring) instead of growing without bound."""
        reserved = len(req.prompt_ids) + req.rules.max_new_tokens
        ticket = Ticket(req, sink, internal=internal, reserved=0 if internal else reserved)
        with self._cond:
            if not internal:
                if self.max_total_tokens is not None and reserved > self.max_total_tokens:
                    raise TooLarge(f"prompt_tokens + max_new_tokens = {reserved} exceeds this engine's token budget "
                                   f"--max-total-tokens={self.max_total_tokens}; send a shorter prompt or fewer "
                                   "new tokens")
                if sum(not t.internal for t in self._waiting) >= self.max_queued:
                    raise QueueFull(f"The request queue is full ({self.max_queued} waiting, "
                                    "--max-queued-requests); retry later")
            self._waiting.append(ticket)
            self._cond.notify_all()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Drop a request (client gone): at once if it still waits, else at its next turn."""
        with self._cond:
            ticket.cancelled = True
            if ticket in self._waiting:
                self._waiting.remove(ticket)
                waiting = True
            else:
                waiting = False
        if waiting:
            self._notify()

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` (on the worker thread) after every step and whenever a request leaves; returns the
        function that stops it. For waiters such as /health and /flush_cache?timeout=."""
        with self._cond:
            self._watchers.append(callback)

        def unwatch() -> None:
            with self._cond:
                if callback in self._watchers:
                    self._watchers.remove(callback)

        return unwatch

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
            out["max_queued_requests"] = self.max_queued
            out["max_total_num_tokens"] = self.max_total_tokens
            out["reserved_tokens"] = self._reserved
            return out

    def _admit(self) -> None:
        # FIFO, head of line: a big request at the front waits for room rather than being overtaken forever
        while self._waiting and len(self._running) < self.max_running:
            head = self._waiting[0]
            fits = (self.max_total_tokens is None or not self._running
                    or self._reserved + head.reserved <= self.max_total_tokens)
            if not fits:
                break
            self._waiting.popleft()
            self._reserved += head.reserved
            self._running.append(head)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._running and not self._waiting:
                    self._cond.wait()
                if self._stop:
                    return
                self._admit()
                batch = list(self._running)
            # NGRAM: the previous round's inserts land now, as SGLang's synchronize() before a batch drafts.
            # getattr: decoders that keep no round-level state (test doubles) need not define it.
            begin_round = getattr(self.decoder, "begin_round", None)
            if begin_round is not None:
                begin_round()
            live = []
            for ticket in batch:
                if ticket.cancelled:
                    self._leave(ticket)
                else:
                    live.append(ticket)
            verify = emitted = 0
            # a lone plain decode step: the cache holds the prompt and every output token but the one it decodes
            solo = (len(live) == 1 and not live[0].internal and self.decoder.speculator is None
                    and bool(live[0].req.output_ids))
            context = len(live[0].req.prompt_ids) + len(live[0].req.output_ids) - 1 if solo else 0
            started = time.perf_counter()
            results = self.decoder.step_many([t.req for t in live])
            elapsed = time.perf_counter() - started
            for ticket, result in zip(live, results):
                stats = self._settle(ticket, result)
                if stats is not None and stats.verify and self.decoder.speculator is not None:
                    verify += 1
                    # SGLang's window adds correct drafts + 1 per request (get_num_generated_tokens), uncut
                    emitted += stats.correct + 1
            with self._cond:
                self.counters.end_round(verify, emitted)
                if solo and not isinstance(results[0], Exception):
                    self.counters.solo_plain_rounds += 1
                    self.counters.solo_plain_s += elapsed
                    self.counters.solo_plain_context += context

    def _settle(self, ticket: Ticket, result: StepStats | Exception) -> StepStats | None:
        req, sink = ticket.req, ticket.sink
        if isinstance(result, Exception):  # a model error must not kill the worker: fail this request, keep serving
            log.error("request %s failed", req.rid, exc_info=result)
            self._leave(ticket)
            sink(req, f"{type(result).__name__}: {result}")
            return None
        stats = result
        if not ticket.internal:
            with self._cond:
                c = self.counters
                c.steps.append((time.monotonic(), stats.emitted))
                if stats.verify and self.decoder.speculator is not None:
                    c.spec_verify_ct += 1
                    c.spec_emitted_tokens += stats.emitted
                    c.spec_num_correct_drafts += stats.correct
                    c.spec_num_proposed_drafts += stats.proposed
                if req.finished:
                    c.num_finished_requests += 1
                    c.prompt_tokens += len(req.prompt_ids)
                    c.completion_tokens += len(req.output_ids)
        if req.finished:
            self._leave(ticket)
        sink(req, None)
        self._notify()
        return None if ticket.internal else stats

    def _leave(self, ticket: Ticket) -> None:
        self.decoder.release(ticket.req)
        with self._cond:
            if ticket in self._running:
                self._running.remove(ticket)
                self._reserved -= ticket.reserved
        self._notify()

    def _notify(self) -> None:
        with self._cond:
            watchers = list(self._watchers)
        for callback in watchers:
            callback()
