"""Traffic capture at the production endpoint: a sample of real requests and their answers, as Parquet, to re-tune on.

Opt-in (`ProductionSettings.capture`, off by default), sampled (`sample_rate`), bounded (`max_rows` over the capture
directory, restarts included; then capture stops and says so once in the log). Only successful
`/v1/chat/completions` and `/v1/completions` answers are kept: a 200 answer, or a stream that reached its `[DONE]`
without an error event (a stream cut by `request_timeout_s` or by a dying engine ends with an error event before
its `[DONE]`: its text is incomplete, so it is not kept). Captured rows hold user prompts and generated text: read
docs/security.md ("Traffic capture") before turning it on. The capture directory is created 0700 and every file in
it (parts, and the file `merge` writes) is 0600, whatever the process's umask.

Rows use the workload schema (`pipeline.workloads`), so a capture is a workload and a corpus as it is:
`id` (`chat:<unix ms>:<random>` or `completions:...`), `prompt` (completions) or `messages` (chat, JSON text),
`max_new_tokens` (what the engine was asked for: the request's `max_tokens`/`max_completion_tokens`, or the value
the ingress filled in for a request without one) and `output` (the answer's text). Each flush writes a new part
file `part-<random>-<seq>.parquet` into `dir` (Parquet files cannot be appended to, and a part is complete the
moment it exists); `python -m serve.closed_loop.capture merge DIR OUT.parquet` joins the parts into the file
`python -m pipeline.tune --workload OUT.parquet` replays.

Writes happen on a worker thread, never on the event loop; a failed write is logged and drops that part, never a
request, and its rows do not count toward `max_rows`. Buffered rows are written when `flush_rows` are buffered,
when the oldest is `flush_s` old (a timer, whether or not more requests come), and when the replica stops (`close`:
Serve's graceful stop of the replica on a roll or a shutdown). A process killed outright (SIGKILL, or Ray's workers
signalled with the whole process group) loses what it buffered: at most `flush_rows` rows or `flush_s` of them.

Shared folders: an existing capture directory must be the endpoint user's own and closed to others (mode 0700 or
stricter; anything else is refused at start, naming the fix), and every file is created under an unpredictable name
with `O_EXCL | O_NOFOLLOW`, so a link planted in the folder is never written through. Parts are read (the bound's
count, `merge`) only when they are regular files, without blocking (a FIFO named like a part is skipped).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from serve.closed_loop.files import (DIR_MODE, FILE_MODE, NotRegular, make_private_dir, open_regular, part_files,
                                     private_dir_problem, write_private)
from serve.http_limits import COMPLETIONS_DEFAULT_MAX_TOKENS
from serve.spec import FrozenModel
from serve.sse import SseDecoder, SseEvent

__all__ = ["CaptureSettings", "Capture", "CAPTURED_ROUTES", "DIR_MODE", "FILE_MODE", "row_of", "merge_parts",
           "make_private_dir", "private_dir_problem", "write_private", "part_files", "main"]

log = logging.getLogger("serve.closed_loop.capture")
CAPTURED_ROUTES = ("/v1/chat/completions", "/v1/completions")


class CaptureSettings(FrozenModel):
    """Where and how much to capture. On the command line: `--capture DIR` or `--capture '{"dir": ..., ...}'`."""

    dir: str = Field(description="directory for the Parquet parts (created if missing)")
    sample_rate: float = Field(0.1, gt=0, le=1, description="fraction of successful requests kept")
    max_rows: int = Field(10_000, ge=1, description="capture stops after this many rows in dir")
    flush_rows: int = Field(64, ge=1, description="rows buffered before a part file is written")
    flush_s: float = Field(30.0, gt=0, description="a buffered row is written at the latest this long after it was "
                                                   "answered (a timer)")
    seed: int | None = Field(None, description="sampling seed (tests); None = random")

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("{"):
                try:
                    return json.loads(text)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"capture: {value!r} is not valid JSON ({exc.msg}); give a directory or "
                                     '{"dir": "...", "sample_rate": 0.1}') from None
            return {"dir": text}
        return value


def row_of(route: str, request: dict[str, Any], answer_text: str, default_max_tokens: int) -> dict[str, Any] | None:
    """The workload row of one answered request, or None if the request is not a replayable prompt. Pure."""
    limit = request.get("max_completion_tokens") or request.get("max_tokens") or default_max_tokens
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        return None
    chat = route.endswith("/chat/completions")
    kind = "chat" if chat else "completions"
    row: dict[str, Any] = {"id": f"{kind}:{int(time.time() * 1000)}:{uuid.uuid4().hex[:8]}", "prompt": None,
                           "messages": None, "max_new_tokens": limit, "output": answer_text}
    if chat:
        messages = request.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        flat = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # text parts, as the engines accept them
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(content, str) or m.get("role") not in ("system", "user", "assistant"):
                return None
            flat.append({"role": m["role"], "content": content})
        if flat[-1]["role"] != "user":
            return None
        row["messages"] = json.dumps(flat, ensure_ascii=False)
    else:
        prompt = request.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            return None  # token-id or batched prompts: not replayable as a workload row
        row["prompt"] = prompt
    return row


def _answer_text(payload: dict[str, Any]) -> str:
    choice = (payload.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    return str(message.get("content") or choice.get("text") or "")


def _stream_event(event: SseEvent) -> tuple[str, bool]:
    """(text, is an error event) of one SSE event of an OpenAI stream (('', False) for anything else)."""
    data = event.data.strip()
    if not data or event.done:
        return "", False
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        return "", False
    if not isinstance(chunk, dict):
        return "", False
    if "error" in chunk:
        return "", True
    choice = (chunk.get("choices") or [{}])[0]
    delta = choice.get("delta") or {}
    return str(delta.get("content") or choice.get("text") or ""), False


def _read_table(path: Path) -> Any:
    """One part as a pyarrow table, opened as a regular file without following a link or blocking."""
    import pyarrow.parquet as pq

    with os.fdopen(open_regular(path, follow_links=False), "rb") as handle:
        return pq.read_table(handle)


class Capture:
    """One ingress replica's capture. `Capture(None)` is off and costs one attribute check per request."""

    def __init__(self, settings: CaptureSettings | None, default_max_tokens: int = 2048) -> None:
        self.settings = settings
        self.default_max_tokens = default_max_tokens
        if settings is None:
            return
        self.dir = Path(settings.dir)
        make_private_dir(self.dir)
        self._rng = random.Random(settings.seed)
        self._lock = threading.Lock()
        self._rows: list[dict[str, Any]] = []
        self._oldest = 0.0
        self._seq = 0
        self._tag = f"{uuid.uuid4().hex[:8]}"
        self._kept = _rows_in(self.dir)  # rows on disk, buffered or being written; a failed write gives its back
        self._full_logged = False
        self._closed = False
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capture")
        # The timer writes a buffered row once it is flush_s old, whether or not another request comes.
        self._wake = threading.Event()
        threading.Thread(target=self._timer, name="capture-timer", daemon=True).start()

    async def observe(self, route: str, body: dict[str, Any] | None, response: Any) -> Any:
        """The ingress hook: maybe record (request, response); `body` is the request as the engine was asked (the
        ingress's filled-in max_tokens included), None when it never got that far. Returns the response to send (a
        streamed one is wrapped so its text is collected as it passes)."""
        settings = self.settings
        if settings is None or route not in CAPTURED_ROUTES or response.status_code != 200:
            return response
        if not isinstance(body, dict) or self._rng.random() >= settings.sample_rate:
            return response
        iterator = getattr(response, "body_iterator", None)
        if iterator is None:
            try:
                self.record(route, body, _answer_text(json.loads(response.body)))
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                pass
            return response

        request: dict[str, Any] = body

        async def relay() -> AsyncIterator[Any]:
            pieces: list[str] = []
            decoder = SseDecoder()
            complete = failed = False

            def note(events: list[SseEvent]) -> None:
                nonlocal complete, failed
                for event in events:
                    text, error = _stream_event(event)
                    pieces.append(text)
                    failed = failed or error
                    complete = complete or event.done

            try:
                async for chunk in iterator:
                    note(decoder.feed(chunk.encode() if isinstance(chunk, str) else chunk))
                    yield chunk
                complete = True
            finally:
                # A client may hang up as soon as it has `data: [DONE]`, before this generator resumes (it is then
                # closed at its `yield`): the answer was whole, so it is kept. A stream cut before [DONE] is not, nor
                # one that carried an error event (a timeout or a dead engine ends it with one, then [DONE]).
                note(decoder.close())
                if complete and not failed:
                    self.record(route, request, "".join(pieces))

        response.body_iterator = relay()
        return response

    def record(self, route: str, request: dict[str, Any], answer_text: str) -> None:
        # the ingress passes the request with its filled-in max_tokens; a caller that does not gets the same default
        default = (self.default_max_tokens if route.endswith("/chat/completions")
                   else min(COMPLETIONS_DEFAULT_MAX_TOKENS, self.default_max_tokens))
        row = row_of(route, request, answer_text, default)
        if row is None or self.settings is None:
            return
        with self._lock:
            if self._closed:
                return
            if self._kept >= self.settings.max_rows:
                if not self._full_logged:
                    log.warning("traffic capture: max_rows=%d reached in %s; capture stopped",
                                self.settings.max_rows, self.dir)
                    self._full_logged = True
                return
            self._kept += 1
            now = time.monotonic()
            if not self._rows:
                self._oldest = now
                self._wake.set()  # the timer now has a row to wait for
            self._rows.append(row)
            if len(self._rows) < self.settings.flush_rows and now < self._oldest + self.settings.flush_s:
                return
            self._submit()

    def _submit(self) -> None:
        """Hand the buffered rows to the writer as the next part (called holding the lock, so no write is handed
        over after `close` stopped the writer)."""
        rows, self._rows = self._rows, []
        self._seq += 1
        self._writer.submit(self._write, rows, self.dir / f"part-{self._tag}-{self._seq:06d}.parquet")

    def _write(self, rows: list[dict[str, Any]], path: Path) -> None:
        if _write_part(rows, path):
            return
        with self._lock:  # rows that never reached the disk do not count toward max_rows
            self._kept -= len(rows)
            self._full_logged = False

    def flush_due(self, now: float | None = None) -> bool:
        """Write the buffer if its oldest row is `flush_s` old at `now` (monotonic; default: now); whether it did."""
        if self.settings is None:
            return False
        with self._lock:
            now = time.monotonic() if now is None else now
            if self._closed or not self._rows or now < self._oldest + self.settings.flush_s:
                return False
            self._submit()
        return True

    def _timer(self) -> None:
        flush_s = self.settings.flush_s if self.settings is not None else 0.0
        while not self._closed:
            with self._lock:
                wait = max(0.0, self._oldest + flush_s - time.monotonic()) if self._rows else None
            self._wake.wait(wait)
            self._wake.clear()
            if not self._closed:
                self.flush_due()

    def flush(self) -> None:
        """Write what is buffered and wait for every pending write (tests, shutdown)."""
        if self.settings is None:
            return
        with self._lock:
            if self._closed:
                return
            if self._rows:
                self._submit()
            pending = self._writer.submit(lambda: None)
        pending.result()

    def close(self) -> None:
        """Write what is buffered, wait for it, and take no more rows (the replica stops). Idempotent."""
        if self.settings is None:
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._rows:
                self._submit()
        self._wake.set()
        self._writer.shutdown(wait=True)


_COLUMNS = ("id", "prompt", "messages", "max_new_tokens", "output")


def _write_part(rows: list[dict[str, Any]], path: Path) -> bool:
    """Write one part; False (logged) when it could not be written (a full disk)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pa.table({c: [r[c] for r in rows] for c in _COLUMNS},
                         schema=pa.schema([("id", pa.string()), ("prompt", pa.string()), ("messages", pa.string()),
                                           ("max_new_tokens", pa.int64()), ("output", pa.string())]))
        write_private(lambda handle: pq.write_table(table, handle), path)
        return True
    except Exception:  # noqa: BLE001 - a capture failure must never reach a request
        log.exception("traffic capture: writing %s failed; %d rows dropped", path, len(rows))
        return False


def _rows_in(directory: Path) -> int:
    import pyarrow.parquet as pq

    total = 0
    for part in sorted(directory.glob("part-*.parquet")):
        try:
            with os.fdopen(open_regular(part, follow_links=False), "rb") as handle:
                total += pq.ParquetFile(handle).metadata.num_rows
        except NotRegular as exc:  # a FIFO, a link or a folder named like a part: never opened for reading
            log.warning("traffic capture: %s is %s; not counted", part, exc.strerror)
        except Exception:  # noqa: BLE001 - a foreign file does not stop the endpoint
            log.warning("traffic capture: %s is not a readable part; not counted", part)
    return total


def merge_parts(directory: str | Path, out: str | Path) -> int:
    """Join a capture directory's parts into one Parquet workload file; returns the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = part_files(Path(directory))
    if not parts:
        raise ValueError(f"capture: no part-*.parquet files in {str(directory)!r} (is capture on, and has the "
                         "endpoint answered sampled requests?)")
    table = pa.concat_tables([_read_table(p) for p in parts])
    write_private(lambda handle: pq.write_table(table, handle), Path(out))
    return table.num_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve.closed_loop.capture", description="traffic capture tools")
    sub = parser.add_subparsers(dest="command", required=True)
    merge = sub.add_parser("merge", help="join a capture directory's parts into one workload Parquet file")
    merge.add_argument("dir")
    merge.add_argument("out")
    args = parser.parse_args(argv)
    try:
        rows = merge_parts(args.dir, args.out)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{rows} rows -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
