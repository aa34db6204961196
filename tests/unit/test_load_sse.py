"""SSE parsing of the load generator: the pure decoder and fold, then `run_phase` against a real local HTTP server
that streams awkward byte chunks (split lines, split UTF-8, keep-alives, error events)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from pipeline.measure.load import LoadRequest, StreamState, run_phase
from serve.sse import SseDecoder, SseEvent


def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def decode_all(chunks: list[bytes]) -> list[SseEvent]:
    decoder = SseDecoder()
    events = [e for chunk in chunks for e in decoder.feed(chunk)]
    return events + decoder.close()


def every_split(data: bytes) -> Iterator[list[bytes]]:
    """The stream cut at each byte position, and cut into single bytes."""
    for cut in range(1, len(data)):
        yield [data[:cut], data[cut:]]
    yield [data[i:i + 1] for i in range(len(data))]


STREAM = (sse({"text": "é", "output_ids": [1], "meta_info": {"completion_tokens": 1}})
          + b": keep-alive\n\n"
          + sse({"text": "é€😀", "output_ids": [1, 2], "meta_info": {"completion_tokens": 2}})
          + b"data: [DONE]\n\n")


def test_events_are_the_same_wherever_the_byte_stream_is_cut():
    whole = decode_all([STREAM])
    assert [e.data for e in whole][-1] == "[DONE]" and len(whole) == 3
    assert json.loads(whole[1].data)["text"] == "é€😀"
    for chunks in every_split(STREAM):
        assert decode_all(chunks) == whole, chunks


def test_crlf_and_cr_line_ends_even_when_cr_and_lf_arrive_apart():
    crlf = b'data: {"a": 1}\r\n\r\ndata: [DONE]\r\n\r\n'
    assert [e.data for e in decode_all([crlf])] == ['{"a": 1}', "[DONE]"]
    assert [e.data for e in decode_all([crlf[:15], crlf[15:]])] == ['{"a": 1}', "[DONE]"]  # cut between \r and \n
    assert [e.data for e in decode_all([b"data: x\r\rdata: y\r\r"])] == ["x", "y"]


def test_comments_blank_lines_and_unknown_fields_are_not_events():
    events = decode_all([b": ping\n\n\n", b"id: 7\nretry: 100\n\n", b"data: x\n\n"])
    assert events == [SseEvent("x")]


def test_multi_line_data_is_joined_and_event_names_are_kept():
    events = decode_all([b"event: error\ndata: {\"error\":\ndata:  \"boom\"}\n\n"])
    assert events == [SseEvent('{"error":\n "boom"}', "error")]


def test_data_without_a_final_blank_line_is_dispatched_at_close():
    decoder = SseDecoder()
    assert decoder.feed(b"data: [DONE]") == []
    assert decoder.close() == [SseEvent("[DONE]")]


def fold(chunks: list[bytes]) -> StreamState:
    state = StreamState()
    decoder = SseDecoder()
    events = [e for chunk in chunks for e in decoder.feed(chunk)] + decoder.close()
    for n, event in enumerate(events):
        if not state.add(event, float(n)):
            break
    return state


def test_counters_come_from_the_last_event_that_carries_meta_info():
    state = fold([sse({"output_ids": [5], "meta_info": {"completion_tokens": 1, "spec_verify_ct": 0}}),
                  sse({"output_ids": [5, 6], "meta_info": {"completion_tokens": 2, "spec_verify_ct": 1,
                                                           "finish_reason": {"type": "length"}}}),
                  sse({"output_ids": [5, 6]}),  # no meta_info: the previous counters stand
                  b"data: [DONE]\n\n",
                  sse({"output_ids": [9], "meta_info": {"completion_tokens": 99}})])  # after [DONE]: ignored
    assert state.done and state.error is None
    assert state.meta == {"completion_tokens": 2, "spec_verify_ct": 1, "finish_reason": {"type": "length"}}
    assert state.chunks_ids == [[5], [5, 6], [5, 6]] and state.arrivals == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("chunks, expected", [
    ([sse({"output_ids": [1]}), sse({"error": {"message": "CUDA out of memory", "code": 500}})], "CUDA out of memory"),
    ([sse({"error": "plain string"})], "plain string"),
    ([b"event: error\ndata: {\"detail\": \"gone\"}\n\n"], "{'detail': 'gone'}"),
    ([b"data: {not json\n\n"], "bad SSE data"),
    ([b"data: [1, 2]\n\n"], "expected a JSON object"),
])
def test_error_events_and_bad_data_end_the_stream_with_the_reason(chunks, expected):
    state = fold(chunks + [sse({"output_ids": [7]})])
    assert state.error is not None and expected in state.error and not state.done
    assert [7] not in state.chunks_ids


# --- the load generator against a real server ---------------------------------------------------------------------

SCRIPTS: dict[str, list[bytes]] = {
    # "é€" as deltas, each character cut between two network writes, with a keep-alive in between
    "split": [b'data: {"text": "\xc3', b'\xa9", "output_ids": [10], "meta_info": {"completion_tokens": 1}}\n',
              b"\n: keep-alive\n\n", b'data: {"text": "\xe2\x82', b'\xac", "output_ids": [11], "meta_info": ',
              b'{"completion_tokens": 2, "prompt_tokens": 3, "finish_reason": {"type": "length"}}}\n\n',
              b"data: [DO", b"NE]\n\n"],
    "error": [sse({"output_ids": [10], "meta_info": {"completion_tokens": 1}}),
              sse({"error": {"message": "engine step failed", "code": 500}})],
    "truncated": [sse({"output_ids": [10], "meta_info": {"completion_tokens": 1}})],  # connection closes, no [DONE]
}


async def _app(scope, receive, send):  # noqa: ANN001 - a bare ASGI app
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    script = SCRIPTS[json.loads(body)["text"]]
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for piece in script:
        await send({"type": "http.response.body", "body": piece, "more_body": True})
        await asyncio.sleep(0.01)  # separate writes, so the client sees separate reads (not relied upon)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.fixture(scope="module")
def sse_server() -> Iterator[str]:
    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "test SSE server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_run_phase_records_a_stream_cut_mid_line_and_mid_character(sse_server):
    (record,) = run_phase(sse_server, [LoadRequest(0, "split", 2)], phase="measure", concurrency=1, timeout_s=30)
    assert record.error is None
    assert record.output_ids == (10, 11) and record.completion_tokens == 2 and record.prompt_tokens == 3
    assert record.finish_reason == "length" and len(record.itl_s) == 1 and record.ttft_s is not None


def test_run_phase_records_error_events_and_truncated_streams_as_failed_requests(sse_server):
    errored, truncated = run_phase(sse_server, [LoadRequest(0, "error", 2), LoadRequest(1, "truncated", 2)],
                                   phase="measure", concurrency=1, timeout_s=30)
    assert errored.error == "engine step failed" and errored.finish_reason == "error" and errored.output_ids == ()
    assert truncated.error is not None and "stream ended before the request finished" in truncated.error
