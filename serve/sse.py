"""Server-Sent Events, read once for the whole project: the trial's load generator (`pipeline.measure.load`), the
production ingress's live figures (`serve.closed_loop.live_stream`) and traffic capture (`serve.closed_loop.capture`),
and the llama.cpp engine's shim reading llama-server's stream (`serve.engines.llama_cpp.server`) all decode with
`SseDecoder`. Pure: bytes in, events out.

The WHATWG rules the engines need: lines end with LF, CRLF or CR; a blank line dispatches the event; the `data:`
lines of one event are joined with LF; lines starting with ':' are comments (keep-alives); `event:` names the event;
other fields are ignored. Bytes are split into lines before decoding, so a UTF-8 character split across chunks
decodes whole, and a line or event split between two network reads decodes the same as one read.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DONE", "SseDecoder", "SseEvent", "event_of"]

DONE = "[DONE]"  # the data of the event that ends an OpenAI or SGLang stream


@dataclass(frozen=True)
class SseEvent:
    data: str
    event: str = "message"

    @property
    def done(self) -> bool:
        """The stream's closing `data: [DONE]`."""
        return self.data.strip() == DONE


class SseDecoder:
    """Incremental decoder (module docstring). At `close()` (the stream ended), data that arrived without its closing
    blank line is dispatched as a last event."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []
        self._event = ""

    def feed(self, chunk: bytes) -> list[SseEvent]:
        self._buffer += chunk
        events = []
        while (cut := line_end(self._buffer)) is not None:
            end, after = cut
            line, self._buffer = self._buffer[:end], self._buffer[after:]
            event = self._line(line.decode("utf-8", "replace"))
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[SseEvent]:
        tail, self._buffer = self._buffer.rstrip(b"\r"), b""
        if tail:
            self._line(tail.decode("utf-8", "replace"))
        event = self._line("")
        return [event] if event is not None else []

    def _line(self, line: str) -> SseEvent | None:
        if not line:
            if not self._data:
                self._event = ""
                return None
            event = SseEvent("\n".join(self._data), self._event or "message")
            self._data, self._event = [], ""
            return event
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        return None


def line_end(buffer: bytes) -> tuple[int, int] | None:
    """(end of the first line, start of the next) or None while no complete line is buffered."""
    lf, cr = buffer.find(b"\n"), buffer.find(b"\r")
    if cr == -1 or (lf != -1 and lf < cr):
        return None if lf == -1 else (lf, lf + 1)
    if cr == len(buffer) - 1:
        return None  # maybe the first half of a CRLF: decide when the next byte comes
    return (cr, cr + 2) if buffer[cr + 1:cr + 2] == b"\n" else (cr, cr + 1)


def event_of(raw: bytes) -> SseEvent | None:
    """One whole event's bytes (its closing blank line optional) as an event; None for a block without data (a
    comment, a keep-alive)."""
    decoder = SseDecoder()
    events = decoder.feed(raw) + decoder.close()
    return events[0] if events else None
