"""Soak: the production endpoint (Ray Serve ingress + CPU engine replica) under concurrent streaming clients, and with
`--faults` under the faults it must survive: the engine SIGSTOPped for `--pause-s` then resumed, the engine
SIGKILLed (Serve replaces its replica), clients that leave mid-request, and oversize bodies (chunked without a
Content-Length, and with one).

Starts the endpoint as an operator does, `python -m serve.production` on a serving-config file (its own local Ray;
auth on, a fresh random key), and stops it at the end with Ctrl-C (SIGINT to its process group). Meanwhile it runs
`--clients` streaming chat clients (joining over `--ramp` seconds) back to back for `--duration` seconds (or
`--max-requests` in all), while a prober sends `GET /health` every second (through the endpoint, and the engine's
own for comparison) and a sampler reads the memory (RSS and private) of the engine and of the Serve actors every 2 s.

Checks (exit 1 if one fails):
- no 500 and no cut connection: every answer is a 200 (a complete stream, or during a fault one that ends with an
  error event and `[DONE]`), a 429 or 503 with `Retry-After`, or a 413 for an oversize body;
- `/health` is 200 outside the fault windows (503/504 inside them), and under 1 s without faults;
- without faults: memory bounded (the peak of the last third within `--rss-slack` of the first two thirds);
- with faults: memory back to its start level (ingress replica, proxy and engine private memory, USS, after a
  cool-down within `--rss-slack` of their level in the first 15% of the run, before any fault; RSS is reported too,
  and also counts the pages of Ray's shared object store that request bodies pass through, which stay mapped), the engine idle at the end (the clients that left cost it
  nothing), and no leaked process (every process of the endpoint seen, Ray's, Serve's, engines and watchdogs, is
  gone after the driver stopped).

    python benchmarks/soak.py                                      # 64 clients, 90 s
    python benchmarks/soak.py --clients 16 --duration 150 --faults  # the fault soak of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.soak_faults import (FAULTS_FROM, PROMPTS, ROOT, alive, cool_down, descendants,  # noqa: E402
                                    disconnecting_client, faults, our_processes, oversize_client, rss_now,
                                    sse_outcome)

ALLOWED = {"200", "200-error-event", "429", "503", "413"}


class Run:
    """What the run saw, shared by its tasks."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.stop_at = self.started + args.duration
        self.budget = args.max_requests
        self.statuses: Counter = Counter()
        self.failures: list[str] = []
        self.chunks = 0
        self.health: list[tuple[float, str, float]] = []  # (t, status, latency)
        self.direct: list[float] = []
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.windows: list[list[float]] = []  # [start, end] of each fault, seconds into the run
        self.events: list[str] = []
        self.counts: Counter = Counter()  # disconnects, oversize answers
        self.seen: dict[int, psutil.Process] = {}  # every engine/watchdog/replica process of the run

    def now(self) -> float:
        return time.monotonic() - self.started

    def in_fault(self, t: float, margin: float = 3.0) -> bool:
        return any(start - margin <= t <= (end if end else float("inf")) + margin for start, end in self.windows)


async def client_loop(base: str, key: str, idx: int, run: Run) -> None:
    await asyncio.sleep(run.args.ramp * idx / run.args.clients)  # ramp-up: clients join one after another
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=600) as http:
        n = 0
        while time.monotonic() < run.stop_at and run.budget > 0:
            run.budget -= 1
            n += 1
            body = {"model": "m", "stream": True, "max_tokens": run.args.max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": PROMPTS[(idx + n) % len(PROMPTS)]}]}
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    status = str(response.status_code)
                    if status in ("429", "503"):
                        run.statuses[status] += 1
                        if "retry-after" not in response.headers:
                            run.failures.append(f"{status} without Retry-After")
                        await asyncio.sleep(float(response.headers.get("retry-after", "1")))
                        continue
                    if status != "200":
                        run.statuses[status] += 1
                        run.failures.append(f"{status}: {(await response.aread())[:200]!r}")
                        continue
                    done, error, chunks = sse_outcome([line async for line in response.aiter_lines()])
                    run.chunks += chunks
                    if not done:
                        run.statuses["200-cut"] += 1
                        run.failures.append("stream ended without [DONE]")
                    elif error is not None:
                        run.statuses["200-error-event"] += 1
                        if not run.in_fault(run.now()):
                            run.failures.append(f"error event outside a fault: {error}")
                    else:
                        run.statuses["200"] += 1
            except httpx.HTTPError as exc:
                run.statuses[type(exc).__name__] += 1
                run.failures.append(f"{type(exc).__name__}: {exc}")


async def health_prober(base: str, run: Run, into: list | None = None) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        while time.monotonic() < run.stop_at:
            t0 = time.monotonic()
            try:
                status = str((await http.get("/health")).status_code)
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            latency = time.monotonic() - t0
            if into is None:
                run.health.append((t0 - run.started, status, latency))
            elif status == "200":
                into.append(latency)
            await asyncio.sleep(max(0.0, 1.0 - latency))


async def rss_sampler(run: Run) -> None:
    while time.monotonic() < run.stop_at:
        groups = our_processes()
        for procs in groups.values():
            for proc in procs:
                run.seen.setdefault(proc.pid, proc)
        run.samples.append((run.now(), rss_now()))
        await asyncio.sleep(2.0)


async def soak(base: str, key: str, run: Run) -> None:
    engine_url = _engine_url()
    tasks = [client_loop(base, key, i, run) for i in range(run.args.clients)]
    tasks += [health_prober(base, run), rss_sampler(run)]
    if engine_url:
        tasks.append(health_prober(engine_url, run, run.direct))
    if run.args.faults:
        kinds = set(run.args.fault_kinds.split(","))
        tasks.append(faults(base, run, pause="pause" in kinds, kill="kill" in kinds))
        if "oversize" in kinds:
            tasks.append(oversize_client(base, key, run))
        if "disconnect" in kinds:
            tasks += [disconnecting_client(base, key, i, run) for i in range(run.args.disconnect_clients)]
    await asyncio.gather(*tasks)


def _engine_url() -> str | None:
    for proc in our_processes()["engine"]:
        cmd = proc.cmdline()
        if "--port" in cmd:
            return f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    return None


def machine() -> str:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine(), platform.processor()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = ", ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags) or "no AVX2"
    return f"{model} ({isa}), {psutil.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB"


def report(run: Run, end: dict[str, int] | None, running_at_end: float | None, leaked: list[str]) -> bool:
    args, statuses = run.args, run.statuses
    print(f"\nsoak: {' '.join(sys.argv)}\nmachine: {machine()}; load average at the end "
          f"{psutil.getloadavg()[0]:.1f}")
    print(f"{args.clients} streaming clients (ramp {args.ramp:g} s), {run.now():.0f} s, max_tokens {args.max_tokens}"
          + (f", faults: {args.fault_kinds} (pause {args.pause_s:g} s, {args.disconnect_clients} disconnecting "
             f"clients, chunked uploads of {args.oversize_mib} MiB)" if args.faults else ""))
    for event in run.events:
        print(f"  {event}")
    print("| measure | value |\n|---|---|")
    print(f"| streaming requests answered | {sum(statuses.values())} |")
    for code, count in sorted(statuses.items()):
        print(f"| status {code} | {count} |")
    print(f"| streamed chunks | {run.chunks} |")
    for what, count in sorted(run.counts.items()):
        print(f"| {what} | {count} |")
    health = [latency for _, _, latency in run.health]
    by_status = Counter(status for _, status, _ in run.health)
    outside = [(t, s) for t, s, _ in run.health if s != "200" and not run.in_fault(t)]
    if health:
        ordered = sorted(health)
        print(f"| /health probes by status | {dict(sorted(by_status.items()))} |")
        print(f"| /health p50 / max s | {statistics.median(ordered):.3f} / {ordered[-1]:.3f} |")
    if run.direct:
        print(f"| engine's own /health (no Serve) p50 / max s | {statistics.median(run.direct):.3f} / "
              f"{max(run.direct):.3f} |")
    checks = {"no 500, no cut connection (200, 429/503 + Retry-After, 413)": set(statuses) <= ALLOWED
              and not run.failures,
              "/health 200 outside the fault windows": bool(health) and not outside
              and set(by_status) <= {"200", "503", "504"}}
    if not args.faults:
        checks["/health under 1 s"] = bool(health) and max(health) < 1.0
    for name in ("engine", "ingress", "proxy", "replicas"):
        for key in (name, f"{name} private"):
            series = [s[key] for _, s in run.samples if s.get(key)]
            if not series:
                continue
            what = f"{name} {'private (USS)' if key != name else 'RSS'}"
            if args.faults and end is not None:
                before = [s[key] for t, s in run.samples if s.get(key) and t < FAULTS_FROM * args.duration]
                start = max(before[-3:]) if before else series[0]
                print(f"| {what} MiB: before the faults / peak / after a cool-down | {start / 2**20:.0f} / "
                      f"{max(series) / 2**20:.0f} / {end[key] / 2**20:.0f} |")
                if key != name and name != "replicas":
                    checks[f"{what} back to its start level (+{args.rss_slack:.0%})"] = \
                        end[key] <= start * (1 + args.rss_slack)
            elif key == name:
                cut = max(1, 2 * len(series) // 3)
                early, late = max(series[:cut]), max(series[cut:] or series[-1:])
                print(f"| {what} MiB first / peak first 2/3 / peak last 1/3 / last | {series[0] / 2**20:.0f} / "
                      f"{early / 2**20:.0f} / {late / 2**20:.0f} / {series[-1] / 2**20:.0f} |")
                checks[f"{what} bounded (+{args.rss_slack:.0%})"] = late <= early * (1 + args.rss_slack)
    if args.faults:
        print(f"| engine requests running after the cool-down | {running_at_end} |")
        checks["engine idle at the end (left clients cost nothing)"] = running_at_end == 0
        print(f"| processes of the endpoint seen (Ray, Serve, engines, watchdogs) / left after Ctrl-C | {len(run.seen)} / "
              f"{len(leaked)} |")
        checks["no leaked process"] = not leaked
    if args.faults:
        step = max(1, len(run.samples) // 10)
        for key in ("ingress private", "proxy private"):
            print(f"| {key} MiB, every {2 * step} s | "
                  f"{' '.join(f'{s[key] / 2**20:.0f}' for _, s in run.samples[::step] if s.get(key))} |")
    for name, passed in checks.items():
        print(f"| check: {name} | {'PASS' if passed else 'FAIL'} |")
    for failure in run.failures[:10]:
        print("  failure:", failure)
    for t, status in outside[:10]:
        print(f"  /health {status} at {t:.0f} s, outside the fault windows")
    for what in leaked[:10]:
        print("  leaked:", what)
    return all(checks.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of load (requests in flight finish)")
    parser.add_argument("--max-requests", type=int, default=2000, help="bound on streaming requests started in all")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ramp", type=float, default=5.0,
                        help="seconds over which the clients join (0: all at once, a connection burst)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rss-slack", type=float, default=0.10, help="allowed growth of RSS (see the checks)")
    parser.add_argument("--faults", action="store_true", help="pause and kill the engine, leaving clients, oversize "
                        "bodies")
    parser.add_argument("--fault-kinds", default="pause,kill,disconnect,oversize",
                        help="with --faults: which (comma-separated subset of pause,kill,disconnect,oversize)")
    parser.add_argument("--pause-s", type=float, default=7.0, help="SIGSTOP length (past the engine's 5 s keep-alive)")
    parser.add_argument("--disconnect-clients", type=int, default=2)
    parser.add_argument("--oversize-mib", type=int, default=64, help="size of each chunked oversize upload")
    args = parser.parse_args()

    from serve.engines.base import ReplicaConfig, child_env
    from serve.ports import free_port
    from serve.serving import Provenance, ServingConfig

    folder = Path(tempfile.mkdtemp(prefix="specdec-soak-"))
    config_file = folder / "serving.json"
    config = ServingConfig(replica=ReplicaConfig(model=args.model, threads=args.threads),
                           provenance=Provenance(study="soak", decision="keep_baseline", source="baseline",
                                                 workload="soak", workload_digest="0" * 16))
    config_file.write_text(config.model_dump_json())
    key = secrets.token_urlsafe(24)
    key_file = folder / "keys.txt"
    key_file.write_text(key + "\n")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # The endpoint as an operator runs it: its own driver, its own local Ray, stopped by Ctrl-C (SIGINT) at the end.
    t0 = time.monotonic()
    with open(folder / "driver.log", "wb") as log:
        driver = subprocess.Popen([sys.executable, "-m", "serve.production", "--config-file", str(config_file),
                                   "--port", str(port), "--api-key-file", str(key_file), "--threads",
                                   str(args.threads), "--follow-alias-s", "0"], env=child_env(), stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    ROOT.append(driver.pid)
    run: Run | None = None
    end, running = None, None
    everything: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 900
        while not _healthy(base):
            if driver.poll() is not None or time.monotonic() > deadline:
                print((folder / "driver.log").read_text()[-3000:])
                return 1
            time.sleep(0.5)  # polling a condition under a deadline
        print(f"endpoint up in {time.monotonic() - t0:.0f} s (driver log: {folder / 'driver.log'}); soaking for "
              f"{args.duration:.0f} s", flush=True)
        run = Run(args)
        asyncio.run(soak(base, key, run))
        if args.faults:
            end, running = cool_down(base, key)
    finally:
        everything = descendants()
        if run is not None:
            for proc in everything:
                run.seen.setdefault(proc.pid, proc)
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGINT)  # Ctrl-C in the driver's terminal
            try:
                driver.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(driver.pid, signal.SIGKILL)
    leaked: list[str] = []
    deadline = time.monotonic() + 60
    while run is not None and time.monotonic() < deadline:
        leaked = [f"pid {p.pid} {p.name()}" for p in run.seen.values() if alive(p)]
        if not leaked:
            break
        time.sleep(0.5)  # polling a condition under a deadline
    for proc in everything:
        if alive(proc):
            proc.kill()  # never leave a leaked process behind on the machine, reported or not
    return 0 if run is not None and report(run, end, running, leaked) else 1


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())
