"""SGLang 0.5.23's own server on CPU vs our CPU engine, one invocation: same model (SmolLM2-135M), same prompts, same
threads, plain decode and NGRAM with a cold and a warm trie, rounds alternating.

Every engine is started once as a trial replica starts it (`EngineProcess`: SGLang through the adapter with
`engine.device: cpu` from its venv, bash infra/install-sglang-cpu.sh; our engine with its default `--weights auto`,
the resolved mode printed) and stays up; only one engine is sent requests at a time. Each round visits the engines
in an order that rotates from round to round. A plain engine measures the prompts once. An NGRAM engine is flushed
(`/flush_cache`: trie and counters), measures the prompts once ("cold": the trie holds only what these requests decode
themselves) and then the same prompts again ("warm": the trie holds the first pass's outputs). Prompts are sent one
at a time, streamed through `/generate` (the studies' load generator), greedy. Per engine, mode and round:
- `e2e tok/s`    completion tokens / summed end-to-end seconds (prefill in: what a client sees);
- `decode tok/s` tokens after the first / summed (end-to-end - time to first token) (prefill out);
- `accept`       completion tokens / verify steps (SGLang's spec_accept_length, the prefill token included).
Ratios are paired per round: our engine / SGLang in the same mode, median and range over rounds.

    python benchmarks/sglang_cpu_vs_cpu_engine.py --threads 2 --new-tokens 64 --prompts 4 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.llama_cpp_plain_decode import machine, spread  # noqa: E402
from pipeline.measure.load import LoadRequest, run_phase  # noqa: E402
from serve.engines.base import ReplicaConfig  # noqa: E402
from serve.replica import EngineProcess  # noqa: E402
from serve.spec import NgramSpec  # noqa: E402

# Answers that repeat across requests (the templated-edit shape NGRAM's trie exploits), as in the bundled workloads.
PROMPTS = [
    "Rewrite this function with type hints:\ndef area(w, h):\n    return w * h\n",
    "Rewrite this function with type hints:\ndef volume(w, h, d):\n    return w * h * d\n",
    "List the days of the week, one per line, each followed by a comma:\n",
    "Write a Python dataclass Point with fields x and y, and a method norm() that returns the length.\n",
]
NGRAM = NgramSpec(num_draft_tokens=4, max_bfs_breadth=2, capacity=200_000)
ENGINES = {
    "sglang": dict(engine="sglang", device="cpu"),
    "sglang-ngram": dict(engine="sglang", device="cpu", spec=NGRAM),
    "cpu-engine": dict(engine="cpu"),
    "cpu-engine-ngram": dict(engine="cpu", spec=NGRAM),
}
PAIRS = {"plain": ("cpu-engine", "sglang"), "ngram-cold": ("cpu-engine-ngram", "sglang-ngram"),
         "ngram-warm": ("cpu-engine-ngram", "sglang-ngram")}


def measure(url: str, items: list[LoadRequest]) -> dict[str, float]:
    records = run_phase(url, items, phase="measure", concurrency=1, timeout_s=900)
    failed = [r.error for r in records if r.error]
    if failed:
        raise RuntimeError(f"{url}: {len(failed)} request(s) failed: {failed[0]}")
    tokens = sum(r.completion_tokens for r in records)
    decode_s = sum(r.e2e_s - (r.ttft_s or 0.0) for r in records)
    steps = sum(r.spec_verify_ct or 0 for r in records)
    return {"e2e": tokens / sum(r.e2e_s for r in records),
            "decode": sum(max(r.completion_tokens - 1, 0) for r in records) / decode_s if decode_s > 0 else 0.0,
            "accept": tokens / steps if steps else 1.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="every engine's threads (SGLang: OMP_NUM_THREADS)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    items = [LoadRequest(index=i, text=p, max_new_tokens=args.new_tokens) for i, p in enumerate(PROMPTS[: args.prompts])]
    print(f"machine: {machine()}\nmodel smollm2-135m fp32, threads={args.threads} new_tokens={args.new_tokens} "
          f"prompts={len(items)} rounds={args.rounds} (alternating, rotated order), greedy, concurrency 1; "
          f"NGRAM draft {NGRAM.num_draft_tokens}, breadth {NGRAM.max_bfs_breadth}, BFS", flush=True)
    engines: dict[str, EngineProcess] = {}
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    try:
        for name, fields in ENGINES.items():  # started one after another; idle engines use no CPU
            config = ReplicaConfig(model="smollm2-135m", dtype="float32", threads=args.threads, start_timeout_s=900,
                                   log_dir=tempfile.mkdtemp(prefix=f"bench-{name}-"), **fields)
            engines[name] = EngineProcess(config)
            engines[name].wait_ready()
            info = httpx.get(f"{engines[name].url}/server_info", timeout=30).json()
            print(f"{name}: started in {engines[name].startup_s:.1f} s; " + (
                f"weights_mode={info.get('weights_mode')} weights_isa={info.get('weights_isa')}"
                if fields["engine"] == "cpu" else f"attention_backend={info.get('attention_backend')} "
                f"dtype={info.get('dtype')} version={info.get('version')}"), flush=True)
            run_phase(engines[name].url, items[:1], phase="warmup", concurrency=1, timeout_s=900)
        names = list(ENGINES)
        for round_no in range(args.rounds):
            for name in names[round_no % len(names):] + names[: round_no % len(names)]:
                url = engines[name].url
                if "spec" not in ENGINES[name]:
                    results.setdefault((name, "plain"), []).append(measure(url, items))
                    continue
                flushed = httpx.post(f"{url}/flush_cache", timeout=60)
                if flushed.status_code != 200:
                    raise RuntimeError(f"{name}: /flush_cache answered {flushed.status_code}: {flushed.text}")
                results.setdefault((name, "ngram-cold"), []).append(measure(url, items))
                results.setdefault((name, "ngram-warm"), []).append(measure(url, items))
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
