"""Test-only fault switches of the CPU engine (`--test-fault SPEC`, repeatable). Off unless the flag is given.

They exist so that integration tests can make a real engine fail in each way a trial must survive and record
(LAUNCH_FAILED, TIMEOUT, UNHEALTHY, NOT_EQUIVALENT, and a slow config PRUNED by early stopping) instead of faking the failure around it. Nothing in the product
passes this flag; a study can, through `engine.extra_flags`.

SPEC is `KIND[=VALUE][@speculative|@baseline]`:
- `exit-at-start[=CODE]`  exit with CODE (default 3) before loading the model: the engine never gets healthy.
- `slow-start=SECONDS`    sleep SECONDS before loading the model, so `/health` answers that much later.
- `hang-at-start=STARTS`  the first STARTS starts of this scope never get healthy: the process waits before loading
                          the model until it is stopped, so its start times out whatever the timeout (a cold node's
                          first launch). Starts are counted in the folder `$SPECDEC_TEST_FAULT_STATE` names (the
                          study's `engine.env`), which this fault requires.
- `crash-after=N`         the process exits (code 70) when generation request N+1 arrives.
- `hang-after=N`          generation requests after the first N are accepted and never answered.
- `slow-steps=FACTOR`     every scheduler round takes FACTOR (> 1) times as long: after each round the worker sleeps
                          (FACTOR - 1) x the round's own time. Outputs and accept lengths are unchanged, so the engine
                          is a correct but uniformly slower one (a config that cannot beat the baseline).
- `slow-engine=START`     the START-th start (1, 2, ...) of this scope runs as `slow-steps=6`, the others at full
                          speed: one engine instance slower than its siblings as a whole, which no window check sees
                          in a speculative run (pipeline/decide/spread.py). Counted as `hang-at-start` counts.
- `drift-steps=STEP`      the n-th start (0, 1, 2, ...) of any engine with this fault runs every round (1 + STEP x n)
                          times as long, whatever its scope: successive fresh engines decode slower and slower, a
                          drift over a finalist stage that moves the runs measured later (`pipeline.decide.spread`).
                          Counted in the folder `$SPECDEC_TEST_FAULT_STATE` names, across the scopes.
- `slow-after=N`          the first N generation requests are answered at full speed; from the arrival of request
                          N+1 on, every scheduler round runs as under `slow-steps=6`: an engine that turns slow in
                          service (a config measured fast whose served engine then falls behind another), or one
                          slowed only where a trial measures, past the requests it sends first to warm it up.
- `busy-neighbours=N`     when generation request N+1 arrives, busy-looping processes start beside the engine, one per
                          CPU it may run on and pinned to those CPUs, and run until the next `/flush_cache` (once per
                          engine): the engine's threads then wait for their cores as they would beside another
                          program's work. A trial flushes before it measures a window again, so the first measurement
                          window is disturbed and the next is not (pipeline/measure/window.py).
- `wrong-tokens`          the first output token of every answer is replaced by the next token id (the engine decodes
                          on from the true token, so only what the client sees is wrong).
- `batch-noise=SIGMA`     decoding becomes numerically batch-dependent, as bf16 on a GPU under continuous batching is:
                          every decode/verify step's logits get Gaussian noise of standard deviation SIGMA (logit
                          units), drawn from a generator seeded by the round's batch composition (each request's id and
                          length). Request ids are fresh per request, so no two runs see the same noise, the baseline
                          diverges from itself, and a lossless config diverges from the baseline exactly as much (its
                          tokens are argmaxes of equally noisy logits). Prefill logits stay exact: a first token never
                          flips, so `wrong-tokens` stays visible on every answer. For equivalence-mode tests.
Generation requests are `POST /generate`, `/v1/completions` and `/v1/chat/completions`; other routes are never faulty.
`@speculative` arms the fault only when `--speculative-algorithm` is set, `@baseline` only when it is not, `@drafts=N`
only for a speculative config of N draft tokens (`--speculative-num-draft-tokens`). One study's trials share
`extra_flags`, so this is how a study gets a faulty speculative trial next to a correct baseline (which `wrong-tokens`
needs), a slowed baseline that any speculative config beats (`slow-steps=3@baseline`: a test that must reach a PROMOTE
forces it instead of hoping the machine's speed gives one), or one study whose trials each fail their own way
(`exit-at-start@drafts=2`, `hang-after=1@drafts=3`, ...: one point per fault).

Parsing and the per-request decision are pure; `before_start` and `install` apply them to a starting server.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from serve.engines.cpu.neighbours import BusyNeighbours
from serve.spec import FrozenModel

if TYPE_CHECKING:
    from fastapi import FastAPI

    from serve.engines.cpu.decode import Decoder, Request, StepStats

__all__ = ["Fault", "FaultSpecError", "parse_fault", "parse_faults", "armed", "request_action", "turns_slow",
           "before_start", "install", "GENERATION_ROUTES", "CRASH_EXIT_CODE", "FLAG"]

log = logging.getLogger("serve.engines.cpu")

FLAG = "--test-fault"
CRASH_EXIT_CODE = 70  # EX_SOFTWARE: distinguishable from a clean exit and from a signal in the replica's message
DEFAULT_EXIT_CODE = 3
GENERATION_ROUTES = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
SCOPES = ("speculative", "baseline")  # `@scope`: armed only with / only without speculation
DRAFTS_SCOPE = "drafts="  # `@drafts=N`: armed only for a speculative config of N draft tokens
Kind = Literal["exit-at-start", "slow-start", "hang-at-start", "crash-after", "hang-after", "slow-steps",
               "slow-engine", "slow-after", "wrong-tokens", "batch-noise", "busy-neighbours", "drift-steps"]
STATE_ENV = "SPECDEC_TEST_FAULT_STATE"  # where `hang-at-start`, `slow-engine`, `drift-steps` count starts
# `slow-engine`, `slow-after`: beyond the 2.4x two runs of one config measured apart on a busy 2-core box
SLOW_ENGINE_FACTOR = 6.0
_VALUE_RULES: dict[str, tuple[str, type | None]] = {  # kind -> (what its value is, its type; None = takes no value)
    "exit-at-start": ("an exit code 1..255 (default 3)", int),
    "slow-start": ("seconds > 0", float),
    "hang-at-start": ("a count of starts >= 1", int),
    "crash-after": ("a request count >= 0", int),
    "hang-after": ("a request count >= 0", int),
    "busy-neighbours": ("a request count >= 0", int),
    "slow-steps": ("a slow-down factor > 1", float),
    "slow-engine": ("the start (1, 2, ...) that runs slow", int),
    "drift-steps": ("a slow-down step per start > 0", float),
    "slow-after": ("a request count >= 0", int),
    "wrong-tokens": ("no value", None),
    "batch-noise": ("a logit noise scale > 0", float),
}
_USAGE = ("use KIND[=VALUE][@speculative] with KIND one of exit-at-start[=CODE], slow-start=SECONDS, "
          "hang-at-start=STARTS, crash-after=N, hang-after=N, busy-neighbours=N, slow-steps=FACTOR, slow-engine=START, "
          "drift-steps=STEP, "
          "slow-after=N, wrong-tokens, "
          "batch-noise=SIGMA")


class FaultSpecError(ValueError):
    """A `--test-fault` value that does not parse; the message names the value and the fix."""


class Fault(FrozenModel):
    kind: Kind
    value: float | None = None  # exit code, seconds or request count, per kind
    scope: str | None = None  # "speculative", "baseline", "drafts=N"; None: armed always

    def __str__(self) -> str:
        value = "" if self.value is None else f"={self.value:g}"
        return f"{self.kind}{value}{'@' + self.scope if self.scope else ''}"


def parse_fault(text: str) -> Fault:
    """`KIND[=VALUE][@speculative|@baseline]` -> Fault; FaultSpecError naming the value and the fix."""
    spec, _, scope = text.strip().partition("@")
    drafts = scope.removeprefix(DRAFTS_SCOPE) if scope.startswith(DRAFTS_SCOPE) else None
    if scope and scope not in SCOPES and not (drafts and drafts.isdigit() and int(drafts) >= 1):
        raise FaultSpecError(f"{FLAG}: unknown scope '@{scope}' in {text!r}; the scopes are '@speculative', "
                             f"'@baseline' and '@drafts=N' with N >= 1 (omit it to arm the fault always)")
    kind, has_value, raw = spec.partition("=")
    if kind not in _VALUE_RULES:
        raise FaultSpecError(f"{FLAG}: unknown fault {kind!r} in {text!r}; {_USAGE}")
    what, kind_type = _VALUE_RULES[kind]
    value: float | None = None
    if kind_type is None:
        if has_value:
            raise FaultSpecError(f"{FLAG}: {kind} takes no value, got {text!r}; write {kind!r}")
    elif has_value:
        try:
            value = float(kind_type(raw))
        except ValueError:
            raise FaultSpecError(f"{FLAG}: {kind} needs {what}, got {raw!r} in {text!r}") from None
    elif kind == "exit-at-start":
        value = DEFAULT_EXIT_CODE
    else:
        raise FaultSpecError(f"{FLAG}: {kind} needs {what}, e.g. '{kind}=1'; got {text!r}")
    if value is not None and not _in_range(kind, value):
        raise FaultSpecError(f"{FLAG}: {kind} needs {what}, got {raw!r} in {text!r}")
    return Fault(kind=kind, value=value, scope=scope or None)  # type: ignore[arg-type]


def _in_range(kind: str, value: float) -> bool:
    if kind == "exit-at-start":
        return 1 <= value <= 255
    if kind in ("slow-start", "batch-noise", "drift-steps"):
        return value > 0
    if kind in ("hang-at-start", "slow-engine"):
        return value >= 1
    if kind == "slow-steps":
        return value > 1
    return value >= 0


def parse_faults(texts: Iterable[str]) -> tuple[Fault, ...]:
    """Every `--test-fault` value parsed; at most one fault per kind and engine (two would contradict each other),
    so a kind may come twice only as `@speculative` and `@baseline` (e.g. a study that slows both, by different
    factors)."""
    faults = tuple(parse_fault(t) for t in texts)
    repeated: set[str] = set()
    sizes = sorted({n for n in (_drafts(f) for f in faults) if n is not None})
    engines: list[tuple[bool, int | None]] = [(False, None), (True, None), *((True, n) for n in sizes)]
    for speculative, drafts in engines:  # every kind of engine the flags could start, and the faults it would arm
        kinds = [f.kind for f in faults if _applies(f, speculative, drafts)]
        repeated |= {kind for kind in kinds if kinds.count(kind) > 1}
    if repeated:
        raise FaultSpecError(f"{FLAG}: {', '.join(sorted(repeated))} given more than once for one engine; give each "
                             "kind at most once per engine (e.g. once @speculative and once @baseline, or once per "
                             "@drafts=N)")
    return faults


def _drafts(fault: Fault) -> int | None:
    scope = fault.scope or ""
    return int(scope.removeprefix(DRAFTS_SCOPE)) if scope.startswith(DRAFTS_SCOPE) else None


def _applies(fault: Fault, speculative: bool, draft_tokens: int | None) -> bool:
    if fault.scope is None:
        return True
    if fault.scope in SCOPES:
        return fault.scope == ("speculative" if speculative else "baseline")
    return speculative and _drafts(fault) == draft_tokens


def armed(faults: Iterable[Fault], speculative: bool, draft_tokens: int | None = None) -> dict[str, Fault]:
    """The faults that apply to an engine running with (`speculative`, `draft_tokens` drafts) or without
    speculation, by kind. Pure."""
    return {f.kind: f for f in faults if _applies(f, speculative, draft_tokens)}


def request_action(faults: dict[str, Fault], method: str, path: str, count: int
                   ) -> Literal["pass", "crash", "hang", "neighbours"]:
    """What to do with an incoming request, `count` being the generation requests seen before it. Pure.
    A crash wins over a hang when both are due: the process is gone either way. "neighbours": start the busy
    neighbours (the caller starts them once)."""
    if method != "POST" or path not in GENERATION_ROUTES:
        return "pass"
    neighbours = faults.get("busy-neighbours")
    if neighbours is not None and count == (neighbours.value or 0):
        return "neighbours"
    crash, hang = faults.get("crash-after"), faults.get("hang-after")
    if crash is not None and count >= (crash.value or 0):
        return "crash"
    if hang is not None and count >= (hang.value or 0):
        return "hang"
    return "pass"


def turns_slow(faults: dict[str, Fault], method: str, path: str, count: int) -> bool:
    """Whether `slow-after` runs the engine slow from this incoming request on, `count` being the generation requests
    seen before it. Pure."""
    slow = faults.get("slow-after")
    return slow is not None and method == "POST" and path in GENERATION_ROUTES and count >= (slow.value or 0)


def count_start(fault: Fault, speculative: bool, state: str | None) -> int:
    """How many starts of `fault`'s kind and this scope came before this one (counted, and this one recorded, in the
    folder `state`). FaultSpecError without a folder: the count must outlive the engine process."""
    if not state:
        raise FaultSpecError(f"{FLAG}: {fault} counts starts across engine processes in a folder; set {STATE_ENV} "
                             "in the engine's environment (engine.env)")
    folder = Path(state)
    folder.mkdir(parents=True, exist_ok=True)
    # `drift-steps` drifts every engine of the stage alike, so its starts are counted across the scopes
    scope = "any" if fault.kind == "drift-steps" else "speculative" if speculative else "baseline"
    prefix = f"{fault.kind}-{scope}-"
    started = len(list(folder.glob(f"{prefix}*")))
    (folder / f"{prefix}{started}-{os.getpid()}").touch()
    return started


def hangs_this_start(fault: Fault, speculative: bool, state: str | None) -> bool:
    """Whether this start is one of the first `fault.value` of its scope (`count_start`)."""
    return count_start(fault, speculative, state) < int(fault.value or 1)


def before_start(faults: Iterable[Fault], speculative: bool, sleep: Callable[[float], None] = time.sleep,
                 hang: Callable[[], None] | None = None, *, draft_tokens: int | None = None) -> int | None:
    """Apply the start-up faults: an exit code to return from the server's main, or None to go on starting
    (after sleeping for `slow-start`; never, for a start `hang-at-start` hangs: `hang` waits until the process is
    stopped). Logs every armed fault so the engine log says this engine misbehaves on purpose."""
    active = armed(faults, speculative, draft_tokens)
    for fault in active.values():
        log.warning("TEST FAULT armed: %s (testing only: this engine misbehaves on purpose)", fault)
    if "hang-at-start" in active and hangs_this_start(active["hang-at-start"], speculative,
                                                     os.environ.get(STATE_ENV)):
        log.error("TEST FAULT hang-at-start: this start never gets healthy; waiting to be stopped")
        (hang or threading.Event().wait)()
    if "exit-at-start" in active:
        code = int(active["exit-at-start"].value or DEFAULT_EXIT_CODE)
        log.error("TEST FAULT exit-at-start: exiting with code %d before loading the model", code)
        return code
    if "slow-start" in active:
        seconds = float(active["slow-start"].value or 0)
        log.warning("TEST FAULT slow-start: sleeping %.1f s before loading the model", seconds)
        sleep(seconds)
    return None


def install(app: FastAPI, engine: Any) -> None:
    """Arm the request-time faults of `engine.config.test_faults` on a server that has not started yet.
    `engine` is a `serve.engines.cpu.engine.LoadedEngine`; not imported here, since the engine's config imports this."""
    active = armed(engine.config.test_faults, engine.speculative, getattr(engine.config.spec, "num_draft_tokens", None))
    slow_from: threading.Event | None = threading.Event() if "slow-after" in active else None
    if "crash-after" in active or "hang-after" in active or "busy-neighbours" in active or slow_from is not None:
        app.add_middleware(_RequestFaults, faults=active, slow_from=slow_from)
    # The scheduler's worker calls `scheduler.decoder.step_many` for every round; nothing else steps requests.
    if "wrong-tokens" in active:
        wrong = _WrongFirstToken(engine.decoder, engine.runner.vocab_size)
        engine.scheduler.decoder = wrong  # type: ignore[assignment]
    if "batch-noise" in active:
        noisy = _BatchNoise(engine.scheduler.decoder, engine.decoder, float(active["batch-noise"].value or 0.0))
        engine.scheduler.decoder = noisy  # type: ignore[assignment]
    if "slow-steps" in active:
        slow = _SlowSteps(engine.scheduler.decoder, float(active["slow-steps"].value or 1.0))
        engine.scheduler.decoder = slow  # type: ignore[assignment]
    odd = active.get("slow-engine")
    if odd is not None and count_start(odd, engine.speculative, os.environ.get(STATE_ENV)) + 1 == int(odd.value or 1):
        log.warning("TEST FAULT slow-engine: this start runs every round %gx as long", SLOW_ENGINE_FACTOR)
        engine.scheduler.decoder = _SlowSteps(engine.scheduler.decoder, SLOW_ENGINE_FACTOR)  # type: ignore[assignment]
    drift = active.get("drift-steps")
    if drift is not None:
        factor = 1 + float(drift.value or 0) * count_start(drift, engine.speculative, os.environ.get(STATE_ENV))
        log.warning("TEST FAULT drift-steps: this start runs every round %gx as long", factor)
        if factor > 1:
            engine.scheduler.decoder = _SlowSteps(engine.scheduler.decoder, factor)  # type: ignore[assignment]
    if slow_from is not None:
        engine.scheduler.decoder = _SlowSteps(engine.scheduler.decoder, SLOW_ENGINE_FACTOR,  # type: ignore[assignment]
                                              when=slow_from)


class _RequestFaults:
    """ASGI middleware: counts generation requests and crashes or hangs as `request_action` says; sets `slow_from`
    (which the scheduler's `_SlowSteps` reads) when `turns_slow` says."""

    def __init__(self, app: Any, faults: dict[str, Fault], slow_from: threading.Event | None = None) -> None:
        self.app = app
        self.faults = faults
        self.count = 0
        self.neighbours: BusyNeighbours | None = None
        self.slow_from = slow_from

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope.get("path") == "/flush_cache" and self.neighbours is not None:
            self.neighbours.stop()
        action = request_action(self.faults, scope.get("method", ""), scope.get("path", ""), self.count)
        if (self.slow_from is not None and not self.slow_from.is_set()
                and turns_slow(self.faults, scope.get("method", ""), scope.get("path", ""), self.count)):
            self.slow_from.set()
            log.warning("TEST FAULT slow-after: generation request %d arrived; every round from now on runs %gx as "
                        "long", self.count + 1, SLOW_ENGINE_FACTOR)
        if scope.get("method") == "POST" and scope.get("path") in GENERATION_ROUTES:
            self.count += 1
        if action == "neighbours" and self.neighbours is None:
            self.neighbours = BusyNeighbours()
            log.warning("TEST FAULT busy-neighbours: generation request %d arrived; %d busy processes run on CPUs %s "
                        "until the next /flush_cache", self.count, len(self.neighbours.cpus), self.neighbours.cpus)
        if action == "crash":
            log.error("TEST FAULT crash-after: generation request %d arrived; exiting with code %d",
                      self.count, CRASH_EXIT_CODE)
            sys.stderr.flush()
            os._exit(CRASH_EXIT_CODE)  # no cleanup, no answer: what a segfaulting engine looks like from outside
        if action == "hang":
            log.warning("TEST FAULT hang-after: generation request %d accepted and never answered", self.count)
            # Hold the request until the client goes away, so a dropped connection frees the task.
            while (await receive())["type"] != "http.disconnect":
                pass
            return
        await self.app(scope, receive, send)


class _WrongFirstToken:
    """Decoder stand-in: after a request's prefill, its first output token becomes the next id in the vocabulary.
    `tokens` (what the model decodes on) keeps the true token, so decoding goes on normally."""

    def __init__(self, inner: Decoder, vocab_size: int) -> None:
        self._inner = inner
        self._vocab_size = vocab_size

    def step_many(self, reqs: Sequence[Request]) -> list[StepStats | Exception]:
        results = self._inner.step_many(reqs)
        for req, result in zip(reqs, results):
            if not isinstance(result, Exception):
                self._corrupt(req, result)
        return results

    def _corrupt(self, req: Request, stats: StepStats) -> None:
        if not stats.verify and req.output_ids:
            req.output_ids[0] = (req.output_ids[0] + 1) % self._vocab_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _SlowSteps:
    """Decoder stand-in: each round is followed by a sleep of (factor - 1) x its own duration, in the worker thread
    (the HTTP server keeps answering); with `when`, only rounds that start once it is set. Wraps whatever decoder the
    scheduler holds, so it combines with wrong-tokens."""

    def __init__(self, inner: Any, factor: float, when: threading.Event | None = None) -> None:
        self._inner = inner
        self._factor = factor
        self._when = when

    def step_many(self, reqs: Sequence[Request]) -> list[Any]:
        if self._when is not None and not self._when.is_set():
            return self._inner.step_many(reqs)
        # a round is one batched step: slowing the round slows every request in it by the same factor
        started = time.perf_counter()
        results = self._inner.step_many(reqs)
        time.sleep((self._factor - 1) * (time.perf_counter() - started))
        return results

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _BatchNoise:
    """Decoder stand-in: seeds the round's logit noise from its batch composition, then runs the round; `decoder`
    (the real one) adds that noise to every decode/verify logit through its `logit_noise` hook."""

    def __init__(self, inner: Any, decoder: Decoder, sigma: float) -> None:
        import torch

        self._inner = inner
        self._sigma = sigma
        self._generator = torch.Generator()
        decoder.logit_noise = self._perturb

    def step_many(self, reqs: Sequence[Request]) -> list[Any]:
        composition = repr(sorted((r.rid, len(r.tokens)) for r in reqs)).encode()
        self._generator.manual_seed(int.from_bytes(hashlib.sha256(composition).digest()[:8], "little"))
        return self._inner.step_many(reqs)

    def _perturb(self, logits: Any) -> Any:
        import torch

        return logits + self._sigma * torch.randn(logits.shape, generator=self._generator, dtype=logits.dtype)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)
