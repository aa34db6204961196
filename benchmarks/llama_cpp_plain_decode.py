"""Plain decode, one run: our CPU engine (fp32) vs llama.cpp's llama-server (F32 and Q4_1), same SmolLM2-135M weights.

Each engine is started as a trial replica starts it (`EngineProcess`: the CPU engine; the llama.cpp shim in front of
llama-server), gets one warm-up request, then the same greedy prompts (`/generate`, not streamed) one at a time.
tok/s = completion tokens / end-to-end seconds summed over the prompts, per round; the median over rounds is printed.
Engines run one after another, never together. Needs llama-server (bash infra/install-llama-cpp.sh).

    python benchmarks/llama_cpp_plain_decode.py --threads 2 --new-tokens 128 --prompts 4 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve.engines.base import ReplicaConfig  # noqa: E402
from serve.replica import EngineProcess  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
    "Explain in plain words how a hash table works and when it is slow.",
    "List ten facts about the planet Mars, one per line:\n1.",
]
ENGINES = {
    "cpu-fp32": dict(engine="cpu", model="smollm2-135m", dtype="float32"),
    "llama-f32": dict(engine="llama_cpp", model="smollm2-135m@f32"),
    "llama-q4_1": dict(engine="llama_cpp", model="smollm2-135m"),
}


def measure(name: str, threads: int, new_tokens: int, prompts: list[str], rounds: int) -> list[float]:
    config = ReplicaConfig(**ENGINES[name], threads=threads, start_timeout_s=900,
                           log_dir=tempfile.mkdtemp(prefix=f"bench-{name}-"))
    engine = EngineProcess(config)
    try:
        engine.wait_ready()
        body = {"sampling_params": {"max_new_tokens": new_tokens, "temperature": 0}}
        httpx.post(f"{engine.url}/generate", json={**body, "text": prompts[0]}, timeout=900).raise_for_status()
        rates = []
        for _ in range(rounds):
            tokens, seconds = 0, 0.0
            for prompt in prompts:
                started = time.perf_counter()
                answer = httpx.post(f"{engine.url}/generate", json={**body, "text": prompt}, timeout=900)
                seconds += time.perf_counter() - started
                answer.raise_for_status()
                tokens += answer.json()["meta_info"]["completion_tokens"]
            rates.append(tokens / seconds)
        return rates
    finally:
        engine.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--quick", action="store_true", help="1 round, 2 prompts, 64 tokens")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.prompts, args.new_tokens = 1, 2, 64
    prompts = PROMPTS[: args.prompts]
    print(f"threads={args.threads} new_tokens={args.new_tokens} prompts={len(prompts)} rounds={args.rounds}")
    print("| engine | tok/s per round | median tok/s |\n|---|---|---|")
    for name in args.engines.split(","):
        rates = measure(name, args.threads, args.new_tokens, prompts, args.rounds)
        print(f"| {name} | {', '.join(f'{r:.1f}' for r in rates)} | {statistics.median(rates):.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
