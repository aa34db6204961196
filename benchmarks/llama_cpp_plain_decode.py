"""Plain decode side by side, one invocation: our CPU engine (GGUF kernel and fp32 weights) vs llama.cpp's
llama-server (Q4_1 and F32), same SmolLM2-135M weights, same prompts, same threads, rounds alternating.

Every engine is started once as a trial replica starts it (`EngineProcess`: the CPU engine with an explicit
`--weights`; the llama.cpp shim in front of llama-server) and stays up; only one engine is ever sent requests at a
time. Each round sends the same greedy prompts to every engine, one prompt at a time, streamed through `/generate`
(the load generator the studies use), in an order that rotates from round to round, so a slow phase of the machine
falls on every engine alike. Per engine and round:
- `e2e tok/s`    completion tokens / summed end-to-end seconds (prefill in: what a client sees);
- `decode tok/s` tokens after the first / summed (end-to-end - time to first token) (prefill out);
- `ttft ms`      median time to the first token (the prefill).
Ratios are paired: per round, engine / reference engine, then the median and range over rounds. The resolved weights
mode of our engine (`/server_info` `weights_mode`, `weights_isa`) is printed, so a label cannot lie about what ran.
Needs llama-server (bash infra/install-llama-cpp.sh) for the llama engines.

    python benchmarks/llama_cpp_plain_decode.py --threads 2 --new-tokens 128 --prompts 4 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.measure.load import LoadRequest, run_phase  # noqa: E402
from serve.engines.base import ReplicaConfig  # noqa: E402
from serve.replica import EngineProcess  # noqa: E402

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


def machine() -> str:
    """CPU model and the ISA flags that pick kernels here (AVX-512, AVX2, AMX), from /proc/cpuinfo."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_tile", "avx2", "fma") if f in flags]
    return f"{model}; flags {' '.join(isa) or 'none of avx512f/avx2/amx'}"


def one_round(url: str, items: list[LoadRequest]) -> dict[str, float]:
    records = run_phase(url, items, phase="measure", concurrency=1, timeout_s=900)
    failed = [r.error for r in records if r.error]
    if failed:
        raise RuntimeError(f"{url}: {len(failed)} request(s) failed: {failed[0]}")
    tokens = sum(r.completion_tokens for r in records)
    e2e = sum(r.e2e_s for r in records)
    decode_tokens = sum(max(r.completion_tokens - 1, 0) for r in records)
    decode_s = sum(r.e2e_s - (r.ttft_s or 0.0) for r in records)
    return {"e2e": tokens / e2e, "decode": decode_tokens / decode_s if decode_s > 0 else 0.0,
            "ttft_ms": 1000 * statistics.median(r.ttft_s or 0.0 for r in records)}


def spread(values: list[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="every engine's threads (-t for llama-server)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    parser.add_argument("--reference", default="llama-q4_1", help="ratios are engine / this engine")
    args = parser.parse_args()
    names = args.engines.split(",")
    unknown = sorted(set(names + [args.reference]) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engine(s) {unknown}; choose from {sorted(ENGINES)}")
    items = [LoadRequest(index=i, text=p, max_new_tokens=args.new_tokens) for i, p in enumerate(PROMPTS[: args.prompts])]
    print(f"machine: {machine()}\nthreads={args.threads} new_tokens={args.new_tokens} prompts={len(items)} "
          f"rounds={args.rounds} (alternating, rotated order), greedy, concurrency 1", flush=True)
    engines: dict[str, EngineProcess] = {}
    try:
        for name in names:  # started one after another; idle engines use no CPU
            config = ReplicaConfig(**ENGINES[name], threads=args.threads, start_timeout_s=900,
                                   log_dir=tempfile.mkdtemp(prefix=f"bench-{name}-"))
            engines[name] = EngineProcess(config)
            engines[name].wait_ready()
            if ENGINES[name]["engine"] == "cpu":
                info = httpx.get(f"{engines[name].url}/server_info", timeout=30).json()
                print(f"{name}: weights_mode={info.get('weights_mode')} weights_isa={info.get('weights_isa')}",
                      flush=True)
            run_phase(engines[name].url, items[:1], phase="warmup", concurrency=1, timeout_s=900)
        results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for round_no in range(args.rounds):
            order = names[round_no % len(names):] + names[: round_no % len(names)]
            for name in order:
                results[name].append(one_round(engines[name].url, items))
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
