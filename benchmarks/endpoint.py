"""Benchmark: the production endpoint (Ray Serve ingress + engine replica) vs the same engine called directly.

Same machine, same run, same workload, same engine config: one engine process started directly, and the production
app (local Ray) serving a config file with the same settings. Requests alternate between the two targets round by
round, so drift of a noisy machine hits both alike. Reported per target: output tok/s (completion tokens over the
round's window) and p50 end-to-end latency, medians over rounds, and the endpoint/direct ratios.

    python benchmarks/endpoint.py --quick        # minutes
    python benchmarks/endpoint.py                # full
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.streamed import machine  # noqa: E402

PROMPTS = [f"def function_{i}(x):\n    \"\"\"Return x plus {i}.\"\"\"\n    return" for i in range(64)]


async def one_round(url: str, key: str | None, n: int, concurrency: int, max_tokens: int) -> tuple[float, float]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    latencies, tokens = [], 0
    queue = list(range(n))
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as client:
        start = time.monotonic()

        async def worker() -> None:
            nonlocal tokens
            while queue:
                i = queue.pop(0)
                t0 = time.monotonic()
                response = await client.post("/v1/completions", json={
                    "model": "m", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0})
                response.raise_for_status()
                latencies.append(time.monotonic() - t0)
                tokens += response.json()["usage"]["completion_tokens"]

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        window = time.monotonic() - start
    return tokens / window, statistics.median(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds of 8 requests x 24 tokens")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2,
                        help="engine threads, both targets (unset, a Serve replica's engine would inherit Ray's "
                             "OMP_NUM_THREADS=1 while the direct one took every core)")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 7)
    n, max_tokens = (8, 24) if args.quick else (24, 64)

    import ray
    from ray import serve

    from serve.engines.base import ReplicaConfig
    from serve.production.settings import ProductionSettings
    from serve.production.app import deploy
    from serve.ports import free_port
    from serve.replica.deployment import EngineProcess

    from serve.serving import Provenance, ServingConfig

    replica = ReplicaConfig(model=args.model, threads=args.threads)  # the same engine both ways
    serving = ServingConfig(replica=replica, provenance=Provenance(
        study="benchmark", decision="benchmark", source="baseline", workload="benchmark", workload_digest="-"))
    folder = Path(tempfile.mkdtemp(prefix="specdec-bench-"))
    config_file = folder / "serving.json"
    config_file.write_text(serving.model_dump_json())
    direct = EngineProcess(replica)
    ray.init(address="local", include_dashboard=False, log_to_driver=False)  # never join a cluster found here
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        direct.wait_ready()
        info = httpx.get(f"{direct.url}/server_info", timeout=30).json()
        weights = f"weights {info.get('weights_mode')} ({info.get('weights_isa') or 'no kernel'})"
        deploy(ProductionSettings(config_file=str(config_file), port=port))
        targets = {"direct": direct.url, "endpoint": f"http://127.0.0.1:{port}"}
        asyncio.run(one_round(targets["direct"], None, 2, 1, 4))  # warm both paths once
        asyncio.run(one_round(targets["endpoint"], None, 2, 1, 4))
        results: dict[str, list[tuple[float, float]]] = {"direct": [], "endpoint": []}
        for r in range(rounds):
            order = ["direct", "endpoint"] if r % 2 == 0 else ["endpoint", "direct"]
            for name in order:
                results[name].append(asyncio.run(one_round(targets[name], None, n, args.concurrency, max_tokens)))
    finally:
        direct.stop()
        serve.shutdown()
        ray.shutdown()
    med = {k: (statistics.median(t for t, _ in v), statistics.median(l for _, l in v)) for k, v in results.items()}
    print(f"machine: {machine()}; model {args.model}, {weights}, no speculation, {args.threads} threads; {rounds} "
          f"rounds x {n} requests x {max_tokens} tokens, concurrency {args.concurrency}, non-streamed "
          "/v1/completions, alternating")
    print("| target | tok/s (median) | p50 latency s (median) |\n|---|---|---|")
    for name, (tput, lat) in med.items():
        print(f"| {name} | {tput:.2f} | {lat:.3f} |")
    print(f"ratio endpoint/direct: throughput {med['endpoint'][0] / med['direct'][0]:.3f}, "
          f"p50 latency {med['endpoint'][1] / med['direct'][1]:.3f}")


if __name__ == "__main__":
    main()
