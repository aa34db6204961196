"""The verify-cost curve: how long one target forward of N query tokens (a chain, N = 1..16) takes after a
128-token context, relative to N = 1; and the round table: one scheduler round of b requests x N queries each in one
batched forward, the LM head per row count, and one step at a longer context (`measure_round_cost`, what the
pipeline's step-cost model reads). It is ISA-specific (reference: fp32 steps up ~2x at N = 4 on AVX-512 machines;
bf16 with AMX stays ~1.0-1.2x up to 16) and it decides which draft sizes can pay, so the engine reports it.

Measuring it costs ~1.5 s (the curve) + ~9 s (the round table, SmolLM2-135M on 2 cores) of an engine start, and every
trial starts an engine; both depend only on the model, the dtype, the thread count, the forward implementation and
the machine. So `cached_verify_cost` measures it
once per such key and keeps it on disk under `cache_root()/probe/`; `refresh=True` (`--verify-probe-refresh`)
measures again and overwrites the entry (after a hardware change the key changes by itself).

A table measured while other work held the CPU would mislead every later study on the machine, so a measurement
checks itself (`serve.replica.usage`: this process group's run-queue wait over the probe, the node's steal) and is
taken again, at most `PROBE_ATTEMPTS` times in all; the least disturbed one is kept only until a later engine start
measures a quieter one, and at most `PROBE_LATER_ATTEMPTS` later starts try (on a machine that is always busy, every
start would otherwise pay ~10 s for a table no quieter than the one it has); after them, one start an hour
(`PROBE_RETRY_S`) tries again, so a table measured during a busy spell (a CI run, say) is not kept for good. A cached
entry is checked before use (`table_problem`: it must carry a clean disturbance check and read as monotone, more rows
never much cheaper than fewer) and measured again when it fails. A dip that two measurements show alike is the
engine's own (fp32 GEMM on 3 rows can be slower than on 4: Qwen2.5-Coder-1.5B's 1 x 3 and 1 x 4 rounds, 943.6 and
733.6 ms, then 918.5 and 702.0 ms): that table is kept `as_measured` (and, measured under load, kept like any
disturbed table) rather than measured again at every start."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from serve.engines.cpu.llama import FORWARD_VERSION
from serve.model_store import cache_root
from serve.engines.cpu.runner import ModelRunner, chain_visibility
from serve.engines.round_table import first_dip, reproduces
from serve.replica.usage import Usage, read_usage

log = logging.getLogger("serve.engines.cpu")

__all__ = ["measure_verify_cost", "measure_round_cost", "measure_prefill_cost", "cached_verify_cost",
           "cached_draft_cost", "disturbance_problem", "probe_disturbance", "probe_key", "shape_problem",
           "table_problem", "PROBE_SIZES", "STARTUP_PROBE_SIZES", "ROUND_BATCHES"]

PROBE_SIZES = tuple(range(1, 17))
# At engine start-up: the curve's shape at a third of the cost (~2 s instead of ~4.5 s for a 135M model on 2 cores).
# benchmarks/cpu_engine.py measures every size.
STARTUP_PROBE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
CONTEXT_TOKENS = 128
PROBE_VERSION = 3  # bump when the measurement itself changes; the forward has its own version in the key
# The round table (`measure_round_cost`): requests per round and passes. Rows past the GGUF kernel's limit (24) run
# on fp32, a step in the curve the table shows.
ROUND_BATCHES = (1, 2, 4)  # larger batches: extrapolated linearly in rows by the cost model
ROUND_PASSES = 3
LM_HEAD_ROWS = (1, 2, 4, 8, 16, 32, 64)
LONG_CONTEXT_TOKENS = 512
PROBE_ATTEMPTS = 2
PROBE_LATER_ATTEMPTS = 3  # later engine starts that measure a disturbed cached table once more, before it is used as is
PROBE_RETRY_S = 3600.0  # after those, a start measures a still-disturbed table once more at most this often
PROBE_WAIT_LIMIT = 0.15  # the share of the probe's runnable time spent waiting for a core above which it is disturbed
PROBE_STEAL_LIMIT = 0.05
# A STANDALONE draft's first step prefills the request's prompt (plus its first token): the draft's cost curve also
# times prefills of these lengths (`measure_prefill_cost`). Bump DRAFT_PROBE_VERSION when the draft's curve changes.
DRAFT_PREFILL_TOKENS = (64, 256)
DRAFT_PROBE_VERSION = 2


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


def measure_round_cost(runner: ModelRunner, widths: tuple[int, ...], batches: tuple[int, ...] = ROUND_BATCHES,
                       passes: int = ROUND_PASSES) -> dict:
    """One scheduler round's verify forward over `batches` x `widths`: b requests, each with its own cache of
    CONTEXT_TOKENS tokens, each querying `w` chain tokens, in one `forward_many` (every weight read once, as
    `Decoder.step_many` runs a round), plus the logits of the b roots; the LM head separately for `LM_HEAD_ROWS` rows
    (a round computes the logits of every root and real draft node in one matmul); and one request at
    LONG_CONTEXT_TOKENS (how the cost grows with the context). The fastest of `passes` (another process on the
    machine only ever adds time); milliseconds. The pipeline's step-cost model (pipeline/simulate/cost.py) reads it
    from `/server_info`'s `verify_cost`."""
    started = time.monotonic()
    gen = torch.Generator().manual_seed(1)
    batches = batches if runner.batches else (1,)  # on HF modules a round is one forward per request
    caches = []
    for _ in range(max(batches)):
        cache = runner.new_cache()
        runner.prefill(cache, torch.randint(0, runner.vocab_size, (CONTEXT_TOKENS,), generator=gen).tolist())
        caches.append(cache)

    def timed(b: int, w: int) -> float:
        items = [(cache, torch.randint(0, runner.vocab_size, (w,), generator=gen).tolist(),
                  range(CONTEXT_TOKENS, CONTEXT_TOKENS + w), chain_visibility(CONTEXT_TOKENS, w))
                 for cache in caches[:b]]
        t0 = time.perf_counter()
        hiddens = runner.forward_many(items)
        runner.logits(torch.cat([h[:1] for h in hiddens]))
        elapsed = time.perf_counter() - t0
        for cache in caches[:b]:
            runner.keep(cache, CONTEXT_TOKENS, [])
        return elapsed * 1000.0

    hidden = runner.forward(caches[0], [0], [CONTEXT_TOKENS], chain_visibility(CONTEXT_TOKENS, 1))
    runner.keep(caches[0], CONTEXT_TOKENS, [])

    def head(rows: int) -> float:
        t0 = time.perf_counter()
        runner.logits(hidden.expand(rows, -1).contiguous())
        return (time.perf_counter() - t0) * 1000.0

    long_cache = runner.new_cache()
    runner.prefill(long_cache, torch.randint(0, runner.vocab_size, (LONG_CONTEXT_TOKENS,), generator=gen).tolist())

    def long_step() -> float:
        t0 = time.perf_counter()
        out = runner.forward(long_cache, [0], [LONG_CONTEXT_TOKENS], chain_visibility(LONG_CONTEXT_TOKENS, 1))
        runner.logits(out)
        elapsed = time.perf_counter() - t0
        runner.keep(long_cache, LONG_CONTEXT_TOKENS, [])
        return elapsed * 1000.0

    timed(1, 1)  # warm-up
    cells: dict[tuple[int, int], list[float]] = {(b, w): [] for b in batches for w in widths}
    heads: dict[int, list[float]] = {r: [] for r in LM_HEAD_ROWS}
    longs: list[float] = []
    shorts: list[float] = []
    for _ in range(max(1, passes)):
        for b, w in cells:
            cells[b, w].append(timed(b, w))
        for rows in heads:
            heads[rows].append(head(rows))
        longs.append(long_step())
        shorts.append(timed(1, 1))
    return {
        "batches": list(batches),
        "widths": list(widths),
        "ms": [[round(min(cells[b, w]), 3) for w in widths] for b in batches],
        "lm_head_rows": list(LM_HEAD_ROWS),
        "lm_head_ms": [round(min(heads[r]), 3) for r in LM_HEAD_ROWS],
        "context_tokens": CONTEXT_TOKENS,
        "long_context_tokens": LONG_CONTEXT_TOKENS,
        "long_context_ms": round(min(longs), 3),
        "short_context_ms": round(min(shorts), 3),
        "passes": max(1, passes),
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
    and clean (and not `refresh`), else measured now. The result carries `source` ("cache" or "measured"),
    `measured_at` (unix time of the measurement) and, when it was measured while other work held the CPU,
    `disturbed` (why).

    A table measured under load is kept only until a quieter one: while the cached entry is disturbed, the next
    `PROBE_LATER_ATTEMPTS` starts measure once more each and keep the less disturbed table; after them it is used as
    it is (still reported `disturbed`), and measured once more by the first start `PROBE_RETRY_S` after the last
    attempt (or at `refresh`). A cached entry without a check, or out of order, is refused outright."""
    choice = runner.weights
    key = probe_key(model_dir, dtype, runner.backend, sizes, choice.mode + (f"-{choice.isa}" if choice.isa else ""))
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = cache_root() / "probe" / f"{digest}.json"
    refused, best, best_at, later = None, None, None, None
    if not refresh:
        stored = _read(path)
        if stored is not None and stored.get("key") == key:
            refused = shape_problem(stored["curve"])
            if refused is None and disturbance_problem(stored["curve"]) is None:
                return {**stored["curve"], "source": "cache", "measured_at": stored["measured_at"]}
            if refused is None:  # clean in shape, measured under load: kept unless a quieter measurement comes
                best, best_at = stored["curve"], stored["measured_at"]
                later = int(stored.get("later_attempts", 0))
                last_try = float(stored.get("last_attempt_at", best_at))
                if later >= PROBE_LATER_ATTEMPTS and time.time() - last_try < PROBE_RETRY_S:
                    return {**best, "source": "cache", "measured_at": best_at, "disturbed": disturbance_problem(best)}
                log.warning("verify-cost probe: the cached table %s was %s; measuring once more",
                            path, disturbance_problem(best))
            else:
                log.warning("verify-cost probe: the cached table %s is refused (%s); measuring it again", path,
                            refused)
    fresh = None
    dipped: list[dict] = []  # attempts whose table has a dip
    for attempt in range(1, (1 if best is not None else PROBE_ATTEMPTS) + 1):
        before = read_usage(os.getpgrp())
        curve = measure_verify_cost(runner, budget_s, sizes)
        curve["round_cost"] = measure_round_cost(runner, sizes)
        curve["disturbance"] = probe_disturbance(before, read_usage(os.getpgrp()))
        problem = table_problem(curve)
        if problem is None:
            best, fresh = curve, curve
            break
        log.warning("verify-cost probe, attempt %d: %s", attempt, problem)
        dip = shape_problem(curve)
        if dip is not None:
            # A dip that another measurement shows alike is the engine's own (torch's fp32 GEMM on 3 rows can cost
            # more than on 4), not load: the table is kept as measured, so the cost model reads it cell by cell and
            # later starts take it from the cache. A dip seen once is not used beyond this engine.
            seen = ([best] if best is not None else []) + dipped
            dipped.append(curve)
            if not any(reproduces(other["round_cost"], curve["round_cost"]) for other in seen):
                continue
            curve = {**curve, "round_cost": {**curve["round_cost"], "as_measured": True}, "reproduced_dip": dip}
            log.info("verify-cost probe: the dip reproduced; the table is kept as measured (%s)", dip)
            if disturbance_problem(curve) is None:
                best, fresh = curve, curve
                break
        if best is None or _wait(curve) < _wait(best):
            best, fresh = curve, curve
    extra = {"refused_cache": refused} if refused else {}
    if best is None:  # every attempt out of order: used by this engine, never kept for the next one
        return {**curve, "source": "measured", "measured_at": round(time.time(), 3), "not_cached": problem, **extra}
    disturbed = disturbance_problem(best)
    extra.update({"disturbed": disturbed} if disturbed else {})
    # a disturbed table counts the later starts that tried to replace it
    tries = {"later_attempts": later + 1, "last_attempt_at": round(time.time(), 3)} if disturbed and later is not None \
        else {}
    if fresh is None:  # the cached table was still the quietest
        _write(path, {"key": key, "curve": best, "measured_at": best_at, **tries})
        return {**best, "source": "cache", "measured_at": best_at, **extra}
    entry = {"key": key, "curve": fresh, "measured_at": round(time.time(), 3), **tries}
    _write(path, entry)
    return {**fresh, "source": "measured", "measured_at": entry["measured_at"], **extra}


def _write(path: Path, entry: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entry, indent=1) + "\n")
    os.replace(tmp, path)  # atomic: a concurrent engine reads the old entry or the new one, never half


def _wait(curve: dict) -> float:
    disturbance = curve.get("disturbance") or {}
    wait = disturbance.get("wait_share")
    return float(wait) if isinstance(wait, (int, float)) else 1.0


def probe_disturbance(before: Usage, after: Usage) -> dict[str, float | None]:
    """This process group's run-queue wait share and the node's steal share between two snapshots. Pure."""
    wait = steal = None
    if None not in (before.engine_cpu_s, after.engine_cpu_s, before.engine_wait_s, after.engine_wait_s):
        ran = (after.engine_cpu_s or 0.0) - (before.engine_cpu_s or 0.0)
        waited = (after.engine_wait_s or 0.0) - (before.engine_wait_s or 0.0)
        wait = waited / (ran + waited) if ran + waited > 0 else None
    if before.node is not None and after.node is not None:
        total = sum(getattr(after.node, f) - getattr(before.node, f) for f in ("busy_s", "idle_s", "steal_s"))
        steal = (after.node.steal_s - before.node.steal_s) / total if total > 0 else None
    return {"wait_share": wait, "steal_share": steal}


def table_problem(curve: dict) -> str | None:
    """Why a measured curve cannot be trusted for later studies, None when it can: `shape_problem`, else
    `disturbance_problem`. Pure."""
    return shape_problem(curve) or disturbance_problem(curve)


def disturbance_problem(curve: dict) -> str | None:
    """Measured while other work held the CPU (the probe's run-queue wait share, the node's steal), else None."""
    disturbance = curve.get("disturbance")
    if not isinstance(disturbance, dict):
        return None
    wait, steal = disturbance.get("wait_share"), disturbance.get("steal_share")
    if isinstance(wait, (int, float)) and wait > PROBE_WAIT_LIMIT:
        return (f"measured while other work held the CPU: the probe waited for a core {wait:.0%} of its runnable "
                f"time (limit {PROBE_WAIT_LIMIT:.0%})")
    if isinstance(steal, (int, float)) and steal > PROBE_STEAL_LIMIT:
        return f"measured while the hypervisor took {steal:.0%} of the CPU (steal; limit {PROBE_STEAL_LIMIT:.0%})"
    return None


def shape_problem(curve: dict) -> str | None:
    """Why a curve cannot be used at all, None when it can: it carries no check of what ran beside it (an entry
    from before the check existed), it has no round table, or its table is not monotone (a wider or larger round
    measured clearly cheaper than a narrower or smaller one: no quiet machine measures that). Pure."""
    if not isinstance(curve.get("disturbance"), dict):
        return "it carries no check of what else ran while it was measured"
    table = curve.get("round_cost")
    if not isinstance(table, dict):
        return "it has no round table"
    if table.get("as_measured") and curve.get("reproduced_dip"):
        return None  # its dips were measured twice alike (cached_verify_cost)
    return first_dip(table)


def measure_prefill_cost(runner: ModelRunner, sizes: tuple[int, ...] = DRAFT_PREFILL_TOKENS,
                         passes: int = ROUND_PASSES) -> dict:
    """One prefill of each of `sizes` tokens into an empty cache, with the last row's logits: the fastest of
    `passes`, milliseconds (`prefill_tokens`, `prefill_ms`)."""
    gen = torch.Generator().manual_seed(2)
    best: dict[int, float] = {}
    for _ in range(max(1, passes)):
        for n in sizes:
            tokens = torch.randint(0, runner.vocab_size, (n,), generator=gen).tolist()
            t0 = time.perf_counter()
            runner.logits(runner.prefill(runner.new_cache(), tokens))
            best[n] = min(best.get(n, float("inf")), (time.perf_counter() - t0) * 1000.0)
    return {"prefill_tokens": list(sizes), "prefill_ms": [round(best[n], 3) for n in sizes]}


def cached_draft_cost(runner: ModelRunner, model_dir: Path, dtype: str, budget_s: float,
                      sizes: tuple[int, ...] = STARTUP_PROBE_SIZES, refresh: bool = False) -> dict:
    """A STANDALONE draft model's step: the curve of `measure_verify_cost` on the draft runner (one forward of N
    query tokens after a 128-token context plus their logits, N = a catch-up or a frontier of topk nodes) and its
    prefill (`measure_prefill_cost`: a request's first draft step), cached like the target's curve under its own key. The CPU engine reports it as `verify_cost.draft_cost` and the draft
    replay (`draft_replay`) hands it to the pipeline's step-cost model, so a STANDALONE round's predicted time
    includes the draft's own forwards."""
    choice = runner.weights
    key = {**probe_key(model_dir, dtype, runner.backend, sizes,
                       choice.mode + (f"-{choice.isa}" if choice.isa else "")), "role": "draft",
           "draft_probe_version": DRAFT_PROBE_VERSION}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = cache_root() / "probe" / f"draft-{digest}.json"
    if not refresh:
        stored = _read(path)
        if stored is not None and stored.get("key") == key:
            return {**stored["curve"], "source": "cache", "measured_at": stored["measured_at"]}
    curve = {**measure_verify_cost(runner, budget_s, sizes), **measure_prefill_cost(runner)}
    entry = {"key": key, "curve": curve, "measured_at": round(time.time(), 3)}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entry, indent=1) + "\n")
    os.replace(tmp, path)
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
