"""One SSE parser (`serve.sse`) for every stream the project reads: the load generator, the ingress's live figures,
traffic capture and the llama.cpp shim. The decoder's own rules are in tests/unit/test_load_sse.py."""

import ast
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from serve.engines.llama_cpp.server import completion_events
from serve.sse import SseDecoder, SseEvent, event_of

ROOT = Path(__file__).resolve().parents[2]


def test_event_of_one_block_and_none_for_a_comment():
    assert event_of(b'data: {"a": 1}') == SseEvent('{"a": 1}')
    assert event_of(b"event: error\r\ndata: x\r\n\r\n") == SseEvent("x", "error")
    assert event_of(b": keep-alive") is None


def test_done_is_the_closing_event_whatever_its_spacing():
    decoder = SseDecoder()
    events = decoder.feed(b"data:[DONE]\n\ndata: [DONE] \n\n") + decoder.close()
    assert [e.done for e in events] == [True, True]
    assert not SseEvent('"[DONE]"').done


def test_no_module_reads_data_lines_by_hand():
    """A `startswith("data:")` outside serve/sse.py is a second SSE parser."""
    found = []
    for package in ("serve", "pipeline"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "startswith" and node.args
                        and isinstance(node.args[0], ast.Constant) and node.args[0].value in ("data:", b"data:")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


class Chunks(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk


def test_the_llama_cpp_shim_reads_llama_servers_stream_however_it_is_cut():
    """llama-server's `/completion` stream: one JSON object per event, cut mid-line, CRLF line ends, and a last
    event without its blank line."""
    chunks = [b'data: {"content": "a", "tok', b'ens": [1]}\r\n\r\n: ping\n\ndata: {"content": "b",',
              b' "tokens": [2]}\n\ndata: {"content": "", "tokens": [], "stop": true}']

    async def read() -> list[dict]:
        return [event async for event in completion_events(httpx.Response(200, stream=Chunks(chunks)))]

    assert asyncio.run(read()) == [{"content": "a", "tokens": [1]}, {"content": "b", "tokens": [2]},
                                   {"content": "", "tokens": [], "stop": True}]
