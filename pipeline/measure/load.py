"""Async load generator: replays prompts against an engine's `/generate` at a fixed concurrency, streaming.

Concurrency means the same on both engines: exactly `concurrency` requests are in flight from the client at any time
(a closed loop: each worker sends its next prompt when its previous one finished), in the order given. One
`RequestRecord` per request: TTFT and inter-chunk gaps from the SSE stream, counters from the final `meta_info`.
A failed or timed-out request is a record with `error` set, never an exception.

Chat prompts (`Prompt.messages`) go to `/generate` as `input_ids` rendered by `chat_input_ids`: the model's chat
template applied to the messages with the generation prompt, then tokenized without special tokens, which is what
the engine's `/v1/chat/completions` (and SGLang's) does before decoding. So the engine sees the token ids production
traffic gives it, while `/generate` still returns the per-request spec counters the measurement needs (the OpenAI
route's `usage` has none). tests/integration/test_chat_workload.py holds the two routes to equal prompt tokens and
equal greedy output.

The SSE stream is read as raw bytes by `serve.sse.SseDecoder` and folded by `StreamState`, both pure, so chunk
boundaries (a line or a multi-byte character split between two network reads) cannot change what a request recorded.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import httpx

from pipeline.measure.summary import RequestRecord
from serve.engines import tokenizer_for
from serve.sse import SseDecoder, SseEvent


@dataclass(frozen=True)
class LoadRequest:
    """One request. `input_ids`, when set, is sent instead of `text` (a chat prompt rendered by `chat_input_ids`);
    `text` stays a readable view for logs and digests. `prompt_ids`, when set, is the text tokenized as the engine
    tokenizes it (`tokenizer.encode(text)`): recorded with the request, never sent."""

    index: int
    text: str
    max_new_tokens: int
    input_ids: tuple[int, ...] | None = None
    prompt_ids: tuple[int, ...] | None = None

    @property
    def known_ids(self) -> tuple[int, ...] | None:
        """The prompt's token ids as the engine sees them, when the client knows them."""
        return self.input_ids if self.input_ids is not None else self.prompt_ids


def chat_input_ids(messages: Sequence[tuple[str, str]], tokenizer: Any) -> tuple[int, ...]:
    """The prompt token ids the chat route makes of `messages` (module docstring)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("workload: chat prompts need a model with a chat template; this tokenizer has none "
                         "(use a plain `prompt` workload, or a chat model)")
    rendered = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in messages], tokenize=False,
                                             add_generation_prompt=True)
    return tuple(int(t) for t in tokenizer.encode(rendered, add_special_tokens=False))


def target_tokenizer(target: str) -> Any:
    """The tokenizer of the study's target model, as its engine loads it (`serve.engines.tokenizer_for`)."""
    return tokenizer_for(target)


def requests_of(prompts: Sequence[Any], target: str | None = None, tokenizer: Any = None,
                prompt_ids: bool = False) -> tuple[LoadRequest, ...]:
    """LoadRequests for workload prompts; chat prompts are rendered with the target's tokenizer (loaded once, only
    when the workload has chat prompts, or for `prompt_ids`: text prompts then carry their token ids as the engine
    tokenizes them, with its default special tokens, for the records)."""
    items = []
    for p in prompts:
        ids = known = None
        if getattr(p, "messages", None) or prompt_ids:
            if tokenizer is None:
                if target is None:
                    raise ValueError("workload: chat prompts (and prompt ids) need the target model's tokenizer")
                tokenizer = target_tokenizer(target)
        if getattr(p, "messages", None):
            ids = chat_input_ids(p.messages, tokenizer)
        elif prompt_ids:
            known = tuple(int(t) for t in tokenizer.encode(p.text))
        items.append(LoadRequest(p.index, p.text, p.max_new_tokens, ids, known))
    return tuple(items)


def _output_ids(chunks_ids: list[list[int]], completion_tokens: int) -> list[int]:
    """SGLang streams output_ids either cumulatively or as deltas (server setting); accept both."""
    if chunks_ids and len(chunks_ids[-1]) == completion_tokens:
        return chunks_ids[-1]
    return [token for ids in chunks_ids for token in ids]


@dataclass
class StreamState:
    """What one streamed `/generate` response said so far. `add` folds one event in; False = the stream is over
    (`[DONE]`, or an error event). Counters come from the last event that carried `meta_info`."""

    chunks_ids: list[list[int]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    done: bool = False

    def add(self, event: SseEvent, now: float) -> bool:
        data = event.data.strip()
        if event.done:
            self.done = True
            return False
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as exc:
            self.error = f"bad SSE data ({exc}): {data[:200]!r}"
            return False
        if not isinstance(chunk, dict):
            self.error = f"bad SSE data: expected a JSON object, got {data[:200]!r}"
            return False
        if "error" in chunk or event.event == "error":
            detail = chunk.get("error", chunk)
            message = detail.get("message", detail) if isinstance(detail, dict) else detail
            self.error = str(message)
            return False
        if isinstance(chunk.get("meta_info"), dict):
            self.meta = chunk["meta_info"]
        self.chunks_ids.append(list(chunk.get("output_ids") or []))
        self.arrivals.append(now)
        return True


async def _one(client: httpx.AsyncClient, item: LoadRequest, *, phase: str, concurrency: int, window_start: float,
               temperature: float, timeout_s: float, request_id: str) -> RequestRecord:
    prompt = {"input_ids": list(item.input_ids)} if item.input_ids is not None else {"text": item.text}
    payload = {**prompt, "stream": True,
               "sampling_params": {"max_new_tokens": item.max_new_tokens, "temperature": temperature}}
    start = time.monotonic()
    state = StreamState()
    error: str | None = None
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", "/generate", json=payload) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode("utf-8", "replace")[:500]
                    error = f"HTTP {response.status_code}: {body}"
                else:
                    decoder = SseDecoder()
                    going = True
                    async for raw in response.aiter_bytes():
                        now = time.monotonic()
                        for event in decoder.feed(raw):
                            going = going and state.add(event, now)
                        if not going:
                            break
                    if going:
                        for event in decoder.close():
                            going = going and state.add(event, time.monotonic())
                    error = state.error
                    if error is None and not state.done and not state.meta.get("finish_reason"):
                        error = "stream ended before the request finished (no [DONE], no finish_reason)"
    except TimeoutError:
        error = f"timeout after {timeout_s:.0f} s"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
    end = time.monotonic()
    meta = state.meta
    first = state.arrivals[0] if state.arrivals else None
    completion = int(meta.get("completion_tokens", 0))
    finish = meta.get("finish_reason")
    finish_text = finish.get("type", str(finish)) if isinstance(finish, dict) else str(finish or "error")
    return RequestRecord(
        request_id=request_id, phase=phase, prompt_index=item.index, concurrency=concurrency,  # type: ignore[arg-type]
        start_s=start - window_start, ttft_s=(first - start) if first is not None else None, e2e_s=end - start,
        itl_s=tuple(b - a for a, b in zip(state.arrivals, state.arrivals[1:])),
        prompt_tokens=int(meta.get("prompt_tokens", 0)), completion_tokens=completion,
        spec_verify_ct=meta.get("spec_verify_ct"), spec_num_correct_drafts=meta.get("spec_num_correct_drafts"),
        spec_num_proposed_drafts=meta.get("spec_num_proposed_drafts"),
        spec_accept_length=meta.get("spec_accept_length"),
        finish_reason="error" if error else finish_text, error=error,
        output_ids=tuple(_output_ids(state.chunks_ids, completion)) if not error else (),
        prompt_ids=item.known_ids,
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
