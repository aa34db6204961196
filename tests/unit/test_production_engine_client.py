"""The replica's client of its engine (serve/replica/engine_client.py) against a real local socket server that misbehaves as
a paused or dying engine does (issue #31 items 3, 4): a connection closed without an answer is retried once, a
dead engine is EngineUnavailable (the ingress's 503), never a bare transport error."""

from __future__ import annotations

import asyncio

import pytest

from serve.replica import engine_client
from serve.http_errors import EngineUnavailable

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
CUT_STREAM = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
              b"a\r\ndata: {}\n\n\r\n")  # one chunk, then the process dies (no terminating chunk)


async def _serve(script: list[bytes | None]):
    """A server answering connection i with script[i] (None: read the request, close without a word)."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = len(connections)
        connections.append(index)
        await reader.readuntil(b"\r\n\r\n")
        answer = script[min(index, len(script) - 1)]
        if answer is not None:
            writer.write(answer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", connections


def _running() -> str | None:
    return None


def test_a_connection_closed_without_an_answer_is_sent_again_once():
    async def run():
        server, url, connections = await _serve([None, OK])
        async with server, engine_client.new_client(url) as client:
            answer = await engine_client.call(client, _running, "POST", "/v1/completions", b"{}")
        return answer, connections

    (status, ctype, body), connections = asyncio.run(run())
    assert (status, body) == (200, b"{}") and len(connections) == 2


def test_an_engine_that_never_answers_is_unavailable_after_one_retry():
    async def run():
        server, url, connections = await _serve([None])
        async with server, engine_client.new_client(url) as client:
            with pytest.raises(EngineUnavailable, match="closed the connection without answering"):
                await engine_client.call(client, _running, "GET", "/health")
        return connections

    assert len(asyncio.run(run())) == 2


def test_a_dead_engine_is_unavailable_without_a_connection_attempt():
    async def run():
        async with engine_client.new_client("http://127.0.0.1:9") as client:
            with pytest.raises(EngineUnavailable, match="exited with code -9"):
                await engine_client.call(client, lambda: "the engine exited with code -9", "GET", "/health")

    asyncio.run(run())


def test_a_stream_the_engine_leaves_mid_answer_is_unavailable():
    async def run():
        server, url, _ = await _serve([CUT_STREAM])
        got = []
        async with server, engine_client.new_client(url) as client:
            with pytest.raises(EngineUnavailable, match="mid-answer"):
                async for item in engine_client.call_stream(client, _running, "POST", "/v1/completions", b"{}"):
                    got.append(item)
        return got

    got = asyncio.run(run())
    assert got[0] == (200, "text/event-stream") and got[1:] == [b"data: {}\n\n"]
