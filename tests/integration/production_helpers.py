"""Helpers of the production-endpoint tests: the processes of one Serve app (found among this test process's
descendants, never another run's), /metrics counters, and raw HTTP a client library would not send."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlparse

import httpx
import psutil

from benchmarks.soak_faults import sse_outcome


def app_processes(app: str, root: int | None = None) -> dict[str, list[psutil.Process]]:
    """The engine processes (with their watchdogs) and replica actors of Serve app `app`, among the descendants of
    `root` (default: this process, whose local Ray they run in)."""
    found: dict[str, list[psutil.Process]] = {"engine": [], "watchdog": [], "ingress": [], "backend": []}
    for proc in psutil.Process(root).children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if f"ServeReplica:{app}:OpenAIIngress" in cmd:
            found["ingress"].append(proc)
        elif f"ServeReplica:{app}:EngineBackend" in cmd:
            found["backend"].append(proc)
            for child in _children(proc):
                found["watchdog"].append(child)
                found["engine"].extend(_children(child))
    return found


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children()
    except psutil.Error:
        return []


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            pass
    return out


def wait_for(condition, what: str, deadline_s: float, period_s: float = 0.2):
    """Poll `condition()` until it returns something truthy (returned), or fail naming `what`."""
    deadline = time.monotonic() + deadline_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} within {deadline_s:.0f} s"
        time.sleep(period_s)  # polling a condition under a deadline


def metric(base_url: str, key: str, name: str, **labels: str) -> float:
    """The value of one /metrics sample (0 when absent)."""
    text = httpx.get(f"{base_url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=60).text
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    needle = f"{name}{{{wanted}}} " if labels else f"{name} "
    return sum(float(line[len(needle):]) for line in text.splitlines() if line.startswith(needle))


def openai_error(response: httpx.Response) -> dict:
    """The error object of an answer in OpenAI's shape (fails the test if it is not)."""
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    assert body["error"]["code"] == response.status_code and body["error"]["message"], body
    return body["error"]


def stream_outcome(lines: list[str]) -> tuple[bool, dict | None]:
    """(ended with [DONE], the error event if one came) of an SSE stream's lines."""
    done, error, _ = sse_outcome(lines)
    return done, error


def raw_post(base_url: str, path: str, head: dict[str, str], body_chunks, timeout_s: float = 120) -> int:
    """POST with a chunked body written by hand (httpx would buffer nothing but also retries nothing): returns the
    status code the server answered, even if it closed the connection before the body was sent."""
    url = urlparse(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=timeout_s) as sock:
        lines = [f"POST {path} HTTP/1.1", f"Host: {url.hostname}", "Transfer-Encoding: chunked",
                 *(f"{k}: {v}" for k, v in head.items())]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        try:
            for chunk in body_chunks:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed: read what it said
        reply = b""
        while b"\r\n" not in reply:
            piece = sock.recv(4096)
            if not piece:
                break
            reply += piece
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/") else -1
