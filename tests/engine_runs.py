"""The CPU engine's real scheduler driven closed loop, in process, with every request's accepted lengths read step by
step: what the simulator's exactness tests (and `benchmarks/draft_replay_exact.py`) compare a replay against."""

from __future__ import annotations

import threading

from serve.engines.cpu.decode import Decoder, Request, StopRules
from serve.engines.cpu.engine import eos_ids_of
from serve.engines.cpu.scheduler import Scheduler
from serve.engines.cpu.verify import Sampling

DEADLINE_S = 300.0


def engine_run(runner, tokenizer, speculator, phases: list[list[list[int]]], concurrency: int, *,
               max_new_tokens: int, deadline_s: float = DEADLINE_S
               ) -> tuple[dict[tuple[int, int], list[int]], dict[tuple[int, int], list[int]]]:
    """Every phase through a real Scheduler, closed loop; per request (phase, position): (output ids, kept tokens
    of each verify step). Every submission after the first happens in a request's sink on the worker thread, so it
    is queued before the next round admits (a phase's first requests after the previous phase's last one).
    Raises RuntimeError when the phases take longer than `deadline_s` or a request fails."""
    decoder = Decoder(runner, tokenizer, speculator)
    scheduler = Scheduler(decoder, max_running_requests=16)
    eos = eos_ids_of(runner.model, tokenizer)
    seen: dict[tuple[int, int], list[int]] = {}
    last: dict[tuple[int, int], int] = {}
    outputs: dict[tuple[int, int], list[int]] = {}
    errors: list[str] = []
    done = threading.Event()
    state = {"phase": 0, "sent": 0, "finished": 0}

    def request(phase: int, position: int) -> Request:
        return Request(rid=f"{phase}-{position}", prompt_ids=list(phases[phase][position]),
                       sampling=Sampling(temperature=0.0),
                       rules=StopRules(max_new_tokens=max_new_tokens, eos_ids=eos), seed=0)

    def open_phase(phase: int) -> None:
        state.update(phase=phase, sent=min(concurrency, len(phases[phase])), finished=0)
        for position in range(state["sent"]):
            scheduler.submit(request(phase, position), sink)

    def sink(req: Request, error: str | None) -> None:  # the worker thread, after each step of `req`
        if error is not None:
            errors.append(error)
            done.set()
            return
        key = (int(req.rid.split("-")[0]), int(req.rid.split("-")[1]))
        if key in last:
            seen.setdefault(key, []).append(len(req.output_ids) - last[key])
        last[key] = len(req.output_ids)
        if not req.finished:
            return
        outputs[key] = list(req.output_ids)
        state["finished"] += 1
        phase = state["phase"]
        if state["sent"] < len(phases[phase]):  # this client's next request
            scheduler.submit(request(phase, state["sent"]), sink)
            state["sent"] += 1
        elif state["finished"] == len(phases[phase]):
            if phase + 1 < len(phases):
                open_phase(phase + 1)
            else:
                done.set()

    open_phase(0)  # before the worker starts: the first round admits all of them
    scheduler.start()
    try:
        if not done.wait(deadline_s):
            raise RuntimeError(f"the engine did not finish the phases in {deadline_s:.0f} s")
    finally:
        scheduler.stop()
    if errors:
        raise RuntimeError(f"the engine failed a request: {errors}")
    return outputs, seen
