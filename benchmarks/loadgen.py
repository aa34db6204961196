"""Benchmark: the load generator (`pipeline/measure/load.py`) against a minimal streaming server, so we know its limits.

The server (a child process, raw asyncio HTTP/1.1, no framework) answers `POST /generate` with an SSE stream shaped
like the engines' (`output_ids`, `meta_info`), one token per event, after `--ttft-ms` and then every
`--interval-ms`, and records when it wrote each event. Two questions:

1. Capacity: with no delays, how many requests/s and streamed tokens/s does the load generator sustain on this
   machine at each concurrency? (The CPU engine streams ~5-30 tokens/s; the generator must be far above that.)
2. Timing error: with fixed delays, how far are the generator's TTFT and inter-token gaps from the server's own
   write times (matched per request and per event; the server and client share CLOCK_MONOTONIC)?

    python benchmarks/loadgen.py --quick     # ~1 minute
    python benchmarks/loadgen.py             # full
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pipeline.measure.load import LoadRequest, run_phase  # noqa: E402


# --- the minimal server (runs in its own process) ------------------------------------------------------------------

class _Server:
    def __init__(self, ttft_s: float, interval_s: float) -> None:
        self.ttft_s, self.interval_s = ttft_s, interval_s
        self.log: dict[str, dict] = {}  # prompt text -> {"received", "writes"}

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                received = time.monotonic()
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "POST" and path == "/generate":
                    await self._generate(json.loads(body), received, writer)
                else:
                    payload = json.dumps(self.log).encode() if path == "/stats" else b"{}"
                    if path == "/reset":
                        self.log.clear()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                                 + str(len(payload)).encode() + b"\r\n\r\n" + payload)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def _generate(self, request: dict, received: float, writer: asyncio.StreamWriter) -> None:
        n = int(request["sampling_params"]["max_new_tokens"])
        writes: list[float] = []
        self.log[request["text"]] = {"received": received, "writes": writes}
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        ids: list[int] = []
        for i in range(n):
            due = received + self.ttft_s + i * self.interval_s  # a fixed schedule: sleep overshoot does not add up
            if due > time.monotonic():
                await asyncio.sleep(due - time.monotonic())
            ids.append(i % 50000)
            meta = {"prompt_tokens": 8, "completion_tokens": i + 1,
                    "finish_reason": {"type": "length", "length": n} if i == n - 1 else None}
            event = b"data: " + json.dumps({"text": "x" * (i + 1), "output_ids": ids, "meta_info": meta}).encode() \
                + b"\n\n"
            writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            await writer.drain()
            writes.append(time.monotonic())
        done = b"data: [DONE]\n\n"
        writer.write(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")
        await writer.drain()


async def _serve(port: int, ttft_s: float, interval_s: float) -> None:
    server = await asyncio.start_server(_Server(ttft_s, interval_s).handle, "127.0.0.1", port, backlog=1024)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


# --- the benchmark -------------------------------------------------------------------------------------------------

def start_server(ttft_ms: float, interval_ms: float) -> tuple[subprocess.Popen, str]:
    from serve.ports import free_port

    port = free_port()
    process = subprocess.Popen([sys.executable, __file__, "--serve", str(port), str(ttft_ms), str(interval_ms)],
                               stdout=subprocess.PIPE, text=True)
    if process.stdout is None or process.stdout.readline().strip() != "ready":
        raise SystemExit("the minimal server did not start")
    return process, f"http://127.0.0.1:{port}"


def items(n: int, tokens: int, tag: str) -> list[LoadRequest]:
    return [LoadRequest(i, f"{tag}-{i}", tokens) for i in range(n)]


def capacity(concurrency: int, n: int, tokens: int) -> dict[str, float]:
    process, url = start_server(0, 0)
    try:
        run_phase(url, items(min(n, 50), tokens, "warm"), phase="warmup", concurrency=concurrency)
        start = time.monotonic()
        cpu0 = time.process_time()
        records = run_phase(url, items(n, tokens, "cap"), phase="measure", concurrency=concurrency)
        window, cpu = time.monotonic() - start, time.process_time() - cpu0
    finally:
        process.kill()
    errors = sum(1 for r in records if r.error)
    streamed = sum(r.completion_tokens for r in records)
    return {"req_s": len(records) / window, "tok_s": streamed / window, "client_cpu": cpu / window,
            "errors": errors}


def timing_error(concurrency: int, n: int, tokens: int, ttft_ms: float, interval_ms: float) -> dict[str, float]:
    process, url = start_server(ttft_ms, interval_ms)
    try:
        reqs = items(n, tokens, "time")
        records = run_phase(url, reqs, phase="measure", concurrency=concurrency)
        log = httpx.get(f"{url}/stats").json()
    finally:
        process.kill()
    ttft_err, gap_err = [], []
    for record in records:
        server = log[reqs[record.prompt_index].text]
        writes = server["writes"]
        # The client's clock starts before it sends; the server's when the request arrived: the TTFT error is the
        # client-side TTFT minus the server's received->first-write time (request send + transport + parse).
        if record.ttft_s is not None:
            ttft_err.append(record.ttft_s - (writes[0] - server["received"]))
        server_gaps = [b - a for a, b in zip(writes, writes[1:])]
        gap_err += [abs(c - s) for c, s in zip(record.itl_s, server_gaps)]
    gap_err.sort()
    ttft_err.sort()
    return {"ttft_err_p50_ms": 1000 * statistics.median(ttft_err),
            "ttft_err_p99_ms": 1000 * ttft_err[int(0.99 * (len(ttft_err) - 1))],
            "gap_err_p50_ms": 1000 * statistics.median(gap_err),
            "gap_err_p99_ms": 1000 * gap_err[int(0.99 * (len(gap_err) - 1))],
            "events_lost": sum(1 for r in records if len(r.itl_s) != r.completion_tokens - 1 or r.error)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":  # child process mode
        asyncio.run(_serve(int(sys.argv[2]), float(sys.argv[3]) / 1000, float(sys.argv[4]) / 1000))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--quick", action="store_true", help="fewer requests and concurrency levels (~1 minute)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens streamed per request")
    parser.add_argument("--ttft-ms", type=float, default=50.0, help="server delay before the first token (timing)")
    parser.add_argument("--interval-ms", type=float, default=20.0, help="server delay between tokens (timing)")
    args = parser.parse_args()
    levels = [1, 8, 32] if args.quick else [1, 4, 16, 64, 128]
    n = 200 if args.quick else 1000
    print(f"- command: `python benchmarks/loadgen.py{' --quick' if args.quick else ''}`\n"
          f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}; the server "
          f"is a separate process on the same machine\n- {n} requests x {args.tokens} tokens per concurrency level\n")
    print("#### Capacity (server with no delays)\n\n| concurrency | requests/s | streamed tokens/s | client CPU "
          "(cores) | errors |\n|---|---|---|---|---|")
    for c in levels:
        r = capacity(c, n, args.tokens)
        print(f"| {c} | {r['req_s']:.0f} | {r['tok_s']:.0f} | {r['client_cpu']:.2f} | {r['errors']} |", flush=True)
    print(f"\n#### Timing error (server: TTFT {args.ttft_ms:g} ms, then a token every {args.interval_ms:g} ms)\n\n"
          "| concurrency | TTFT error p50 ms | TTFT error p99 ms | gap error p50 ms | gap error p99 ms | "
          "requests with lost events |\n|---|---|---|---|---|---|")
    timing_n = 40 if args.quick else 200
    for c in levels:
        r = timing_error(c, max(timing_n, 2 * c), args.tokens, args.ttft_ms, args.interval_ms)
        print(f"| {c} | {r['ttft_err_p50_ms']:.2f} | {r['ttft_err_p99_ms']:.2f} | {r['gap_err_p50_ms']:.2f} | "
              f"{r['gap_err_p99_ms']:.2f} | {r['events_lost']} |", flush=True)
    print("\nload average at the end (1/5/15 min): " + " / ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
