"""Async load generator: replays prompts against an engine's `/generate` at a fixed concurrency, streaming.

Concurrency means the same on both engines: exactly `concurrency` requests are in flight from the client at any time
(a closed loop: each worker sends its next prompt when its previous one finished), in the order given. One
`RequestRecord` per request: TTFT and inter-chunk gaps from the SSE stream, counters from the final `meta_info`.
A failed or timed-out request is a record with `error` set, never an exception.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Sequence

import httpx

from pipeline.measure import RequestRecord


@dataclass(frozen=True)
class LoadRequest:
    index: int
    text: str
    max_new_tokens: int


def _output_ids(chunks_ids: list[list[int]], completion_tokens: int) -> list[int]:
    """SGLang streams output_ids either cumulatively or as deltas (server setting); accept both."""
    if chunks_ids and len(chunks_ids[-1]) == completion_tokens:
        return chunks_ids[-1]
    return [token for ids in chunks_ids for token in ids]


async def _one(client: httpx.AsyncClient, item: LoadRequest, *, phase: str, concurrency: int, window_start: float,
               temperature: float, timeout_s: float, request_id: str) -> RequestRecord:
    payload = {"text": item.text, "stream": True,
               "sampling_params": {"max_new_tokens": item.max_new_tokens, "temperature": temperature}}
    start = time.monotonic()
    first: float | None = None
    arrivals: list[float] = []
    chunks_ids: list[list[int]] = []
    meta: dict[str, Any] = {}
    error: str | None = None
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/generate", json=payload) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode("utf-8", "replace")[:500]
                    error = f"HTTP {response.status_code}: {body}"
                else:
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            error = str(chunk["error"])
                            break
                        now = time.monotonic()
                        meta = chunk.get("meta_info", meta)
                        ids = chunk.get("output_ids") or []
                        chunks_ids.append(list(ids))
                        if first is None:
                            first = now
                        arrivals.append(now)
    except TimeoutError:
        error = f"timeout after {timeout_s:.0f} s"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    end = time.monotonic()
    completion = int(meta.get("completion_tokens", 0))
    finish = meta.get("finish_reason")
    finish_text = finish.get("type", str(finish)) if isinstance(finish, dict) else str(finish or "error")
    return RequestRecord(
        request_id=request_id, phase=phase, prompt_index=item.index, concurrency=concurrency,  # type: ignore[arg-type]
        start_s=start - window_start, ttft_s=(first - start) if first is not None else None, e2e_s=end - start,
        itl_s=tuple(b - a for a, b in zip(arrivals, arrivals[1:])),
        prompt_tokens=int(meta.get("prompt_tokens", 0)), completion_tokens=completion,
        spec_verify_ct=meta.get("spec_verify_ct"), spec_num_correct_drafts=meta.get("spec_num_correct_drafts"),
        spec_num_proposed_drafts=meta.get("spec_num_proposed_drafts"),
        spec_accept_length=meta.get("spec_accept_length"),
        finish_reason="error" if error else finish_text, error=error,
        output_ids=tuple(_output_ids(chunks_ids, completion)) if not error else (),
    )


async def run_phase_async(base_url: str, items: Sequence[LoadRequest], *, phase: str, concurrency: int,
                          temperature: float = 0.0, timeout_s: float = 300.0) -> list[RequestRecord]:
    """Send `items` in order with `concurrency` in flight; returns records in the order of `items`."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    records: list[RequestRecord | None] = [None] * len(items)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for position in range(len(items)):
        queue.put_nowait(position)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout_s, connect=30),
                                 limits=limits) as client:
        window_start = time.monotonic()

        async def worker() -> None:
            while not queue.empty():
                position = queue.get_nowait()
                records[position] = await _one(
                    client, items[position], phase=phase, concurrency=concurrency, window_start=window_start,
                    temperature=temperature, timeout_s=timeout_s, request_id=f"{phase}-{position}")

        await asyncio.gather(*(worker() for _ in range(min(concurrency, max(1, len(items))))))
    return [r for r in records if r is not None]


def run_phase(base_url: str, items: Sequence[LoadRequest], **kwargs: Any) -> list[RequestRecord]:
    """Synchronous wrapper of `run_phase_async` (trials run in plain threads/processes)."""
    return asyncio.run(run_phase_async(base_url, items, **kwargs))
