"""The verify-cost shape of an engine that measures none itself (SGLang's own server, llama-server, vLLM), measured
over its HTTP API during the baseline's launch, as the round table the step-cost model reads
(`pipeline.simulate.cost.RoundTable`, the fields of the CPU engine's `/server_info` `verify_cost.round_cost`).

What a verify round is, seen from the API: a request whose prompt is a cached context plus w new tokens and that
generates one token runs one forward of w query tokens against that context -- a verify step of width w; b such
requests in one batched call are one round of b requests (SGLang sends a batch of token-id prompts to its scheduler
as one message, which prefills them in one forward; llama-server puts the prompts of one call in parallel slots,
decoded in one batch). SGLang computes the logits of every query row of a verify (its NGRAM trees are padded to w
nodes); its extend does so when asked for the prompt's logprobs from the context on (`return_logprob`,
`logprob_start_len`), so on SGLang every cell holds the logits of all b x w rows and the LM-head column is flat.
llama-server's API has no way to ask for the logits of prompt positions: its cells hold the b roots' logits only
(`logit_rows` says which), and its verify's other rows are not in the table.
vLLM (`/v1/completions`: token-id prompts, one scheduler step) computes a verify's logits for every query row in one
matmul, but prompt logprobs skip its prefix cache: its cells hold the roots' rows, and the LM head by rows is
measured apart, as the CPU engine's table has it: `lm_head_ms[m]` = T(fresh m + 1 tokens, `prompt_logprobs`) -
T(the same, without). Its cache hits come from `/metrics`, and its columns are read as lines (pipeline/measure/
vllm_probe.py).

A call's client time is the forward plus what every request costs outside it (HTTP, tokenizer, scheduling,
detokenizer), which is no part of a verify step's shape. So nothing is read from one call alone:
- the width column: extend(b, w) - extend(b, 1), two calls of the same b requests: the outside costs cancel;
- its base, the plain step of b requests: (T(b requests x 9 tokens) - T(b requests x 1 token)) / 8, eight decode
  steps with nothing else in the difference;
- the context term: the same step after LONG_CONTEXT_TOKENS instead of CONTEXT_TOKENS.
cell(b, w) = step(b) + extend(b, w) - extend(b, 1): the table holds forward costs only, as the CPU engine's does, so
the cost model's fit keeps its meaning (k = 1 on the baseline; `o`, the per-request cost of a round outside the
forward, fitted to the baseline's own steps). Every timing is the fastest of PASSES (vLLM: VLLM_PASSES) interleaved
passes (other work only ever adds time). A request that found its context evicted (cached tokens != the context) is
no sample: its prefix is cached again and the call repeated.

The table is read as measured (`as_measured`: no cell raised to a narrower or smaller one). Its dips are real on a
CPU: torch's fp32 GEMM on 2 or 3 rows is slower than on 4 (SmolLM2-135M's LM head on one thread: 7.0, 17.5, 26.3,
13.6 ms for 1-4 rows), so SGLang's verify of width 3 costs more than of width 4, reproducibly; the record names them
(`dips`). What other work bends, the window check catches: the probe checks itself as a measurement window does
(`pipeline.measure.window.judge_window` on the engine's node around it), and a disturbed table, or one with a step
measured at no cost, is measured again (`attempts` in all) and the cleanest kept, flagged when none was clean.
The plan, the bodies, the answers' checks and the table are pure; `measure_shape` does the I/O, on the engine a
trial already holds (`probe_shape`: on one known by its kind only).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from pipeline.measure.vllm_probe import (VLLM_PASSES, VLLM_WIDTHS, as_lines, cache_hits, check_completion,
                                         completion_body, line_problem)
from pipeline.measure.window import Window, judge_window
from serve.engines import engine_for
from serve.engines.base import Engine
from serve.engines.round_table import first_dip
from serve.replica.usage import Usage

__all__ = ["Attempt", "BATCHES", "CONTEXT_TOKENS", "Call", "DECODE_TOKENS", "LONG_CONTEXT_TOKENS", "PASSES", "Plan",
           "Prompts", "WIDTHS", "assemble", "body", "calls", "check_answer", "choose", "dips",
           "measure_shape", "plan_for", "probe_shape", "table_problem"]

CONTEXT_TOKENS = 128  # the CPU engine's round table's context (serve/engines/cpu/probe.py)
LONG_CONTEXT_TOKENS = 512
WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)  # the CPU engine's start-up sizes: the cost model interpolates between them
BATCHES = (1, 2, 4)
DECODE_TOKENS = 9  # generated tokens of the long call of a step pair: 8 decode steps in the difference
PASSES = 3
TOKENS = (1000, 8000)  # prompt token ids: ordinary ids of any real vocabulary, none special
SGLANG, LLAMA, VLLM = "generate", "completion", "openai"  # `Engine.extend_api`: the dialects


@dataclass(frozen=True)
class Plan:
    """What one probe measures. `dialect`: the API (`generate`: SGLang's /generate, `completion`: llama-server's);
    `all_rows`: the extend computes the logits of every query row, as the engine's verify does."""

    dialect: str
    batches: tuple[int, ...]
    widths: tuple[int, ...] = WIDTHS
    head_rows: tuple[int, ...] = ()  # the LM head's rows measured apart (vLLM)
    context_tokens: int = CONTEXT_TOKENS
    long_context_tokens: int = LONG_CONTEXT_TOKENS
    decode_tokens: int = DECODE_TOKENS
    passes: int = PASSES

    @property
    def all_rows(self) -> bool:
        return self.dialect == SGLANG


@dataclass(frozen=True)
class Call:
    """One timed HTTP call: `batch` requests, each its cached `context` plus `width` new tokens, generating
    `generate` tokens; `rows`: with the logits of every new position."""

    batch: int
    width: int
    generate: int
    context: int
    rows: bool = False


def plan_for(engine: Engine, levels: Sequence[int], max_running: int | None = None) -> Plan:
    """The plan for an engine and the study's concurrency levels: rows of 2 and 4 requests only where a level
    puts that many in flight (the cost model extrapolates past the largest row), never past the engine's cap."""
    top = max(levels or [1])
    cap = max_running if max_running and max_running > 0 else top
    batches = tuple(b for b in BATCHES if b == 1 or (b < 2 * top and b <= cap))
    dialect = engine.extend_api
    if dialect == VLLM:
        return Plan(dialect=dialect, batches=batches, widths=VLLM_WIDTHS, head_rows=VLLM_WIDTHS, passes=VLLM_PASSES)
    return Plan(dialect=dialect, batches=batches)


def calls(plan: Plan) -> list[Call]:
    """Every call of one pass, in order: per batch the step pair and each width; the long-context step pair."""
    out: list[Call] = []
    ctx, long, n = plan.context_tokens, plan.long_context_tokens, plan.decode_tokens
    for b in plan.batches:
        out += [Call(b, 1, 1, ctx), Call(b, 1, n, ctx)]
        out += [Call(b, w, 1, ctx, plan.all_rows) for w in plan.widths if plan.all_rows or w > 1]
    for m in plan.head_rows:  # a fresh prompt of m + 1 tokens, without and with the logits of its m first rows
        out += [Call(1, m + 1, 1, 0), Call(1, m + 1, 1, 0, True)]
    return out + [Call(1, 1, 1, long), Call(1, 1, n, long)]


def _base(call: Call) -> Call:
    """The width-1 call whose difference with `call` is the width's cost."""
    return Call(call.batch, 1, 1, call.context, call.rows)


def body(plan: Plan, call: Call, prompts: list[list[int]]) -> tuple[str, dict[str, Any]]:
    """(route, JSON body) of one call in the plan's dialect."""
    if plan.dialect == LLAMA:
        # cache_prompt: the slot keeps its context; several prompts in one call run in parallel slots
        return "/completion", {"prompt": prompts, "n_predict": call.generate, "temperature": 0.0,
                               "ignore_eos": True, "cache_prompt": True, "stream": False}
    if plan.dialect == VLLM:
        return "/v1/completions", completion_body(prompts, call.generate, call.rows)
    out: dict[str, Any] = {"input_ids": prompts, "sampling_params": {"max_new_tokens": call.generate,
                                                                     "temperature": 0.0, "ignore_eos": True}}
    if call.rows:  # logits of every position from the context on, as a verify computes them
        out.update(return_logprob=True, logprob_start_len=call.context)
    return "/generate", out


def check_answer(plan: Plan, call: Call, answer: Any, cached: float | None = None) -> str | None:
    """Why a call's answer is no sample (None when it is one): not one result per request, a request that did not
    generate what it was asked, or one whose context was not (exactly) its cached prefix. `cached`: the prompt
    tokens the engine's metrics counted as cache hits during the call (vLLM: its answer says none)."""
    if plan.dialect == VLLM:
        return check_completion(call.batch, call.width, call.generate, call.context, call.rows, answer, cached)
    results = answer if isinstance(answer, list) else [answer]
    if len(results) != call.batch or not all(isinstance(r, dict) for r in results):
        return f"expected {call.batch} result(s), got {type(answer).__name__} of {len(results)}"
    for r in results:
        if plan.dialect == LLAMA:
            generated, cached = r.get("tokens_predicted"), (r.get("timings") or {}).get("cache_n")
        else:
            meta = r.get("meta_info") or {}
            generated, cached = meta.get("completion_tokens"), meta.get("cached_tokens")
        if generated != call.generate:
            return f"a request generated {generated} token(s), not {call.generate}"
        if cached != call.context:
            return f"cache miss: {cached} cached prompt token(s), not the context's {call.context}"
    return None


def assemble(plan: Plan, best: dict[Call, float]) -> dict[str, Any]:
    """The round table (ms) from each call's fastest time (ms), by the differences of the module docstring."""
    n, ctx = plan.decode_tokens, plan.context_tokens

    def step(b: int, context: int) -> float:
        return (best[Call(b, 1, n, context)] - best[Call(b, 1, 1, context)]) / (n - 1)

    ms = []
    for b in plan.batches:
        row = []
        for w in plan.widths:
            wide = Call(b, w, 1, ctx, plan.all_rows)
            row.append(round(step(b, ctx) + (best[wide] - best[_base(wide)] if w > 1 else 0.0), 3))
        ms.append(row)
    heads = [round(best[Call(1, m + 1, 1, 0, True)] - best[Call(1, m + 1, 1, 0)], 3) for m in plan.head_rows]
    table = {"batches": list(plan.batches), "widths": list(plan.widths), "ms": ms,
             # the cells hold their logit rows (every query row on SGLang; the roots on llama-server): no LM-head term;
             # vLLM's cells hold the roots' rows and the LM head by rows comes apart
             "lm_head_rows": list(plan.head_rows or (1,)), "lm_head_ms": heads or [0.0],
             "logit_rows": "every query row" if plan.all_rows else "the requests' last rows only" + (
                 "; the LM head's rows measured apart (prompt logprobs)" if heads else
                 " (the API computes no logits of prompt positions)"),
             "context_tokens": ctx, "long_context_tokens": plan.long_context_tokens,
             "short_context_ms": round(step(1, ctx), 3), "long_context_ms": round(step(1, plan.long_context_tokens), 3),
             "as_measured": True, "passes": plan.passes, "lm_head_apart": bool(heads)}
    return as_lines(table) if heads else table


def table_problem(table: dict[str, Any]) -> str | None:
    """Why a measured table cannot be used (None when it can): a step or a cell measured at no cost, which only
    calls whose own costs swamped the differences measure. Pure."""
    if table["short_context_ms"] <= 0 or table["long_context_ms"] <= 0 or any(c <= 0 for r in table["ms"] for c in r):
        return "a step measured at no cost: the calls' own costs swamped the differences"
    return line_problem(table) if table.get("lm_head_apart") else None


def dips(table: dict[str, Any]) -> str | None:
    """The first cell clearly below a narrower or smaller one, in words; None when there is none. Not a reason to
    measure again: on a CPU such dips reproduce (torch's fp32 GEMM on 2 or 3 rows is slower than on 4), so the table
    is read as measured (`as_measured`); what other work bends, the window check catches. Pure."""
    return first_dip(table)


@dataclass
class Attempt:
    """One measurement of the whole table, with the window it ran in."""

    table: dict[str, Any] | None
    window: Window
    problem: str | None
    repeated: int = 0  # calls repeated after a cache miss
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return self.table is not None and self.problem is None and not self.window.disturbed


def choose(attempts: Sequence[Attempt]) -> Attempt | None:
    """The attempt to keep: the first clean one; else, among those with a table, the usable ones before the
    others and then the least disturbed (the engine's lowest run-queue wait share). Pure."""
    with_table = [a for a in attempts if a.table is not None]
    for a in with_table:
        if a.clean:
            return a
    if not with_table:
        return None
    return min(with_table, key=lambda a: (a.problem is not None,
                                          (a.window.wait_share or 0.0) - (a.window.own_wait_share or 0.0)))


@dataclass
class Prompts:
    """Prompts with a fixed cached context per (context, request) and fresh tokens after it: the first fresh token
    counts up, so no call's new tokens ever extend an earlier call's cached ones."""

    seed: int = 0
    prefixes: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    counter: int = 0

    def prefix(self, context: int, i: int) -> list[int]:
        key = (context, i)
        if key not in self.prefixes:
            rng = random.Random(f"{self.seed}-{context}-{i}")
            self.prefixes[key] = [rng.randrange(*TOKENS) for _ in range(context)]
        return self.prefixes[key]

    def of(self, call: Call) -> list[list[int]]:
        out = []
        for i in range(call.batch):
            self.counter += 1
            rng = random.Random(self.counter)
            first = TOKENS[0] + self.counter % (TOKENS[1] - TOKENS[0])
            out.append(self.prefix(call.context, i) + [first] + [rng.randrange(*TOKENS) for _ in range(call.width - 1)])
        return out


def _usage(client: httpx.Client) -> Usage | None:
    try:
        response = client.get("/replica/usage", timeout=30)
        return Usage.model_validate(response.json()) if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _post(client: httpx.Client, route: str, payload: dict[str, Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    response = client.post(route, json=payload)
    elapsed = (time.perf_counter() - t0) * 1000.0
    if response.status_code != 200:
        raise ValueError(f"{route} answered {response.status_code}: {response.text[:300]}")
    return elapsed, response.json()


def _cache_contexts(client: httpx.Client, plan: Plan, prompts: Prompts) -> None:
    """Every context the calls extend, cached by a request of its own (one call per context length)."""
    for context, count in ((plan.context_tokens, max(plan.batches)), (plan.long_context_tokens, 1)):
        call = Call(count, 0, 1, context)
        route, payload = body(plan, call, [prompts.prefix(context, i) for i in range(count)])
        _post(client, route, payload)


def _measure(client: httpx.Client, plan: Plan, prompts: Prompts, wait_limit: float) -> Attempt:
    started = time.monotonic()
    before = _usage(client)
    _cache_contexts(client, plan, prompts)
    widest = Call(1, max(plan.widths), 1, plan.context_tokens, plan.all_rows)
    _post(client, *body(plan, widest, prompts.of(widest)))  # first-use costs of the longest extend, untimed
    for m in plan.head_rows[-1:]:  # and of the prompt logprobs' path
        _post(client, *body(plan, Call(1, m + 1, 1, 0, True), prompts.of(Call(1, m + 1, 1, 0, True))))
    best: dict[Call, float] = {}
    repeated = 0
    for _ in range(plan.passes):
        for call in calls(plan):
            for _try in range(3):
                counted = plan.dialect == VLLM and call.context > 0  # vLLM's hits, read outside the call's timing
                hits = cache_hits(client) if counted else None
                elapsed, answer = _post(client, *body(plan, call, prompts.of(call)))
                after = cache_hits(client) if counted else None
                wrong = check_answer(plan, call, answer, None if hits is None or after is None else after - hits)
                if wrong is None:
                    best[call] = min(elapsed, best.get(call, elapsed))
                    break
                if not wrong.startswith("cache miss"):
                    raise ValueError(f"the engine's answer to the probe: {wrong}")
                repeated += 1
                _cache_contexts(client, plan, prompts)
    window = judge_window(before, _usage(client), [], wait_limit=wait_limit)
    missing = [c for c in calls(plan) if c not in best]
    if missing:
        problem = f"{len(missing)} call(s) missed their cached context three times (first: {missing[0]})"
        return Attempt(None, window, problem, repeated, time.monotonic() - started)
    table = assemble(plan, best)
    return Attempt(table, window, table_problem(table), repeated, time.monotonic() - started)


def probe_shape(url: str, engine_kind: str, levels: Sequence[int], **options: Any) -> dict[str, Any]:
    """`measure_shape` of the engine of kind `engine_kind` at `url`, for a caller that knows its kind only (a
    benchmark, an engine's own test); a trial hands in the engine it holds instead."""
    return measure_shape(url, engine_for(engine_kind), levels, **options)


def measure_shape(url: str, engine: Engine, levels: Sequence[int], *, max_running: int | None = None,
                  attempts: int = 3, wait_limit: float = 0.15, timeout_s: float = 300.0, seed: int = 0
                  ) -> dict[str, Any]:
    """`engine`'s round table measured at `url` (the trial's route to it), as a `verify_cost` record:
    `round_cost` (the table), `source` "http-probe", `disturbance` (the kept attempt's run-queue wait and steal
    shares), `flag` (clean, re-measured, disturbed, suspect or unchecked), `dips` (a cell below a narrower or smaller
    one), `attempts`, `repeated` (calls repeated after a cache miss), `seconds`.
    Never raises: an engine that cannot be probed gives a record with `error` and no table (the cost model then
    takes its prior)."""
    plan = plan_for(engine, levels, max_running)
    started = time.monotonic()
    tried: list[Attempt] = []
    prompts = Prompts(seed)
    record: dict[str, Any] = {"source": "http-probe", "dialect": plan.dialect}
    try:
        with httpx.Client(base_url=url, timeout=timeout_s) as client:
            for _ in range(max(1, attempts)):
                tried.append(_measure(client, plan, prompts, wait_limit))
                if tried[-1].clean:
                    break
    except (httpx.HTTPError, ValueError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"[:500]
    kept = choose(tried)
    record.update(attempts=len(tried), seconds=round(time.monotonic() - started, 2))
    if kept is None:
        record.setdefault("error", tried[-1].problem if tried else "no attempt finished")
        return record
    record.pop("error", None)  # an attempt after the one that failed
    window = kept.window
    record.update(round_cost={**(kept.table or {}), "seconds": round(kept.seconds, 2)},
                  disturbance={"wait_share": window.wait_share, "steal_share": window.steal_share},
                  window=window.line(), repeated=sum(a.repeated for a in tried), flag=_flag(kept, len(tried)))
    if kept.problem:
        record["problem"] = kept.problem
    if kept.table is not None and dips(kept.table):
        record["dips"] = dips(kept.table)
    return record


def _flag(kept: Attempt, attempts: int) -> str:
    if kept.window.disturbed:
        return "disturbed"
    if kept.problem:
        return "suspect"
    if kept.window.disturbed is None:
        return "unchecked"
    return "re-measured" if attempts > 1 else "clean"
