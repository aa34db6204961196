"""Measuring one generation answer as it passes the ingress, streamed or not, as `serve.closed_loop.live` defines the figures.

A `Measure` follows one forwarded generation request: the time its first text arrived, the gaps between later
text-carrying chunks, the engine's token counts (OpenAI `usage`; for a stream the engine's final usage chunk) and
its verify steps when the engine reports them (SGLang's `sglext.spec_tokens_details.spec_verify_ct`, or a
`meta_info.spec_verify_ct`), and how the answer ended (`[DONE]`, an error event, or a client that left).

Streams: OpenAI engines send usage only when asked (`stream_options.include_usage`); `ask_usage` adds that to a
request whose client did not ask, and `metered` then keeps the usage chunk from that client (an OpenAI client that
did not ask for it does not expect a chunk without choices). SGLang (and our CPU engine) send a request's spec
counters only when asked (`return_spec_tokens_details`): `ask_spec_details` adds that ask (the ingress does where the
engine returns them, `serve.engines.base.Engine.spec_details`), and the `sglext.spec_tokens_details` it brings is
then kept from that client too, streamed or not (`Added`).
`metered` forwards every other byte as it came, event by event (SSE events end with a blank line; a partial event is
held until its end arrives).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from serve.sse import event_of

__all__ = ["Added", "Measure", "ask_usage", "ask_spec_details", "metered", "CLIENT_CLOSED"]

CLIENT_CLOSED = 499  # a stream the client left before `[DONE]` (nginx's code for it; no HTTP status was sent)


def ask_usage(data: dict[str, Any]) -> bool:
    """Make a streamed request ask the engine for its final usage chunk. True when the ingress added the ask (the
    client did not), so that chunk must not reach the client; a malformed `stream_options` is left for the
    engine to refuse with its own message."""
    options = data.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return False
    if isinstance(options, dict) and options.get("include_usage") is True:
        return False
    data["stream_options"] = {**(options or {}), "include_usage": True}
    return True


def ask_spec_details(data: dict[str, Any]) -> bool:
    """Make a request ask the engine for its spec counters (SGLang's `return_spec_tokens_details`). True when the
    ingress added the ask, so they must not reach the client; a client's own value (true, or a malformed one for the
    engine to refuse) is left as it is."""
    if "return_spec_tokens_details" in data:
        return False
    data["return_spec_tokens_details"] = True
    return True


@dataclass(frozen=True)
class Added:
    """What the ingress asked the engine for and the client did not: kept from the client's answer."""

    usage: bool = False  # a stream's usage chunk (`ask_usage`)
    spec: bool = False  # `sglext.spec_tokens_details` (`ask_spec_details`)


def _has_spec(obj: dict[str, Any]) -> bool:
    extension = obj.get("sglext")
    return isinstance(extension, dict) and "spec_tokens_details" in extension


def _without_spec(obj: dict[str, Any]) -> dict[str, Any]:
    extension = {k: v for k, v in obj["sglext"].items() if k != "spec_tokens_details"}
    rest = {k: v for k, v in obj.items() if k != "sglext"}
    return {**rest, "sglext": extension} if extension else rest


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _verify_steps(obj: dict[str, Any]) -> int | None:
    """An engine's per-request verify steps, where the engines that report them put them; None when absent."""
    extension = obj.get("sglext")
    for holder in ((extension.get("spec_tokens_details") if isinstance(extension, dict) else None),
                   obj.get("meta_info")):
        if isinstance(holder, dict) and _int(holder.get("spec_verify_ct")) is not None:
            return _int(holder.get("spec_verify_ct"))
    return None


def _has_text(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return False
    found_delta, found_message = choice.get("delta"), choice.get("message")
    delta: dict[str, Any] = found_delta if isinstance(found_delta, dict) else {}
    message: dict[str, Any] = found_message if isinstance(found_message, dict) else {}
    return any(isinstance(v, str) and v for v in (choice.get("text"), delta.get("content"),
                                                   delta.get("reasoning_content"), message.get("content")))


class Measure:
    """What one forwarded generation request's answer showed (times are `time.monotonic()`)."""

    def __init__(self, arrived: float, api: str, route: str, concurrency: int, streamed: bool,
                 arm: str = "production", version: str | None = None) -> None:
        self.arrived, self.api, self.route = arrived, api, route
        self.concurrency, self.streamed = concurrency, streamed
        self.arm, self.version = arm, version  # version None: the config the replica serves
        self.first_text: float | None = None
        self.last_text: float | None = None
        self.gaps: list[float] = []
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.verify_steps: int | None = None
        self.error_status: int | None = None  # a stream ended by an error event: that event's code
        self.done_at: float | None = None  # a stream's `data: [DONE]`
        self.metered = False  # a stream wrapper owns this measure (it records when the stream ends)

    def _usage(self, obj: dict[str, Any]) -> None:
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self.prompt_tokens = _int(usage.get("prompt_tokens")) or self.prompt_tokens
            self.completion_tokens = _int(usage.get("completion_tokens")) or self.completion_tokens
        verify = _verify_steps(obj)
        if verify is not None:
            self.verify_steps = verify

    def answer(self, payload: bytes, at: float, added: Added = Added()) -> bytes:
        """A non-streamed answer's body: its usage, and its text's arrival (the whole answer at once). Returns the
        body to forward: `payload` itself, or without the spec counters the client did not ask for."""
        try:
            obj = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            return payload
        if not isinstance(obj, dict):
            return payload
        self._usage(obj)
        if any(_has_text(c) for c in obj.get("choices") or []):
            self.first_text = at
        if added.spec and _has_spec(obj):
            return json.dumps(_without_spec(obj)).encode()
        return payload

    def event(self, raw: bytes, at: float, added: Added) -> bytes | None:
        """One SSE event (without its blank line): note what it shows; return the bytes to forward (None: drop)."""
        parsed = event_of(raw)
        if parsed is not None and parsed.done:
            self.done_at = at
            return raw
        data = parsed.data.strip() if parsed is not None else ""
        if not data.startswith("{"):
            return raw
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return raw
        if not isinstance(obj, dict):
            return raw
        if "error" in obj:
            code = obj["error"].get("code") if isinstance(obj["error"], dict) else None
            self.error_status = code if isinstance(code, int) and 400 <= code <= 599 else 500
            return raw
        if any(_has_text(c) for c in obj.get("choices") or []):
            if self.last_text is None:
                self.first_text = at
            else:
                self.gaps.append(at - self.last_text)
            self.last_text = at
        self._usage(obj)
        hide_usage = added.usage and isinstance(obj.get("usage"), dict)
        hide_spec = added.spec and _has_spec(obj)
        if not hide_usage and not hide_spec:
            return raw
        kept = _without_spec(obj) if hide_spec else obj
        kept = {k: v for k, v in kept.items() if k != "usage"} if hide_usage else kept
        if not kept.get("choices") and not kept.get("usage") and not kept.get("sglext"):
            return None  # a chunk of what the ingress asked for only: this client did not
        return b"data: " + json.dumps(kept).encode()

    def status(self, sent: int) -> int:
        """The status a live record carries: an error event's code, 499 for a stream left before `[DONE]`."""
        if self.error_status is not None:
            return self.error_status
        if self.streamed and sent == 200 and self.done_at is None:
            return CLIENT_CLOSED
        return sent


async def metered(chunks: AsyncIterator[bytes], measure: Measure, added: Added,
                  ended: Callable[[Measure, float], object]) -> AsyncIterator[bytes]:
    """Forward a 200 stream event by event through `measure`; `ended(measure, at)` once, however it ends (`[DONE]`,
    an error event, the client leaving: the generator is then closed at its `yield`). The caller sets
    `measure.metered` when it builds this (a generator's body runs only once it is iterated)."""
    pending = b""
    try:
        async for chunk in chunks:
            now = time.monotonic()
            pending += chunk
            *events, pending = pending.split(b"\n\n")
            out = [kept + b"\n\n" for kept in (measure.event(e, now, added) for e in events) if kept is not None]
            if out:
                yield b"".join(out)
        if pending:
            kept = measure.event(pending, time.monotonic(), added)
            if kept is not None:
                yield kept
    finally:
        ended(measure, measure.done_at if measure.done_at is not None else time.monotonic())
        close = getattr(chunks, "aclose", None)
        if close is not None:  # a client that left closes this at its `yield`: close the relay now, not at GC
            await close()
