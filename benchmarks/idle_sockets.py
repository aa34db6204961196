"""Idle-socket soak of the production endpoint: one address attempts many sockets that each send half a request
header (`GET /health HTTP/1.1\\r\\n`) and nothing more, while real clients (an `openai` client and `/health`) keep
asking from another address. Loopback only: the idle sockets come from 127.0.0.2, the real clients from 127.0.0.1.

    python -m benchmarks.idle_sockets --sockets 20000 [--out runs/idle-sockets] [-- serve.production flags]

The sockets are opened by processes of 10,000 each (`--per-process`; each process has its own open-file limit, so
together they can outnumber the proxy's). It starts `python -m serve.production` (its own local Ray, the CPU engine
on one thread, a serving-config file) with its default connection limits (`--header-timeout-s`,
`--max-connections-per-client`, `--max-connections`; docs/security.md), attempts the sockets, holds what the
endpoint kept past its header timeout, and prints one Markdown table row: the attempts, how many connected, were
refused or closed by the header deadline, and the real clients' requests (answered / failed, slowest). Bounded:
every connect, request and wait has a deadline.
The socket helpers are shared with tests/end_to_end/test_idle_sockets.py.
"""

from __future__ import annotations

import argparse
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

HALF_HEADER = b"GET /health HTTP/1.1\r\n"
IDLE_FROM = "127.0.0.2"
REPO = Path(__file__).resolve().parents[1]


@dataclass
class IdleTally:
    attempted: int = 0
    connect_failed: int = 0
    refused: int = 0  # closed by the endpoint at once (503 or a reset): over a connection cap
    timed_out: int = 0  # closed with 408: the header deadline
    held_peak: int = 0
    open: list[socket.socket] = field(default_factory=list)


def idle_socket(port: int, source: str = IDLE_FROM, timeout_s: float = 5.0) -> socket.socket | None:
    """A socket to 127.0.0.1:`port` from `source` that sent half a header, or None when the connect failed."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((source, 0))
        sock.settimeout(timeout_s)
        sock.connect(("127.0.0.1", port))
        sock.sendall(HALF_HEADER)
    except OSError:
        sock.close()
        return None
    return sock


def sweep(tally: IdleTally) -> None:
    """Close and count the sockets the endpoint has closed (what it sent first says why)."""
    still = []
    poller = select.poll()  # not select(): descriptors past 1024 are the point here
    for sock in tally.open:
        poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    ready = {fd for fd, _ in poller.poll(0)}
    for sock in tally.open:
        if sock.fileno() not in ready:
            still.append(sock)
            continue
        try:
            data = sock.recv(4096)
        except OSError:
            data = b""
        if b" 408 " in data[:20]:
            tally.timed_out += 1
        else:
            tally.refused += 1
        sock.close()
    tally.open = still


def attempt(port: int, count: int, tally: IdleTally, spare_fds: int = 512) -> None:
    """Attempt `count` idle sockets, sweeping closed ones as it goes so this process keeps file descriptors."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    for index in range(count):
        if index % 200 == 0 or len(tally.open) > soft - spare_fds:
            sweep(tally)
        if len(tally.open) > soft - spare_fds:
            tally.connect_failed += 1  # this process's own limit: counted, not attempted
            tally.attempted += 1
            continue
        sock = idle_socket(port)
        tally.attempted += 1
        if sock is None:
            tally.connect_failed += 1
        else:
            tally.open.append(sock)
        tally.held_peak = max(tally.held_peak, len(tally.open))
    sweep(tally)


@dataclass
class ClientTally:
    ok: int = 0
    failed: int = 0
    slowest_s: float = 0.0
    errors: list[str] = field(default_factory=list)


def real_clients(base_url: str, stop: threading.Event, tally: ClientTally, deadline_s: float = 600.0) -> None:
    """`/health` and a completion from a real `openai` client, back to back until `stop` (bounded)."""
    import openai

    api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    end = time.monotonic() + deadline_s
    while not stop.is_set() and time.monotonic() < end:
        for call in (lambda: httpx.get(f"{base_url}/health", timeout=60).raise_for_status(),
                     lambda: api.completions.create(model="m", prompt="Hello", max_tokens=2, temperature=0)):
            started = time.monotonic()
            try:
                call()
                tally.ok += 1
            except Exception as exc:  # noqa: BLE001 - every failure is counted, whatever it is
                tally.failed += 1
                tally.errors.append(f"{type(exc).__name__}: {exc}"[:200])
            tally.slowest_s = max(tally.slowest_s, time.monotonic() - started)


def start_endpoint(folder: Path, port: int, extra: list[str], open_files: int | None = None) -> subprocess.Popen:
    """`python -m serve.production` on a serving-config file of the CPU engine (SmolLM2-135M, one thread)."""
    from serve.engines.base import ReplicaConfig, child_env
    from serve.serving import Provenance, ServingConfig

    config = ServingConfig(replica=ReplicaConfig(model="smollm2-135m", threads=1),
                           provenance=Provenance(study="idle", decision="keep_baseline", source="baseline",
                                                 workload="w", workload_digest="0123456789abcdef"))
    (folder / "serving.json").write_text(config.model_dump_json())
    env = {k: v for k, v in child_env().items() if k not in ("SPECDEC_API_KEYS", "RAY_ADDRESS")}

    def limit_files() -> None:  # Ray raises its soft limit to the hard one: both are set
        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    with open(folder / "driver.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "serve.production", "--config-file",
                                 str(folder / "serving.json"), "--port", str(port), "--threads", "1",
                                 "--follow-alias-s", "0", *extra], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=limit_files)


def wait_healthy(driver: subprocess.Popen, base_url: str, log: Path, deadline_s: float = 600.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if driver.poll() is not None:
            raise RuntimeError(f"the endpoint exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base_url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # polling a condition under a deadline
    raise RuntimeError(f"the endpoint not healthy within {deadline_s:.0f} s")


def stop_endpoint(driver: subprocess.Popen) -> None:
    if driver.poll() is None:
        os.killpg(driver.pid, signal.SIGINT)
        try:
            driver.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(timeout=30)


def hold_idle(port: int, count: int, hold_s: float, results: Any) -> None:
    """One idle-socket process (each has its own open-file limit, so several can outnumber the proxy's): attempt
    `count` sockets, hold what the endpoint keeps for `hold_s`, put the tally (without the sockets) on `results`."""
    idle = IdleTally()
    started = time.monotonic()
    attempt(port, count, idle)
    attempts_s = time.monotonic() - started
    end = time.monotonic() + hold_s
    while time.monotonic() < end:
        sweep(idle)
        time.sleep(0.5)  # holding the idle sockets for a bounded time
    still = len(idle.open)
    for sock in idle.open:
        sock.close()
    results.put((idle.attempted, idle.connect_failed, idle.refused, idle.timed_out, idle.held_peak, still,
                 attempts_s))


def main() -> int:
    import multiprocessing

    from serve.ports import free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sockets", type=int, default=20_000)
    parser.add_argument("--per-process", type=int, default=10_000, help="idle sockets per attempting process")
    parser.add_argument("--out", default="runs/idle-sockets")
    parser.add_argument("--hold-s", type=float, default=15.0, help="how long the idle sockets are held after the "
                        "attempts (past the endpoint's header timeout)")
    parser.add_argument("endpoint_flags", nargs="*", help="extra flags for python -m serve.production")
    args = parser.parse_args()
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    driver = start_endpoint(folder, port, args.endpoint_flags)
    clients, stop = ClientTally(), threading.Event()
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    shares = [min(args.per_process, args.sockets - start) for start in range(0, args.sockets, args.per_process)]
    tallies = []
    try:
        wait_healthy(driver, base_url, folder / "driver.log")
        holders = [context.Process(target=hold_idle, args=(port, share, args.hold_s, results)) for share in shares]
        for holder in holders:  # forked before this process runs any thread
            holder.start()
        worker = threading.Thread(target=real_clients, args=(base_url, stop, clients), daemon=True)
        worker.start()
        tallies = [results.get(timeout=1200) for _ in holders]  # every connect is bounded (5 s)
        for holder in holders:
            holder.join(timeout=60)
        stop.set()
        worker.join(timeout=120)
    finally:
        stop_endpoint(driver)
    attempted, failed, refused, timed_out, held, still = (sum(t[i] for t in tallies) for i in range(6))
    print("| idle sockets attempted | connected | held at most (client side) | refused (cap) | closed by header "
          "timeout | still open at the end | real-client requests ok / failed | slowest real request |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {attempted} in {max(t[6] for t in tallies):.0f} s ({len(tallies)} processes) | {attempted - failed} | "
          f"{held} | {refused} | {timed_out} | {still} | {clients.ok} / {clients.failed} | "
          f"{clients.slowest_s:.2f} s |")
    for error in clients.errors[:5]:
        print(f"real-client error: {error}")
    return 0 if clients.failed == 0 and clients.ok > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
