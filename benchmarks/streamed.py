"""What the engine side-by-side benchmarks share: the machine line, one streamed pass of prompts and its figures,
and the median (range) cell. A pass sends the prompts one at a time, streamed through `/generate` (the load
generator the studies use), greedy:
- `e2e`     completion tokens / summed end-to-end seconds (prefill in: what a client sees);
- `decode`  tokens after the first / summed (end-to-end - time to first token) (prefill out);
- `ttft_ms` median time to the first token (the prefill);
- `accept`  completion tokens / verify steps (SGLang's spec_accept_length, the prefill token included; 1 without
            speculation)."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.measure.load import LoadRequest, run_phase  # noqa: E402
from serve.engines.base import ReplicaConfig  # noqa: E402
from serve.replica.deployment import EngineProcess  # noqa: E402


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


def streamed_pass(url: str, items: list[LoadRequest]) -> dict[str, float]:
    """One pass of `items` at concurrency 1; raises naming the first failed request (a lost request is no figure)."""
    records = run_phase(url, items, phase="measure", concurrency=1, timeout_s=900)
    failed = [r.error for r in records if r.error]
    if failed:
        raise RuntimeError(f"{url}: {len(failed)} request(s) failed: {failed[0]}")
    tokens = sum(r.completion_tokens for r in records)
    decode_s = sum(r.e2e_s - (r.ttft_s or 0.0) for r in records)
    steps = sum(r.spec_verify_ct or 0 for r in records)
    return {"e2e": tokens / sum(r.e2e_s for r in records),
            "decode": sum(max(r.completion_tokens - 1, 0) for r in records) / decode_s if decode_s > 0 else 0.0,
            "ttft_ms": 1000 * statistics.median(r.ttft_s or 0.0 for r in records),
            "accept": tokens / steps if steps else 1.0}


def spread(values: list[float], digits: int = 1) -> str:
    """`median (min-max)`."""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def add_common_args(parser: argparse.ArgumentParser, new_tokens: int) -> None:
    parser.add_argument("--threads", type=int, default=2, help="every engine's threads (llama-server -t, SGLang "
                        "OMP_NUM_THREADS)")
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)


def prompt_items(prompts: list[str], new_tokens: int) -> list[LoadRequest]:
    return [LoadRequest(index=i, text=p, max_new_tokens=new_tokens) for i, p in enumerate(prompts)]


def start_engine(name: str, fields: dict, threads: int, warm: list[LoadRequest]) -> EngineProcess:
    """Start one engine as a trial replica starts it, print what it resolved (our engine's weights mode, SGLang's
    backend, dtype and version), and send it one warm-up request."""
    config = ReplicaConfig(**{"model": "smollm2-135m", **fields}, threads=threads, start_timeout_s=900,
                           log_dir=tempfile.mkdtemp(prefix=f"bench-{name}-"))
    engine = EngineProcess(config)
    engine.wait_ready()
    info = httpx.get(f"{engine.url}/server_info", timeout=30).json()
    resolved = {"cpu": ("weights_mode", "weights_isa"), "sglang": ("attention_backend", "dtype", "version")}
    shown = " ".join(f"{k}={info.get(k)}" for k in resolved.get(fields["engine"], ()))
    print(f"{name}: started in {engine.startup_s:.1f} s {shown}".rstrip(), flush=True)
    run_phase(engine.url, warm[:1], phase="warmup", concurrency=1, timeout_s=900)
    return engine


def rotated(names: list[str], round_no: int) -> list[str]:
    """The engines' order in round `round_no`: rotated each round, so a slow phase of the machine falls on all."""
    shift = round_no % len(names)
    return names[shift:] + names[:shift]
