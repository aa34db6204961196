"""The proxy's connection limits (issue #63 item 1): a half-sent header is closed after header_timeout_s, and one
address cannot hold more than max_connections_per_client, so other clients keep being served.

A real uvicorn server (the one Serve's proxy runs) on loopback in a thread, built the way Serve builds its proxy:
the middleware chain first, then uvicorn's config, which loads the `auto` HTTP protocol. The idle sockets come from
127.0.0.2 and the real client from 127.0.0.1 (both loopback). Without the guard, a half-sent header is never closed
and every idle socket is accepted. The whole endpoint under 20,000 attempted sockets: benchmarks/idle_sockets.py.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
import uvicorn.protocols.http.auto as auto

from serve.ports import free_port
from serve.production.connection_guard import (CALLBACK, CALLBACK_ENV, LIMITS_ENV, ConnectionGuard, ConnectionLimits,
                                               GuardedHttpTools, default_max_connections, proxy_environment,
                                               proxy_middlewares, refusal)

HALF = b"GET /health HTTP/1.1\r\n"
IDLE_FROM = "127.0.0.2"


async def hello(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def guarded() -> Iterator[int]:
    original = auto.AutoHTTPProtocol
    app = ConnectionGuard(hello, header_timeout_s=1.0, max_connections_per_client=40)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
            time.sleep(0.05)  # polling a condition under a deadline
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        auto.AutoHTTPProtocol = original
        GuardedHttpTools.configure(ConnectionLimits())


def idle_socket(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((IDLE_FROM, 0))
    sock.connect(("127.0.0.1", port))
    sock.sendall(HALF)
    return sock


def answer_of(sock: socket.socket, deadline_s: float) -> bytes:
    """What the server sent before closing; fails if still open by then. A refused socket's half header was never
    read, so the server's close may reach the client as a reset, before or instead of its 503."""
    sock.settimeout(deadline_s)
    data = b""
    try:
        while chunk := sock.recv(4096):  # socket.timeout past the deadline fails the test
            data += chunk
    except ConnectionResetError:
        return data or b"reset"
    return data


def test_half_headers_are_closed_and_one_address_cannot_crowd_out_others(guarded):
    port = guarded
    idle = [idle_socket(port) for _ in range(120)]
    try:
        # another client is served while the idle address holds every connection it may
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).text == "ok"
        answers = [answer_of(sock, 30) for sock in idle]
    finally:
        for sock in idle:
            sock.close()
    timed_out = [a for a in answers if a.startswith(b"HTTP/1.1 408")]
    refused = [a for a in answers if a.startswith(b"HTTP/1.1 503") or a == b"reset"]
    assert len(timed_out) == 40 and b"header_timeout_s=1" in timed_out[0], answers[:3]
    assert len(refused) == 80, answers
    assert all(b"max_connections_per_client=40" in a for a in refused if a != b"reset"), refused
    # the address's slots are free again once its idle sockets are gone
    sock = idle_socket(port)
    try:
        sock.sendall(b"Host: x\r\n\r\n")
        assert answer_of_first_line(sock) == b"HTTP/1.1 200 OK"
    finally:
        sock.close()


def answer_of_first_line(sock: socket.socket) -> bytes:
    sock.settimeout(30)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    return data.split(b"\r\n", 1)[0]


def test_a_kept_alive_connection_gets_the_same_header_deadline_for_its_next_request(guarded):
    port = guarded
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert answer_of_first_line(sock) == b"HTTP/1.1 200 OK"
        sock.sendall(HALF)  # the next request never finishes its headers
        assert b"HTTP/1.1 408" in answer_of(sock, 30)
    finally:
        sock.close()


def test_the_decisions():
    limits = ConnectionLimits(max_connections_per_client=2, max_connections=10)
    assert refusal(limits, 5, 1, 10) is None
    assert "max_connections_per_client=2" in (refusal(limits, 5, 2, 10) or "")
    assert "max_connections=10" in (refusal(limits, 10, 0, 10) or "")
    assert default_max_connections(20_000) == 17_952 and default_max_connections(1024) == 768


def test_the_proxy_gets_the_limits_through_its_environment(monkeypatch):
    env: dict[str, str] = {}
    limits = ConnectionLimits(header_timeout_s=3, max_connections_per_client=7)
    assert proxy_environment(env, limits) is None and env[CALLBACK_ENV] == CALLBACK
    monkeypatch.setenv(LIMITS_ENV, env[LIMITS_ENV])
    (middleware,) = proxy_middlewares()  # what Ray's proxy calls
    assert middleware.cls is ConnectionGuard and middleware.kwargs == limits.model_dump()
    other = {CALLBACK_ENV: "mine:callback"}
    assert "mine:callback" in (proxy_environment(other, limits) or "") and other == {CALLBACK_ENV: "mine:callback"}
