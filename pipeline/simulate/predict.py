"""Predicted figures of one config: the replay's rounds timed by the cost model, summarized with the definitions of
`pipeline.measure.summary.Summary` (throughput over the measurement window, accept length, TTFT / ITL / e2e
percentiles in ms, requests per second).

Closed loop: a replay without a cost fixes who is in which round; `timed` then gives each round its duration in
order. A client sends its next request `gap_s` after a reply (the baseline's figure), and the engine idles when no
request is there. Open loop: arrival times are in seconds, so the replay itself runs with the cost
(`replay(..., cost=model.seconds)`), and its times are read as they are. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.simulate.cost import CostModel
from pipeline.simulate.replay import Replay, RequestReplay, Round
from serve.latency import LATENCY_FIELDS

__all__ = ["PREDICTABLE_METRICS", "PREDICTION_ATTR", "Timed", "decode_rounds", "predicted_metrics", "timed"]

# The Optuna user attribute of a launched simulate-first trial: its predicted figures (read by the report's plot)
PREDICTION_ATTR = "simulate.predicted"
# Summary fields a prediction gives (the objective and SLA metrics the simulator can search for)
PREDICTABLE_METRICS: tuple[str, ...] = (
    "tput_tok_s", "req_per_s", "accept_len", "accept_len_drafts", "window_s", "completion_tokens", *LATENCY_FIELDS)


@dataclass(frozen=True)
class Timed:
    """A request's predicted times (seconds on the replay's clock)."""

    arrival_s: float
    first_token_s: float
    finished_s: float
    step_ends_s: tuple[float, ...]
    completion_tokens: int
    verify_ct: int
    correct_drafts: int


def timed(replay: Replay, model: CostModel, phase: str = "measure", *, already_timed: bool = False,
          seconds: Callable[[Round], float] | None = None) -> list[Timed]:
    """The requests of `phase` with times: from the replay itself when it ran with a cost (`already_timed`), else by
    walking its rounds in order with `model`'s durations (closed loop; `seconds`, when given, is `model.seconds`
    memoized by the caller)."""
    seconds = seconds or model.seconds
    requests = replay.phase(phase)
    if already_timed:
        return [Timed(r.arrival_s, r.first_token_s, r.finished_s, tuple(r.step_ends_s), r.completion_tokens,
                      r.spec_verify_ct, r.spec_num_correct_drafts) for r in requests]
    every = list(replay.requests)
    joined: dict[int, list[RequestReplay]] = {}
    leaving: dict[int, int] = {}
    for r in every:
        joined.setdefault(r.admitted_round, []).append(r)
        leaving[r.finished_round] = leaving.get(r.finished_round, 0) + 1
    ends: list[float] = []

    def arrival(r: RequestReplay) -> float:
        return ends[r.after_round] + model.gap_s if r.after_round >= 0 else 0.0

    now, running = 0.0, 0
    for index, rnd in enumerate(replay.rounds):
        new = joined.get(index, [])
        if running == 0 and new:  # the engine was idle: the round starts when its first request is there
            now = max(now, min(arrival(r) for r in new))
        now += seconds(rnd)
        ends.append(now)
        running += len(new) - leaving.get(index, 0)
    return [Timed(arrival(r), ends[r.admitted_round], ends[r.finished_round],
                  tuple(ends[r.admitted_round + 1 + i] for i in range(r.spec_verify_ct)), r.completion_tokens,
                  r.spec_verify_ct, r.spec_num_correct_drafts) for r in requests]


def decode_rounds(replay: Replay, phase: str = "measure") -> tuple[tuple[Round, ...], ...]:
    """For each request of `phase`, the rounds it decoded in after its prefill round (what `cost.Launch` needs)."""
    out = []
    for r in replay.phase(phase):
        first = r.admitted_round + 1
        out.append(tuple(replay.rounds[first:r.finished_round + 1]) if r.spec_verify_ct else ())
    return tuple(out)


def predicted_metrics(requests: Sequence[Timed], speculative: bool) -> dict[str, float]:
    """Summary-named figures of the predicted requests (None-valued figures left out)."""
    if not requests:
        return {}
    start = min(r.arrival_s for r in requests)
    end = max(r.finished_s for r in requests)
    window = max(end - start, 1e-9)
    tokens = sum(r.completion_tokens for r in requests)
    out: dict[str, float] = {"window_s": window, "completion_tokens": float(tokens), "tput_tok_s": tokens / window,
                             "req_per_s": len(requests) / window}
    verify = sum(r.verify_ct for r in requests if r.verify_ct)
    if speculative and verify:
        out["accept_len"] = sum(r.completion_tokens for r in requests if r.verify_ct) / verify
        out["accept_len_drafts"] = 1.0 + sum(r.correct_drafts for r in requests if r.verify_ct) / verify
    itl = [b - a for r in requests for a, b in zip((r.first_token_s, *r.step_ends_s), r.step_ends_s)]
    for name, values in (("ttft", [r.first_token_s - r.arrival_s for r in requests]), ("itl", itl),
                         ("e2e", [r.finished_s - r.arrival_s for r in requests])):
        if values:
            for q, value in zip((50, 90, 99), np.percentile(np.asarray(values) * 1000.0, [50, 90, 99])):
                out[f"{name}_p{q}_ms"] = float(value)
    return out
