"""Traffic capture at the production endpoint: a sample of real requests and their answers, as Parquet, to re-tune on.

Opt-in (`ProductionSettings.capture`, off by default), sampled (`sample_rate`), bounded (`max_rows` over the capture
directory, restarts included; then capture stops and says so once in the log). Only successful (200)
`/v1/chat/completions` and `/v1/completions` answers are kept, streamed or not. Captured rows hold user prompts and
generated text: read docs/security.md ("Traffic capture") before turning it on.

Rows use the workload schema (`pipeline.workloads`), so a capture is a workload and a corpus as it is:
`id` (`<route>:<unix ms>:<random>`), `prompt` (completions) or `messages` (chat, JSON text), `max_new_tokens` (the
request's `max_tokens`/`max_completion_tokens`, else the endpoint's limit as the ingress applies it) and `output`
(the answer's text). Each flush writes a new part file `part-<pid>-<random>-<seq>.parquet` into `dir` (Parquet files
cannot be appended to, and a part is complete the moment it exists); `python -m serve.capture merge DIR OUT.parquet`
joins the parts into the file `python -m pipeline.tune --workload OUT.parquet` replays.

Writes happen on a worker thread, never on the event loop; a failed write is logged and drops that part, never a
request.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from serve.spec import FrozenModel

__all__ = ["CaptureSettings", "Capture", "CAPTURED_ROUTES", "row_of", "merge_parts", "main"]

log = logging.getLogger("serve.capture")
CAPTURED_ROUTES = ("/v1/chat/completions", "/v1/completions")


class CaptureSettings(FrozenModel):
    """Where and how much to capture. On the command line: `--capture DIR` or `--capture '{"dir": ..., ...}'`."""

    dir: str = Field(description="directory for the Parquet parts (created if missing)")
    sample_rate: float = Field(0.1, gt=0, le=1, description="fraction of successful requests kept")
    max_rows: int = Field(10_000, ge=1, description="capture stops after this many rows in dir")
    flush_rows: int = Field(64, ge=1, description="rows buffered before a part file is written")
    flush_s: float = Field(30.0, gt=0, description="a buffered row older than this is written with the next one")
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
    row: dict[str, Any] = {"id": f"{route.rsplit('/', 1)[-1]}:{int(time.time() * 1000)}:{uuid.uuid4().hex[:8]}",
                           "prompt": None, "messages": None, "max_new_tokens": limit, "output": answer_text}
    if route.endswith("/chat/completions"):
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


def _stream_delta(line: bytes) -> str:
    """Text of one SSE `data:` line of an OpenAI stream ('' for anything else)."""
    if not line.startswith(b"data:"):
        return ""
    data = line[5:].strip()
    if not data or data == b"[DONE]":
        return ""
    try:
        chunk = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return ""
    choice = (chunk.get("choices") or [{}])[0] if isinstance(chunk, dict) else {}
    delta = choice.get("delta") or {}
    return str(delta.get("content") or choice.get("text") or "")


class Capture:
    """One ingress replica's capture. `Capture(None)` is off and costs one attribute check per request."""

    def __init__(self, settings: CaptureSettings | None, default_max_tokens: int = 2048) -> None:
        self.settings = settings
        self.default_max_tokens = default_max_tokens
        if settings is None:
            return
        self.dir = Path(settings.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._rng = random.Random(settings.seed)
        self._lock = threading.Lock()
        self._rows: list[dict[str, Any]] = []
        self._oldest = 0.0
        self._seq = 0
        self._tag = f"{uuid.uuid4().hex[:8]}"
        self._kept = _rows_in(self.dir)
        self._full_logged = False
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="capture")

    async def observe(self, route: str, request: Any, response: Any) -> Any:
        """The ingress hook: maybe record (request, response); returns the response to send (a streamed one is
        wrapped so its text is collected as it passes)."""
        settings = self.settings
        if settings is None or route not in CAPTURED_ROUTES or response.status_code != 200:
            return response
        if self._rng.random() >= settings.sample_rate:
            return response
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            return response
        if not isinstance(body, dict):
            return response
        iterator = getattr(response, "body_iterator", None)
        if iterator is None:
            try:
                self.record(route, body, _answer_text(json.loads(response.body)))
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                pass
            return response

        async def relay():
            pieces: list[str] = []
            pending = b""
            complete = False
            try:
                async for chunk in iterator:
                    raw = chunk.encode() if isinstance(chunk, str) else chunk
                    pending += raw
                    *lines, pending = pending.split(b"\n")
                    pieces.extend(_stream_delta(line) for line in lines)
                    complete = complete or any(line.strip() == b"data: [DONE]" for line in lines)
                    yield chunk
                complete = True
            finally:
                # A client may hang up as soon as it has `data: [DONE]`, before this generator resumes (it is then
                # closed at its `yield`): the answer was whole, so it is kept. A stream cut before [DONE] is not.
                if complete:
                    pieces.append(_stream_delta(pending))
                    self.record(route, body, "".join(pieces))

        response.body_iterator = relay()
        return response

    def record(self, route: str, request: dict[str, Any], answer_text: str) -> None:
        row = row_of(route, request, answer_text, self.default_max_tokens)
        if row is None or self.settings is None:
            return
        with self._lock:
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
            self._rows.append(row)
            if len(self._rows) < self.settings.flush_rows and now - self._oldest < self.settings.flush_s:
                return
            rows, self._rows = self._rows, []
            self._seq += 1
            path = self.dir / f"part-{self._tag}-{self._seq:06d}.parquet"
        self._writer.submit(_write_part, rows, path)

    def flush(self) -> None:
        """Write what is buffered and wait for every pending write (tests, shutdown)."""
        if self.settings is None:
            return
        with self._lock:
            rows, self._rows = self._rows, []
            self._seq += 1
            path = self.dir / f"part-{self._tag}-{self._seq:06d}.parquet"
        if rows:
            self._writer.submit(_write_part, rows, path)
        self._writer.submit(lambda: None).result()


_COLUMNS = ("id", "prompt", "messages", "max_new_tokens", "output")


def _write_part(rows: list[dict[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pa.table({c: [r[c] for r in rows] for c in _COLUMNS},
                         schema=pa.schema([("id", pa.string()), ("prompt", pa.string()), ("messages", pa.string()),
                                           ("max_new_tokens", pa.int64()), ("output", pa.string())]))
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(table, tmp)
        tmp.replace(path)  # readers (merge, the bound's count) never see half a part
    except Exception:  # noqa: BLE001 - a capture failure must never reach a request
        log.exception("traffic capture: writing %s failed; %d rows dropped", path, len(rows))


def _rows_in(directory: Path) -> int:
    import pyarrow.parquet as pq

    total = 0
    for part in sorted(directory.glob("part-*.parquet")):
        try:
            total += pq.ParquetFile(part).metadata.num_rows
        except Exception:  # noqa: BLE001 - a foreign file does not stop the endpoint
            log.warning("traffic capture: %s is not a readable part; not counted", part)
    return total


def merge_parts(directory: str | Path, out: str | Path) -> int:
    """Join a capture directory's parts into one Parquet workload file; returns the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = sorted(Path(directory).glob("part-*.parquet"))
    if not parts:
        raise ValueError(f"capture: no part-*.parquet files in {str(directory)!r} (is capture on, and has the "
                         "endpoint answered sampled requests?)")
    table = pa.concat_tables([pq.read_table(p) for p in parts])
    pq.write_table(table, out)
    return table.num_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve.capture", description="traffic capture tools")
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
