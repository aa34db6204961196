"""Soak: the production endpoint (Ray Serve ingress + CPU engine replica) under many concurrent streaming clients.

Starts a local Ray, deploys the production app on a serving-config file (auth on, a fresh random key), then runs
`--clients` streaming chat clients (joining over `--ramp` seconds) back to back for `--duration` seconds (or
`--max-requests` in all), while a prober times `GET /health` every second (through the endpoint, and the engine's
own for comparison) and a sampler reads the RSS of the engine process and of this run's Serve actors every 2 s. Passes when every answer is a complete 200 stream or an explicit 429 with Retry-After, every
/health is 200 in under 1 s, and memory is bounded (the peak of the last third is within `--rss-slack` of the
peak of the first two thirds). Prints a table; exit 1 if a check fails.

    python benchmarks/soak.py                       # 64 clients, 90 s
    python benchmarks/soak.py --clients 8 --duration 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import secrets
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

PROMPTS = ["Write a haiku about the sea.", "List three colors.", "Say hello in French.",
           "What is 2 + 2? Answer briefly.", "Name a fruit that is yellow.", "Describe a cat in one sentence."]


async def client_loop(base: str, key: str, idx: int, stop_at: float, budget: list[int], max_tokens: int,
                      statuses: Counter, failures: list[str], tokens: list[int], delay_s: float = 0.0) -> None:
    await asyncio.sleep(delay_s)  # ramp-up: clients join one after another
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=600) as http:
        n = 0
        while time.monotonic() < stop_at and budget[0] > 0:
            budget[0] -= 1
            n += 1
            body = {"model": "m", "stream": True, "max_tokens": max_tokens, "temperature": 0,
                    "messages": [{"role": "user", "content": PROMPTS[(idx + n) % len(PROMPTS)]}]}
            try:
                async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                    if response.status_code == 429:
                        statuses["429"] += 1
                        if "retry-after" not in response.headers:
                            failures.append("429 without Retry-After")
                        await asyncio.sleep(float(response.headers.get("retry-after", "1")))
                        continue
                    if response.status_code != 200:
                        statuses[str(response.status_code)] += 1
                        failures.append(f"{response.status_code}: {(await response.aread())[:200]!r}")
                        continue
                    done, chunks = False, 0
                    async for line in response.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            done = True
                            break
                        event = json.loads(data)
                        if "error" in event:
                            failures.append(f"error event: {event['error']}")
                            break
                        chunks += 1
                    statuses["200" if done else "200-broken"] += 1
                    if done:
                        tokens.append(chunks)
                    else:
                        failures.append("stream ended without [DONE]")
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1
                failures.append(f"{type(exc).__name__}: {exc}")


async def health_prober(base: str, stop_at: float, latencies: list[float], bad: list[str],
                        slow: list[tuple[float, float]] | None = None) -> None:
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        while time.monotonic() < stop_at:
            t0 = time.monotonic()
            try:
                status = (await http.get("/health")).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            latencies.append(time.monotonic() - t0)
            if slow is not None and latencies[-1] >= 1.0:
                slow.append((t0 - started, latencies[-1]))
            if status != 200:
                bad.append(str(status))
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))


def _our_processes() -> dict[str, list[psutil.Process]]:
    """The engine and Serve actor processes of this run: descendants of this driver (its local Ray), never another
    run's on a shared machine."""
    groups: dict[str, list[psutil.Process]] = {"engine": [], "replicas": []}
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "serve.engines.cpu" in cmd and "--model-path" in cmd:
            groups["engine"].append(proc)
        elif "ServeReplica:" in cmd or "ProxyActor" in cmd or "ServeController" in cmd:
            groups["replicas"].append(proc)
    return groups


async def rss_sampler(stop_at: float, samples: list[tuple[float, dict[str, int]]]) -> None:
    start = time.monotonic()
    while time.monotonic() < stop_at:
        sample = {}
        for name, procs in _our_processes().items():
            total = 0
            for proc in procs:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    pass
            sample[name] = total
        samples.append((time.monotonic() - start, sample))
        await asyncio.sleep(2.0)


async def soak(base: str, key: str, args: argparse.Namespace) -> dict:
    stop_at = time.monotonic() + args.duration
    statuses: Counter = Counter()
    failures: list[str] = []
    tokens: list[int] = []
    health: list[float] = []
    health_bad: list[str] = []
    samples: list[tuple[float, dict[str, int]]] = []
    budget = [args.max_requests]
    slow: list[tuple[float, float]] = []
    direct: list[float] = []  # the engine's own /health, bypassing Serve: tells where a slow probe spent its time
    engine_url = _engine_url()
    started = time.monotonic()
    await asyncio.gather(
        *(client_loop(base, key, i, stop_at, budget, args.max_tokens, statuses, failures, tokens,
                      args.ramp * i / args.clients) for i in range(args.clients)),
        health_prober(base, stop_at, health, health_bad, slow), rss_sampler(stop_at, samples),
        *([health_prober(engine_url, stop_at, direct, [])] if engine_url else []))
    return {"wall_s": time.monotonic() - started, "statuses": statuses, "failures": failures, "tokens": tokens,
            "health": health, "health_bad": health_bad, "samples": samples, "slow": slow, "direct": direct}


def _engine_url() -> str | None:
    for proc in _our_processes()["engine"]:
        cmd = proc.cmdline()
        if "--port" in cmd:
            return f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}"
    return None


def report(result: dict, args: argparse.Namespace) -> bool:
    statuses, health, samples = result["statuses"], result["health"], result["samples"]
    ok_codes = {"200", "429"}
    print(f"\nsoak: {args.clients} streaming clients (ramp {args.ramp:g} s), {result['wall_s']:.0f} s, "
          f"max_tokens {args.max_tokens}, "
          f"{platform.machine()} {psutil.cpu_count()} CPUs, load average {psutil.getloadavg()[0]:.1f}")
    print("| measure | value |\n|---|---|")
    print(f"| requests answered | {sum(statuses.values())} |")
    for code, count in sorted(statuses.items()):
        print(f"| status {code} | {count} |")
    print(f"| streamed chunks (completed streams) | {sum(result['tokens'])} |")
    if health:
        ordered = sorted(health)
        bad = Counter(result["health_bad"])
        print(f"| /health probes | {len(health)} (non-200: {dict(bad) if bad else 0}) |")
        print(f"| /health p50 / p99 / max s | {statistics.median(ordered):.3f} / "
              f"{ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]:.3f} / {ordered[-1]:.3f} |")
    if result["direct"]:
        ordered = sorted(result["direct"])
        print(f"| engine's own /health (no Serve) p50 / max s | {statistics.median(ordered):.3f} / "
              f"{ordered[-1]:.3f} |")
    if result["slow"]:
        print(f"| /health probes >= 1 s (at s into the run: s) | "
              f"{', '.join(f'{t:.0f}: {d:.2f}' for t, d in result['slow'])} |")
    checks = {
        "only 200 or 429": set(statuses) <= ok_codes and not result["failures"],
        "/health always 200 under 1 s": bool(health) and not result["health_bad"] and max(health) < 1.0,
    }
    for name in ("engine", "replicas"):
        series = [s[name] for _, s in samples if s.get(name)]
        if not series:
            print(f"| RSS {name} | not found |")
            continue
        cut = max(1, 2 * len(series) // 3)
        early, late = max(series[:cut]), max(series[cut:] or series[-1:])
        print(f"| RSS {name} MiB first / peak first 2/3 / peak last 1/3 / last | {series[0] / 2**20:.0f} / "
              f"{early / 2**20:.0f} / {late / 2**20:.0f} / {series[-1] / 2**20:.0f} |")
        checks[f"RSS {name} bounded (+{args.rss_slack:.0%})"] = late <= early * (1 + args.rss_slack)
    for name, passed in checks.items():
        print(f"| check: {name} | {'PASS' if passed else 'FAIL'} |")
    for failure in result["failures"][:10]:
        print("  failure:", failure)
    return all(checks.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--duration", type=float, default=90.0, help="seconds of load (requests in flight finish)")
    parser.add_argument("--max-requests", type=int, default=2000, help="bound on requests started in all")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ramp", type=float, default=5.0,
                        help="seconds over which the clients join (0: all at once, a connection burst)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rss-slack", type=float, default=0.10, help="allowed growth of the late RSS peak")
    args = parser.parse_args()

    import ray
    from ray import serve

    from serve.production import ProductionSettings, deploy
    from serve.replica import free_port

    folder = Path(tempfile.mkdtemp(prefix="specdec-soak-"))
    config_file = folder / "serving.json"
    config_file.write_text(json.dumps({"engine": "cpu", "model": args.model, "dtype": "float32", "decision": "soak",
                                       "trial": {"spec": {"algorithm": "none"}, "max_running_requests": None}}))
    key = secrets.token_urlsafe(24)
    key_file = folder / "keys.txt"
    key_file.write_text(key + "\n")
    ray.init(address="local", include_dashboard=False, log_to_driver=False)  # never join a cluster found here
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        t0 = time.monotonic()
        deploy(ProductionSettings(config_file=str(config_file), port=port, api_key_file=str(key_file),
                                  threads=args.threads))
        print(f"deployed in {time.monotonic() - t0:.0f} s; soaking for {args.duration:.0f} s", flush=True)
        result = asyncio.run(soak(f"http://127.0.0.1:{port}", key, args))
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0 if report(result, args) else 1


if __name__ == "__main__":
    sys.exit(main())
