"""Soak: the production endpoint (Ray Serve ingress + CPU engine replica) under concurrent streaming clients, and with
`--faults` under the faults it must survive: the engine SIGSTOPped for `--pause-s` then resumed, the engine
SIGKILLed (Serve replaces its replica), clients that leave mid-request, oversize bodies (chunked without a
Content-Length, and with one), and the closed loop's (`loop`): a canary at share 0.5 whose engine is SIGKILLed, then
a promotion as the loop makes it (a canary of the next version stopped, the alias moved, the endpoint rolling).

Starts the endpoint as an operator does, `python -m serve.production` (its own local Ray; auth on, fresh random user
and admin keys) on a registry (MLflow on SQLite: version 1 the baseline in production, 2 and 3 NGRAM configs for the
loop's faults) following its alias, with the capture on (every answer), and stops it at the end with Ctrl-C
(SIGINT to its process group). Meanwhile it runs
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
  gone after the driver stopped);
- with the loop's faults: no request fails while the canary's engine dies or while the endpoint rolls to the
  promoted version (no 503, no error event: production takes over the candidate's requests), and the capture holds
  one row per answered streaming request.

    python benchmarks/soak.py                                      # 64 clients, 90 s
    python benchmarks/soak.py --clients 16 --duration 150 --faults --max-requests 10000  # docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.soak_faults import (FAULTS_FROM, PROMPTS, REGISTERED, ROOT, alive, captured,  # noqa: E402
                                    cool_down, descendants, disconnecting_client, faults, loop_faults,
                                    our_processes, oversize_client, registry, rss_now, sse_outcome)

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
        self.strict_windows: list[list[float]] = []  # the loop's faults: nothing may fail in them
        self.loop_figures: dict[str, float] = {}
        self.loop_done = not (args.faults and "loop" in args.fault_kinds.split(","))
        self.registered_model, self.canary_version, self.promote_version = REGISTERED, "2", "3"

    def running(self) -> bool:
        """Clients go on until the duration has passed and the loop's faults are over (bounded)."""
        now = time.monotonic()
        return now < self.stop_at + 1800 and (now < self.stop_at or not self.loop_done)

    def now(self) -> float:
        return time.monotonic() - self.started

    def in_fault(self, t: float, margin: float = 3.0) -> bool:
        return any(start - margin <= t <= (end if end else float("inf")) + margin for start, end in self.windows)

    def in_strict(self, t: float) -> bool:
        return any(start <= t <= (end if end else float("inf")) for start, end in self.strict_windows)


async def client_loop(base: str, key: str, idx: int, run: Run) -> None:
    await asyncio.sleep(run.args.ramp * idx / run.args.clients)  # ramp-up: clients join one after another
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=600) as http:
        n = 0
        while run.running() and run.budget > 0:
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
                        if run.in_strict(run.now()):
                            run.failures.append(f"{status} during the canary's death or the promotion")
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
                        if not run.in_fault(run.now()) or run.in_strict(run.now()):
                            run.failures.append(f"error event outside an engine fault: {error}")
                    else:
                        run.statuses["200"] += 1
            except httpx.HTTPError as exc:
                run.statuses[type(exc).__name__] += 1
                run.failures.append(f"{type(exc).__name__}: {exc}")


async def health_prober(base: str, run: Run, into: list | None = None) -> None:
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        while run.running():
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
    while run.running():
        groups = our_processes()
        for procs in groups.values():
            for proc in procs:
                run.seen.setdefault(proc.pid, proc)
        run.samples.append((run.now(), rss_now()))
        await asyncio.sleep(2.0)


async def soak(base: str, key: str, admin: str, run: Run, promote: Any) -> None:
    engine_url = _engine_url()
    tasks = [client_loop(base, key, i, run) for i in range(run.args.clients)]
    tasks += [health_prober(base, run), rss_sampler(run)]
    if engine_url:
        tasks.append(health_prober(engine_url, run, run.direct))
    if run.args.faults:
        kinds = set(run.args.fault_kinds.split(","))

        async def engine_then_loop() -> None:
            await faults(base, run, pause="pause" in kinds, kill="kill" in kinds)
            if "loop" in kinds:
                try:
                    await loop_faults(base, admin, run, promote)
                except Exception as exc:  # noqa: BLE001 - reported as a failed check, the soak still ends
                    run.failures.append(f"the loop's faults: {type(exc).__name__}: {exc}")
                finally:
                    run.loop_done = True

        tasks.append(engine_then_loop())
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


def report(run: Run, end: dict[str, int] | None, running_at_end: float | None, leaked: list[str],
           captured_rows: int | None = None) -> bool:
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
                # after a promotion the engine is another config (an NGRAM trie): its memory is reported, not compared
                promoted = name == "engine" and "roll to the promoted version, s" in run.loop_figures
                if key != name and name != "replicas" and not promoted:
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
    for what, value in run.loop_figures.items():
        print(f"| {what} | {value:g} |")
    if run.strict_windows:
        spans = ", ".join(f"{a:.0f}-{b:.0f} s" for a, b in run.strict_windows)
        print(f"| the canary's death and the promotion (strict windows) | {spans} |")
        checks["the canary's death and the promotion: no request failed (production took over)"] = \
            run.loop_done and not run.failures
    if captured_rows is not None:
        print(f"| capture rows of the streaming clients / their requests answered 200 | {captured_rows} / "
              f"{statuses.get('200', 0)} |")
        checks["capture rows = answered requests"] = captured_rows == statuses.get("200", 0)
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
                        "bodies, a canary whose engine dies and a promotion")
    parser.add_argument("--fault-kinds", default="pause,kill,disconnect,oversize,loop",
                        help="with --faults: which (comma-separated subset of pause,kill,disconnect,oversize,loop)")
    parser.add_argument("--pause-s", type=float, default=7.0, help="SIGSTOP length (past the engine's 5 s keep-alive)")
    parser.add_argument("--disconnect-clients", type=int, default=2)
    parser.add_argument("--oversize-mib", type=int, default=64, help="size of each chunked oversize upload")
    args = parser.parse_args()

    from serve.engines.base import child_env
    from serve.ports import free_port

    folder = Path(tempfile.mkdtemp(prefix="specdec-soak-"))
    uri, promote = registry(folder, args)
    key, admin = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
    (folder / "keys.txt").write_text(key + "\n")
    (folder / "admin.txt").write_text(admin + "\n")
    capture = folder / "capture"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # The endpoint as an operator runs it: its own driver, its own local Ray, following the registry's alias, the
    # capture on (every answer), stopped by Ctrl-C (SIGINT) at the end.
    t0 = time.monotonic()
    with open(folder / "driver.log", "wb") as log:
        driver = subprocess.Popen([sys.executable, "-m", "serve.production", "--registered-model", REGISTERED,
                                   "--tracking-uri", uri, "--port", str(port), "--api-key-file",
                                   str(folder / "keys.txt"), "--admin-key-file", str(folder / "admin.txt"),
                                   "--threads", str(args.threads), "--follow-alias-s", "1", "--capture",
                                   json.dumps({"dir": str(capture), "sample_rate": 1, "flush_rows": 16,
                                               "flush_s": 5})],
                                  env=child_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
        asyncio.run(soak(base, key, admin, run, promote))
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
    return 0 if run is not None and report(run, end, running, leaked, captured(capture)) else 1


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())
