"""Traffic capture records what production really answered, readable by the operators only (issue #31 item 8)."""

from __future__ import annotations

import asyncio
import json
import os
import stat

import pyarrow.parquet as pq
from fastapi.responses import StreamingResponse

from serve.closed_loop.capture import Capture, CaptureSettings, merge_parts

CHAT = [{"role": "user", "content": "Name a colour."}]


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _rows(directory) -> list[dict]:
    return [row for part in sorted(directory.glob("part-*.parquet")) for row in pq.read_table(part).to_pylist()]


def test_the_capture_folder_and_its_files_are_private_whatever_the_umask(tmp_path):
    previous = os.umask(0o022)  # a usual default: 0755 folders, 0644 files
    try:
        folder = tmp_path / "capture"
        cap = Capture(CaptureSettings(dir=str(folder), sample_rate=1, flush_rows=1))
        cap.record("/v1/completions", {"prompt": "my card number is 4111", "max_tokens": 4}, "!")
        cap.flush()
        merged = tmp_path / "captured.parquet"
        merge_parts(folder, merged)
    finally:
        os.umask(previous)
    parts = list(folder.glob("part-*.parquet"))
    assert parts and _mode(folder) == 0o700
    assert {_mode(p) for p in parts} == {0o600} and _mode(merged) == 0o600
    assert not list(folder.glob(".*"))  # no temporary file left


def test_a_stream_ended_by_an_error_event_is_not_captured(tmp_path):
    cap = Capture(CaptureSettings(dir=str(tmp_path), sample_rate=1, flush_rows=1, seed=0))

    async def cut_by_timeout():
        # what the ingress sends when request_timeout_s cuts a stream (serve/production/stream_relay.py): an error, then [DONE]
        yield f"data: {json.dumps({'choices': [{'delta': {'content': 'Bl'}}]})}\n\n".encode()
        yield b'data: {"error": {"message": "the request took longer than request_timeout_s=2", "code": 504}}\n\n'
        yield b"data: [DONE]\n\n"

    async def whole():
        yield f"data: {json.dumps({'choices': [{'delta': {'content': 'Blue.'}}]})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    async def drain(response):
        return [chunk async for chunk in response.body_iterator]

    for source in (cut_by_timeout, whole):
        response = asyncio.run(cap.observe("/v1/chat/completions", {"messages": CHAT, "stream": True, "max_tokens": 8},
                                           StreamingResponse(source(), status_code=200)))
        asyncio.run(drain(response))
    cap.flush()
    assert [row["output"] for row in _rows(tmp_path)] == ["Blue."]


def test_rows_carry_the_max_tokens_served_and_the_route_they_came_from(tmp_path):
    cap = Capture(CaptureSettings(dir=str(tmp_path), sample_rate=1, flush_rows=1), default_max_tokens=2048)
    cap.record("/v1/completions", {"prompt": "Once"}, " upon")  # no max_tokens: the engine was asked for 16
    cap.record("/v1/chat/completions", {"messages": CHAT}, "Blue.")  # chat: the endpoint's limit
    cap.flush()
    rows = _rows(tmp_path)
    assert [(row["id"].split(":")[0], row["max_new_tokens"]) for row in rows] == [("completions", 16),
                                                                                  ("chat", 2048)]
