"""The fault side of benchmarks/soak.py: this run's processes, and the faults injected through the endpoint (the
engine paused then killed, clients that leave mid-request, oversize bodies), and the cool-down reading after them."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import statistics
import time
from typing import Any

import httpx
import psutil

PROMPTS = ["Write a haiku about the sea.", "List three colors.", "Say hello in French.",
           "What is 2 + 2? Answer briefly.", "Name a fruit that is yellow.", "Describe a cat in one sentence."]


def sse_outcome(lines: list[str]) -> tuple[bool, dict | None, int]:
    """(ended with [DONE], the last error event if one came, data chunks before the end) of an SSE stream's lines."""
    done, error, chunks = False, None, 0
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            error = event["error"]
        else:
            chunks += 1
    return done, error, chunks


ROOT: list[int] = []  # the endpoint's driver process (`python -m serve.production`), set by the soak


def descendants() -> list[psutil.Process]:
    try:
        return psutil.Process(ROOT[0] if ROOT else None).children(recursive=True)
    except psutil.Error:
        return []


def our_processes() -> dict[str, list[psutil.Process]]:
    """The engine, watchdog and Serve actor processes of this run: descendants of its driver (its local Ray), never
    another run's on a shared machine."""
    groups: dict[str, list[psutil.Process]] = {"engine": [], "watchdog": [], "ingress": [], "proxy": [],
                                               "replicas": []}
    for proc in descendants():
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "serve.engines.watchdog" in cmd:
            groups["watchdog"].append(proc)
        elif "serve.engines.cpu" in cmd and "--model-path" in cmd:
            groups["engine"].append(proc)
        elif "OpenAIIngress" in cmd:
            groups["ingress"].append(proc)
        elif "ProxyActor" in cmd:
            groups["proxy"].append(proc)
        elif "ServeReplica:" in cmd or "ServeController" in cmd:
            groups["replicas"].append(proc)
    return groups


def rss_now() -> dict[str, int]:
    """Per group: RSS (`name`) and private memory (`name private`, USS). RSS also counts the pages of Ray's shared
    object store a process has touched (request bodies travel from the proxy to a replica through it), which stay
    mapped and are reused: private memory is what a process holds itself."""
    sample: dict[str, int] = {}
    for name, procs in our_processes().items():
        rss = uss = 0
        for proc in procs:
            try:
                rss += proc.memory_info().rss
                uss += proc.memory_full_info().uss
            except psutil.Error:
                pass
        sample[name], sample[f"{name} private"] = rss, uss
    return sample


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def engine_process() -> psutil.Process | None:
    engines = [p for p in our_processes()["engine"] if alive(p)]
    return engines[0] if len(engines) == 1 else None


FAULTS_FROM = 0.15  # share of the run before any fault (the memory's start level is read then)


async def faults(base: str, run: Any, pause: bool = True, kill: bool = True) -> None:
    """The engine paused at 25% of the run, killed at 50%; each fault's window ends when /health is 200 again."""
    args = run.args
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        async def healthy_again(window: list[float]) -> None:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    if (await http.get("/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
            window[1] = run.now()

        await asyncio.sleep(0.25 * args.duration)
        engine = engine_process() if pause else None
        if engine is not None:
            window = [run.now(), 0.0]
            run.windows.append(window)
            engine.send_signal(signal.SIGSTOP)
            run.events.append(f"{window[0]:.0f} s: engine {engine.pid} SIGSTOP for {args.pause_s:g} s")
            await asyncio.sleep(args.pause_s)  # the fault's length
            engine.send_signal(signal.SIGCONT)
            await healthy_again(window)
        await asyncio.sleep(max(0.0, run.started + 0.5 * args.duration - time.monotonic()))
        engine = engine_process() if kill else None
        if engine is not None:
            window = [run.now(), 0.0]
            run.windows.append(window)
            engine.kill()
            run.events.append(f"{window[0]:.0f} s: engine {engine.pid} SIGKILL")
            await healthy_again(window)
            run.events.append(f"{window[1]:.0f} s: /health 200 again (replica replaced)")


async def disconnecting_client(base: str, key: str, idx: int, run: Any) -> None:
    """Leaves mid-request: a stream closed after its first event, or a plain request whose socket is closed once
    sent (the engine must stop decoding for both)."""
    headers = {"Authorization": f"Bearer {key}"}
    host, port = base.rsplit("/", 1)[-1].split(":")
    await asyncio.sleep(FAULTS_FROM * run.args.duration)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as http:
        n = 0
        while time.monotonic() < run.stop_at:
            n += 1
            body = {"model": "m", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                    "messages": [{"role": "user", "content": PROMPTS[(idx + n) % len(PROMPTS)]}]}
            try:
                if n % 2:
                    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
                        async for _ in response.aiter_lines():
                            break
                else:
                    payload = json.dumps(body).encode()
                    reader, writer = await asyncio.open_connection(host, int(port))
                    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: "
                                 + str(len(payload)).encode() + b"\r\n\r\n" + payload)
                    await writer.drain()
                    await asyncio.sleep(0.5)
                    writer.close()
                run.counts["disconnects"] += 1
            except (httpx.HTTPError, OSError) as exc:
                run.counts[f"disconnect client {type(exc).__name__}"] += 1
            await asyncio.sleep(1.0)


def _chunked_upload(base: str, key: str, mib: int) -> str:
    """A chunked POST of `mib` MiB without a Content-Length, written by hand; the status the server answered."""
    host, port = base.rsplit("/", 1)[-1].split(":")
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                     b"Content-Type: application/json\r\nAuthorization: Bearer " + key.encode() + b"\r\n\r\n")
        chunk = b"x" * 2**20
        try:
            for _ in range(mib):
                sock.sendall(b"100000\r\n" + chunk + b"\r\n")
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed: read what it said
        try:
            reply = sock.recv(256)
        except OSError as exc:
            return type(exc).__name__
    return reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/") else "no answer"


async def oversize_client(base: str, key: str, run: Any) -> None:
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    await asyncio.sleep(FAULTS_FROM * run.args.duration)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as http:
        n = 0
        while time.monotonic() < run.stop_at:
            n += 1
            if n % 2:
                status = await asyncio.to_thread(_chunked_upload, base, key, run.args.oversize_mib)
                run.counts[f"oversize chunked {run.args.oversize_mib} MiB -> {status}"] += 1
            else:
                try:
                    response = await http.post("/v1/completions", content=b'{"prompt": "' + b"x" * 5_000_000 + b'"}')
                    status = str(response.status_code)
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                run.counts[f"oversize 5 MB with Content-Length -> {status}"] += 1
            if status != "413":
                run.failures.append(f"oversize body answered {status}")
            await asyncio.sleep(2.0)


def cool_down(base: str, key: str) -> tuple[dict[str, int], float | None]:
    """Memory once the engine is idle (`rss_now`, median of three samples 2 s apart), and the engine's running
    requests then."""
    running = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        text = httpx.get(f"{base}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith('specdec_engine_requests{state="running"}')]
        running = values[0] if values else None
        if running == 0:
            break
        time.sleep(1.0)  # polling a condition under a deadline
    samples = []
    for _ in range(3):
        samples.append(rss_now())
        time.sleep(2.0)
    return {k: int(statistics.median(s[k] for s in samples)) for k in samples[0]}, running
