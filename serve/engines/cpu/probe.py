"""The verify-cost curve: how long one target forward of N query tokens (a chain, N = 1..16) takes after a
128-token context, relative to N = 1. Measured at start-up because it is ISA-specific (reference: fp32 steps up ~2x
at N = 4 on AVX-512 machines; bf16 with AMX stays ~1.0-1.2x up to 16) and it decides which draft sizes can pay."""

from __future__ import annotations

import statistics
import time

import torch

from serve.engines.cpu.runner import ModelRunner, chain_visibility

__all__ = ["measure_verify_cost", "PROBE_SIZES", "STARTUP_PROBE_SIZES"]

PROBE_SIZES = tuple(range(1, 17))
# At engine start-up: the curve's shape at a third of the cost (~2 s instead of ~4.5 s for a 135M model on 2 cores),
# paid by every trial and re-run. benchmarks/cpu_engine.py measures every size.
STARTUP_PROBE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
CONTEXT_TOKENS = 128


def measure_verify_cost(runner: ModelRunner, budget_s: float, sizes: tuple[int, ...] = PROBE_SIZES,
                        min_rounds: int = 1) -> dict:
    """Rounds over `sizes` until `budget_s` is spent and at least `min_rounds` rounds ran. Returns {"sizes",
    "ms" (median per size), "relative" (ms / ms[N=1]), "rounds", "context_tokens", "seconds"}."""
    started = time.monotonic()
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(0, runner.vocab_size, (CONTEXT_TOKENS,), generator=gen).tolist()
    cache = runner.new_cache()
    runner.prefill(cache, context)
    samples: dict[int, list[float]] = {n: [] for n in sizes}

    def timed(n: int) -> float:
        tokens = torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist()
        t0 = time.perf_counter()
        hidden = runner.forward(cache, tokens, range(CONTEXT_TOKENS, CONTEXT_TOKENS + n),
                                chain_visibility(CONTEXT_TOKENS, n))
        runner.logits(hidden)  # the verifier computes logits for every real node
        elapsed = time.perf_counter() - t0
        runner.keep(cache, CONTEXT_TOKENS, [])
        return elapsed * 1000.0

    timed(1)  # warm-up: first-call allocations
    rounds = 0
    while rounds < max(1, min_rounds) or time.monotonic() - started < budget_s:
        for n in sizes:
            samples[n].append(timed(n))
        rounds += 1
    ms = {n: statistics.median(v) for n, v in samples.items()}
    unit = ms.get(1) or ms[sizes[0]]
    return {
        "sizes": list(sizes),
        "ms": [round(ms[n], 3) for n in sizes],
        "relative": [round(ms[n] / unit, 3) for n in sizes],
        "rounds": rounds,
        "context_tokens": CONTEXT_TOKENS,
        "seconds": round(time.monotonic() - started, 2),
    }
