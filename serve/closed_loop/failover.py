"""Production takes over a canary request whose candidate engine failed, so a dying candidate costs users nothing.

Before the candidate's first byte (a handle call that raises, an engine that answers 5xx, or a queue that is full)
the ingress simply sends the request to production (`serve/production/ingress.py`). A stream the candidate has begun
is wrapped in a `Takeover`: it forwards the candidate's events whole (never half an event), remembering the text it
sent; when the candidate fails mid-answer, production is asked the same request and its stream continues the
answer, with the text already sent skipped, checked character for character. That is only sound where production
must give the same text: greedy decoding (`temperature: 0`, one choice, no logprobs, no echo) of a candidate whose
speculative config was found equivalent by its study. A sampled request, or a production answer that differs from
what was sent, ends as before: an error event, then `[DONE]` (`serve.production.stream_relay`). Either way the
failure is counted against the candidate (`failed`), which ends the canary.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from serve.http_errors import EngineUnavailable, failure_answer
from serve.sse import event_of

__all__ = ["Takeover", "resumable", "CandidateUnfit"]


class CandidateUnfit(Exception):
    """The candidate answered before streaming anything, but not with an answer (5xx, or its queue is full)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"the candidate's engine answered {status}")
        self.status = status


def resumable(data: dict[str, Any]) -> bool:
    """Whether production's answer to `data` must repeat the candidate's text (greedy, one plain choice). Pure."""
    temperature = data.get("temperature")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature != 0:
        return False
    if data.get("n") not in (None, 1) or data.get("echo") or data.get("logprobs") or data.get("top_logprobs"):
        return False
    return True


def _choice(obj: Any) -> dict[str, Any] | None:
    choices = obj.get("choices") if isinstance(obj, dict) else None
    first = choices[0] if isinstance(choices, list) and choices else None
    return first if isinstance(first, dict) else None


def _text(choice: dict[str, Any]) -> str:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        content = delta.get("content")
        return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def _with_text(obj: dict[str, Any], choice: dict[str, Any], text: str) -> bytes:
    changed = dict(choice)
    if isinstance(choice.get("delta"), dict):
        changed["delta"] = {**choice["delta"], "content": text}
    else:
        changed["text"] = text
    return b"data: " + json.dumps({**obj, "choices": [changed, *obj["choices"][1:]]}).encode()


class Takeover:
    """A candidate's stream (a Serve streaming call past its status item) that production finishes if the candidate
    fails (module docstring). Iterated as the stream it wraps: `__anext__` gives whole SSE events, `cancel` stops
    whichever engine streams now."""

    def __init__(self, stream: Any, restart: Callable[[], Awaitable[Any]], may_resume: bool,
                 failed: Callable[[str], None]) -> None:
        self.stream, self.restart, self.may_resume, self.failed = stream, restart, may_resume, failed
        self.pending = b""
        self.sent = ""  # the text the client got from the candidate
        self.sent_events = 0
        self.taken_over = False
        self.matched = 0  # of `sent`, how much production's answer has repeated so far

    def cancel(self) -> None:
        self.stream.cancel()

    def __aiter__(self) -> Takeover:
        return self

    async def __anext__(self) -> bytes:
        while True:
            try:
                chunk = await self.stream.__anext__()
            except StopAsyncIteration:
                if self.pending:
                    rest, self.pending = self.pending, b""
                    last = self._event(rest)
                    if last is not None:
                        return last
                raise
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the engine's side failed: production may take over
                if self.taken_over or (self.sent_events and not self.may_resume):
                    raise
                self.failed(failure_answer(exc)[1])
                self.stream.cancel()
                self.stream = await self.restart()
                self.taken_over, self.pending = True, b""  # a half event of the candidate was never sent
                continue
            self.pending += chunk
            *events, self.pending = self.pending.split(b"\n\n")
            out = [kept for kept in (self._event(e) for e in events) if kept is not None]
            if out:
                return b"".join(out)

    def _event(self, event: bytes) -> bytes | None:
        """One whole event to send (with its blank line), or None to drop it."""
        parsed = event_of(event)
        data = parsed.data.strip() if parsed is not None else ""
        obj: Any = None
        if data.startswith("{"):
            try:
                obj = json.loads(data)
            except ValueError:
                obj = None
        choice = _choice(obj)
        if not self.taken_over:
            self.sent += _text(choice) if choice is not None else ""
            self.sent_events += 1
            return event + b"\n\n"
        left = len(self.sent) - self.matched
        if left <= 0:
            return event + b"\n\n"
        if choice is None:
            if (parsed is not None and parsed.done) or (isinstance(obj, dict) and "error" in obj):
                raise EngineUnavailable("the candidate's engine failed mid-answer and production's answer ended "
                                        "before repeating the part already sent")
            return None  # a usage chunk before the end: production's own count comes last again
        text = _text(choice)
        head, tail = text[:left], text[left:]
        if head != self.sent[self.matched:self.matched + len(head)]:
            raise EngineUnavailable("the candidate's engine failed mid-answer and production's answer differs from "
                                    "the part already sent")
        self.matched += len(head)
        if tail or (self.matched == len(self.sent) and choice.get("finish_reason")):
            return _with_text(obj, choice, tail) + b"\n\n"
        if choice.get("finish_reason"):
            raise EngineUnavailable("the candidate's engine failed mid-answer and production's answer is shorter "
                                    "than the part already sent")
        return None
