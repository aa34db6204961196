"""SGLang 0.5.23's own server on CPU vs our CPU engine, one invocation: same model (SmolLM2-135M), same prompts, same
threads, plain decode and NGRAM with a cold and a warm trie, rounds alternating.

Every engine is started once as a trial replica starts it (`EngineProcess`: SGLang through the adapter with
`engine.device: cpu` from its venv, bash infra/install-sglang-cpu.sh; our engine with its default `--weights auto`,
the resolved mode printed) and stays up; only one engine is sent requests at a time. Each round visits the engines
in an order that rotates from round to round. A plain engine measures the prompts once. An NGRAM engine is flushed
(`/flush_cache`: trie and counters), measures the prompts once ("cold": the trie holds only what these requests decode
themselves) and then the same prompts again ("warm": the trie holds the first pass's outputs). Prompts are sent one
at a time, streamed through `/generate` (the studies' load generator), greedy. Per engine, mode and round: e2e tok/s
(prefill in), decode tok/s (prefill out) and accept length as `benchmarks/streamed.py` defines them. Ratios are paired per round: our engine / SGLang in the same mode, median and range over rounds.

    python benchmarks/sglang_cpu_vs_cpu_engine.py --threads 2 --new-tokens 64 --prompts 4 --rounds 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.streamed import (  # noqa: E402
    add_common_args, machine, prompt_items, rotated, spread, start_engine, streamed_pass,
)
from serve.replica.deployment import EngineProcess  # noqa: E402
from serve.spec import NgramSpec  # noqa: E402

# Answers that repeat across requests (the templated-edit shape NGRAM's trie exploits), as in the bundled workloads.
PROMPTS = [
    "Rewrite this function with type hints:\ndef area(w, h):\n    return w * h\n",
    "Rewrite this function with type hints:\ndef volume(w, h, d):\n    return w * h * d\n",
    "List the days of the week, one per line, each followed by a comma:\n",
    "Write a Python dataclass Point with fields x and y, and a method norm() that returns the length.\n",
]
NGRAM = NgramSpec(num_draft_tokens=4, max_bfs_breadth=2, capacity=200_000)
ENGINES: dict[str, dict[str, Any]] = {
    "sglang": dict(engine="sglang", device="cpu"),
    "sglang-ngram": dict(engine="sglang", device="cpu", spec=NGRAM),
    "cpu-engine": dict(engine="cpu"),
    "cpu-engine-ngram": dict(engine="cpu", spec=NGRAM),
}
PAIRS = {"plain": ("cpu-engine", "sglang"), "ngram-cold": ("cpu-engine-ngram", "sglang-ngram"),
         "ngram-warm": ("cpu-engine-ngram", "sglang-ngram")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser, new_tokens=64)
    args = parser.parse_args()
    items = prompt_items(PROMPTS[: args.prompts], args.new_tokens)
    print(f"machine: {machine()}\nmodel smollm2-135m fp32, threads={args.threads} new_tokens={args.new_tokens} "
          f"prompts={len(items)} rounds={args.rounds} (alternating, rotated order), greedy, concurrency 1; "
          f"NGRAM draft {NGRAM.num_draft_tokens}, breadth {NGRAM.max_bfs_breadth}, BFS", flush=True)
    engines: dict[str, EngineProcess] = {}
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for name, fields in ENGINES.items():  # started one after another; idle engines use no CPU
            engines[name] = start_engine(name, {"dtype": "float32", **fields}, args.threads, items)
        names = list(ENGINES)
        for round_no in range(args.rounds):
            for name in rotated(names, round_no):
                url = engines[name].url
                if "spec" not in ENGINES[name]:
                    results.setdefault((name, "plain"), []).append(streamed_pass(url, items))
                    continue
                flushed = httpx.post(f"{url}/flush_cache", timeout=60)
                if flushed.status_code != 200:
                    raise RuntimeError(f"{name}: /flush_cache answered {flushed.status_code}: {flushed.text}")
                results.setdefault((name, "ngram-cold"), []).append(streamed_pass(url, items))
                results.setdefault((name, "ngram-warm"), []).append(streamed_pass(url, items))
            print(f"round {round_no + 1}: " + ", ".join(f"{n}/{m} {v[-1]['e2e']:.1f}" for (n, m), v in results.items()),
                  flush=True)
    finally:
        for engine in engines.values():
            engine.stop()
    print("\n| mode | engine | e2e tok/s (prefill in) | decode tok/s (prefill out) | accept length | "
          "e2e: ours / SGLang |")
    print("|---|---|---|---|---|---|")
    for mode, (ours, theirs) in PAIRS.items():
        for name in (theirs, ours):
            rows = results[(name, mode)]
            ratio = "-"
            if name == ours:
                ratio = spread([a["e2e"] / b["e2e"] for a, b in zip(rows, results[(theirs, mode)])], 2) + "x"
            print(f"| {mode} | {name} | {spread([r['e2e'] for r in rows])} | {spread([r['decode'] for r in rows])} "
                  f"| {spread([r['accept'] for r in rows], 2)} | {ratio} |")
    print("\nmedian (min-max) over rounds; ratios paired per round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
