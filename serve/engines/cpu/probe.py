"""The verify-cost curve: how long one target forward of N query tokens (a chain, N = 1..16) takes after a
128-token context, relative to N = 1. It is ISA-specific (reference: fp32 steps up ~2x at N = 4 on AVX-512 machines;
bf16 with AMX stays ~1.0-1.2x up to 16) and it decides which draft sizes can pay, so the engine reports it.

Measuring it costs ~1.5 s of every engine start, and every trial starts an engine; the curve depends only on the
model, the dtype, the thread count, the forward implementation and the machine. So `cached_verify_cost` measures it
once per such key and keeps it on disk under `cache_root()/probe/`; `refresh=True` (`--verify-probe-refresh`)
measures again and overwrites the entry (after a hardware change the key changes by itself)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from serve.engines.cpu.llama import FORWARD_VERSION
from serve.engines.cpu.models import cache_root
from serve.engines.cpu.runner import ModelRunner, chain_visibility

__all__ = ["measure_verify_cost", "cached_verify_cost", "probe_key", "PROBE_SIZES", "STARTUP_PROBE_SIZES"]

PROBE_SIZES = tuple(range(1, 17))
# At engine start-up: the curve's shape at a third of the cost (~2 s instead of ~4.5 s for a 135M model on 2 cores).
# benchmarks/cpu_engine.py measures every size.
STARTUP_PROBE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
CONTEXT_TOKENS = 128
PROBE_VERSION = 2  # bump when the measurement itself changes; the forward has its own version in the key


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


def probe_key(model_dir: Path, dtype: str, backend: str, sizes: tuple[int, ...],
              weights_mode: str = "fp32") -> dict:
    """What the curve depends on. The model is identified by its dir and its weight files' sizes and mtimes (a
    re-conversion changes them); the machine by its CPU model, flags and count, and the torch build; `weights_mode` is
    the runner's resolved weights mode with its kernel ISA ("fp32", "gguf-avx512", ...): the kernel changes the
    curve's shape."""
    weights = sorted(Path(model_dir).glob("*.safetensors"))
    return {
        "probe_version": PROBE_VERSION,
        "model_dir": str(Path(model_dir).resolve()),
        "weights": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in weights],
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "backend": backend,
        "weights_mode": weights_mode,
        "forward_version": FORWARD_VERSION,
        "sizes": list(sizes),
        "context_tokens": CONTEXT_TOKENS,
        "machine": _machine(),
        "torch": torch.__version__,
    }


def cached_verify_cost(runner: ModelRunner, model_dir: Path, dtype: str, budget_s: float,
                       sizes: tuple[int, ...] = STARTUP_PROBE_SIZES, refresh: bool = False) -> dict:
    """The curve for this (model, dtype, threads, forward, weights mode, machine): from the on-disk cache when present
    (and not `refresh`), else measured now and stored. The result carries `source` ("cache" or "measured") and
    `measured_at` (unix time of the measurement)."""
    choice = runner.weights
    key = probe_key(model_dir, dtype, runner.backend, sizes, choice.mode + (f"-{choice.isa}" if choice.isa else ""))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = cache_root() / "probe" / f"{digest}.json"
    if not refresh:
        stored = _read(path)
        if stored is not None and stored.get("key") == key:
            return {**stored["curve"], "source": "cache", "measured_at": stored["measured_at"]}
    curve = measure_verify_cost(runner, budget_s, sizes)
    entry = {"key": key, "curve": curve, "measured_at": round(time.time(), 3)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entry, indent=1) + "\n")
    os.replace(tmp, path)  # atomic: a concurrent engine reads the old entry or the new one, never half
    return {**curve, "source": "measured", "measured_at": entry["measured_at"]}


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # absent or unreadable: measure again
    return data if isinstance(data, dict) and "curve" in data and "measured_at" in data else None


def _machine() -> dict:
    model, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == (platform.processor() or platform.machine()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")) and not flags:
                flags = hashlib.sha256(line.split(":", 1)[1].strip().encode()).hexdigest()[:16]
    except OSError:
        pass
    return {"cpu": model, "cpu_flags": flags, "cpus": os.cpu_count(), "arch": platform.machine()}
