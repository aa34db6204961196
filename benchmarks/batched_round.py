"""What one scheduler round costs as the batch grows (in-process, no HTTP): C requests stepped together by
`Decoder.step_many` (one batched target forward), for plain decode and for a verify step of N chain tokens, against
the same C requests stepped one by one (what the engine did before it batched). Not a test: numbers depend on the
machine and on what else runs on it.

    python benchmarks/batched_round.py                       # C = 1 2 4 8, N = 1 (plain) and 4, 2 threads
    python benchmarks/batched_round.py --batch 1 8 16 --tokens 1 8 --threads 1

A "round" = every request gets one step of N query tokens after a 128-token prompt (the drafted tokens are the
request's own greedy continuation's stand-ins: the cost of a forward does not depend on their values, and the step's
cache columns are dropped afterwards so every round starts from the same cache length). Medians over --rounds
rounds; tokens/s = C x N / round time: what the engine could emit per second if every query token were accepted.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the engine does
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from serve.model_store import resolve_model  # noqa: E402
from serve.engines.cpu.runner import ModelRunner, chain_visibility  # noqa: E402

PREFIX = 128


def _round(runner: ModelRunner, caches: list, n: int, batched: bool) -> float:
    items = [(cache, [(17 * k + 3) % 1000 for k in range(n)], list(range(PREFIX, PREFIX + n)),
              chain_visibility(PREFIX, n)) for cache in caches]
    started = time.perf_counter()
    if batched:
        hiddens = runner.forward_many(items)
        runner.logits(torch.cat(hiddens))
    else:
        for item in items:
            runner.logits(runner.forward(*item))
    elapsed = time.perf_counter() - started
    for cache in caches:
        runner.keep(cache, PREFIX, [])  # back to the prompt: every round starts from the same cache length
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8], help="requests per round (C)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4], help="query tokens per request (N)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per cell (medians)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = ModelRunner.from_dir(resolve_model(args.model), "float32")
    print(f"# One round of C requests x N query tokens ({args.model}, fp32, {args.threads} threads)\n")
    print(f"- command: `python benchmarks/batched_round.py {' '.join(sys.argv[1:])}`".rstrip())
    print(f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"load average at the start {os.getloadavg()[0]:.2f}; medians over {args.rounds} rounds, alternating\n")
    print("| N | C | one by one ms | batched ms | batched / one by one | batched tok/s | batched ms / C=1 batched |")
    print("|---|---|---|---|---|---|---|")
    for n in args.tokens:
        single = None
        for c in args.batch:
            caches = []
            for _ in range(c):
                cache = runner.new_cache()
                runner.prefill(cache, [(31 * k + 7) % 1000 for k in range(PREFIX)])
                caches.append(cache)
            _round(runner, caches, n, True)  # warm
            alone, batched = [], []
            for _ in range(args.rounds):
                alone.append(_round(runner, caches, n, False))
                batched.append(_round(runner, caches, n, True))
            a, b = statistics.median(alone) * 1000, statistics.median(batched) * 1000
            single = single or b
            print(f"| {n} | {c} | {a:.1f} | {b:.1f} | {b / a:.2f} | {c * n / b * 1000:.1f} | {b / single:.2f} |",
                  flush=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
