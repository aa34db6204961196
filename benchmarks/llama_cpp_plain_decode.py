"""Plain decode side by side, one invocation: our CPU engine (GGUF kernel and fp32 weights) vs llama.cpp's
llama-server (Q4_1 and F32), same SmolLM2-135M weights, same prompts, same threads, rounds alternating.

Every engine is started once as a trial replica starts it (`EngineProcess`: the CPU engine with an explicit
`--weights`; the llama.cpp shim in front of llama-server) and stays up; only one engine is ever sent requests at a
time. Each round sends the same greedy prompts to every engine, one prompt at a time, streamed through `/generate`
(the load generator the studies use), in an order that rotates from round to round, so a slow phase of the machine
falls on every engine alike. Per engine and round: e2e tok/s (prefill in), decode tok/s (prefill out) and TTFT
as `benchmarks/streamed.py` defines them. Ratios are paired: per round, engine / reference engine, then the median and range over rounds. The resolved weights
mode of our engine (`/server_info` `weights_mode`, `weights_isa`) is printed, so a label cannot lie about what ran.
Needs llama-server (bash infra/install-llama-cpp.sh) for the llama engines.

    python benchmarks/llama_cpp_plain_decode.py --threads 2 --new-tokens 128 --prompts 4 --rounds 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.streamed import (  # noqa: E402
    add_common_args, machine, prompt_items, rotated, spread, start_engine, streamed_pass,
)
from serve.replica.deployment import EngineProcess  # noqa: E402

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
    "Explain in plain words how a hash table works and when it is slow.",
    "List ten facts about the planet Mars, one per line:\n1.",
]
ENGINES: dict[str, dict[str, Any]] = {
    "cpu-gguf": dict(engine="cpu", model="smollm2-135m", dtype="float32", weights="gguf"),
    "cpu-fp32": dict(engine="cpu", model="smollm2-135m", dtype="float32", weights="fp32"),
    "llama-q4_1": dict(engine="llama_cpp", model="smollm2-135m"),
    "llama-f32": dict(engine="llama_cpp", model="smollm2-135m@f32"),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser, new_tokens=128)
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    parser.add_argument("--reference", default="llama-q4_1", help="ratios are engine / this engine")
    args = parser.parse_args()
    names = args.engines.split(",")
    unknown = sorted(set(names + [args.reference]) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engine(s) {unknown}; choose from {sorted(ENGINES)}")
    items = prompt_items(PROMPTS[: args.prompts], args.new_tokens)
    print(f"machine: {machine()}\nthreads={args.threads} new_tokens={args.new_tokens} prompts={len(items)} "
          f"rounds={args.rounds} (alternating, rotated order), greedy, concurrency 1", flush=True)
    engines: dict[str, EngineProcess] = {}
    try:
        for name in names:  # started one after another; idle engines use no CPU
            engines[name] = start_engine(name, ENGINES[name], args.threads, items)
        results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for round_no in range(args.rounds):
            for name in rotated(names, round_no):
                results[name].append(streamed_pass(engines[name].url, items))
            print(f"round {round_no + 1}: " + ", ".join(f"{n} {results[n][-1]['e2e']:.1f}" for n in names),
                  flush=True)
    finally:
        for engine in engines.values():
            engine.stop()
    reference = results.get(args.reference)
    print(f"\n| engine | e2e tok/s (prefill in) | decode tok/s (prefill out) | TTFT ms | e2e vs {args.reference} |")
    print("|---|---|---|---|---|")
    for name in names:
        rows = results[name]
        ratio = (spread([r["e2e"] / ref["e2e"] for r, ref in zip(rows, reference)], 2) + "x") if reference else "-"
        print(f"| {name} | {spread([r['e2e'] for r in rows])} | {spread([r['decode'] for r in rows])} | "
              f"{spread([r['ttft_ms'] for r in rows], 0)} | {ratio} |")
    print("\nmedian (min-max) over rounds; ratios paired per round")
    return 0


if __name__ == "__main__":
    sys.exit(main())
