"""The candidates compared before the engine got its GGUF kernel (issue #16): can plain decode of SmolLM2-135M read
the GGUF's Q4_1 blocks instead of fp32 weights and keep the fp32 engine's greedy tokens? The decode harness swaps
`serve.engines.cpu.llama.F` for a shim whose `linear` routes each known weight to a candidate (with the engine's own
weights setting off: fp32 tensors). Not a test.

    python benchmarks/q4_linear.py exact                     # every weight reproduced bit for bit?
    python benchmarks/q4_linear.py linear --threads 1 2      # per-linear time, real shapes, M = 1, 4, 16, 64
    python benchmarks/q4_linear.py decode --threads 1 2      # greedy tokens vs fp32, tok/s, alternating

Candidates (`--candidates`):
- fp32: `F.linear` on the engine's fp32 weights (the reference: the engine with `--weights fp32`).
- gguf: the engine's kernel (`serve/engines/cpu/gguf_linear.py`, this machine's build, compiled once and cached)
  over the GGUF blocks as they are in the file (Q4_1 for the 210 layer linears, Q8_0 for the tied lm_head): it forms
  each weight exactly (q * d + m in fp32: q * d is exact, so the one rounding of the FMA is the rounding of fp32
  `d * q + m`, which is how the converted safetensors were made) and accumulates x * w in fp32.
- int4pack / int4pack_bf16: torch's `_weight_int4pack_mm_for_cpu` (group 32, q' = q - 8, zero = m + 8 d, as its
  kernel dequantizes `(q - 8) * scale + zero`). fp32 activations/scales take its scalar reference loop (its AVX-512
  loop is bf16-only in torch 2.13); bf16 rounds scales, zeros, activations and outputs. Q4_1 linears only.
- int8pack: `_weight_int8pack_mm`, per-row absmax int8 of the fp32 weight (Q4_1's per-32 scales and mins are not a
  per-row int8 grid, so not exact).
- inductor: `torch.compile` of a dequantize-and-reduce over the Q4_1 blocks (exact weights, generated C++).
Candidates without a kernel for a weight's format (lm_head for int4pack/inductor) use fp32 `F.linear` for it.

Timing alternates the candidates inside one process, round by round (drift hits all alike); medians over rounds.
Per-linear times are per call over the 30 layers' distinct weights of a shape in turn (cold caches, as a decode
step sees them). Decode: chat-formatted prompts of benchmarks/cpu_engine_ab.py, greedy, EOS ignored; tok/s =
(new tokens - 1) / seconds after the prefill, summed over prompts. Every table line carries the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cpu_engine_ab import PROMPTS  # noqa: E402
from serve.engines.cpu import llama  # noqa: E402
from serve.engines.cpu.convert import load_tokenizer  # noqa: E402
from serve.engines.cpu.gguf_linear import GgufWeight, load_kernel, model_weights, read_gguf_weights  # noqa: E402
from serve.engines.cpu.models import fetch_gguf, resolve_model  # noqa: E402

ALL = ("fp32", "gguf", "int4pack", "int4pack_bf16", "int8pack", "inductor")
Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Weight:
    shape: str  # qkv, o, gate_up, down, lm_head
    layer: int
    w: torch.Tensor  # the engine's own fp32 tensor (LlamaForward)
    blocks: GgufWeight


def pair_weights(fwd: llama.LlamaForward, gguf_path: Path) -> list[Weight]:
    """Every matmul weight of the forward, paired with its GGUF blocks in the forward's fused row order (read and
    fused as the engine does: `gguf_linear.read_gguf_weights` / `model_weights`)."""
    s = fwd.shape
    blocks, others = read_gguf_weights(gguf_path, s.num_heads, s.num_kv_heads)
    fused = model_weights(blocks, others, len(fwd.layers), tied=True)
    out = [Weight(name, i, getattr(layer, name), fused[f"{i}.{name}"])
           for i, layer in enumerate(fwd.layers) for name in ("qkv", "o", "gate_up", "down")]
    out.append(Weight("lm_head", 0, fwd.head, fused["head"]))
    return out


# ---------------------------------------------------------------------------------------------------- candidates

def nibbles(b: GgufWeight) -> torch.Tensor:
    """Q4_1 values q [N, K] in 0..15 (GGUF: byte j of a block holds q_j low, q_{j+16} high)."""
    q = torch.cat([b.qs & 15, b.qs >> 4], -1)
    return q.reshape(q.shape[0], -1)


def make(candidate: str, wt: Weight) -> Linear:
    w, b = wt.w, wt.blocks
    fp32: Linear = lambda x: F.linear(x, w)  # noqa: E731
    if candidate == "fp32":
        return fp32
    if candidate == "gguf":  # the engine's kernel, this machine's build (gguf_linear.load_kernel)
        kernel = load_kernel()[0]
        return lambda x: b.matmul(kernel, x)
    if candidate == "int8pack":
        scale = w.abs().amax(1) / 127.0
        q8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return lambda x: torch.ops.aten._weight_int8pack_mm(x.contiguous(), q8, scale)
    if b.m is None:  # Q8_0 (the head): no int4 form
        return fp32
    d, m = b.d.float(), b.m.float() if b.m is not None else None
    assert m is not None
    if candidate in ("int4pack", "int4pack_bf16"):
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles(b).to(torch.int32), 1)
        sz = torch.stack([d, m + 8 * d], -1).transpose(0, 1).contiguous()  # [K/32, N, 2]: scale, zero
        if candidate == "int4pack":
            return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), packed, 32, sz)
        szb = sz.bfloat16()
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16().contiguous(), packed, 32, szb).float()
    if candidate == "inductor":
        qs = b.qs
        return lambda x: _inductor_q4(x, qs, d, m)
    raise ValueError(f"--candidates: unknown {candidate!r} (choose from {', '.join(ALL)})")


_SHIFTS = torch.tensor([0, 4], dtype=torch.uint8)
# One graph per (shape, M): 5 shapes x 4 M exceed dynamo's default of 8, after which it silently runs eager.
torch._dynamo.config.recompile_limit = 64


@torch.compile(dynamic=False)
def _inductor_q4(x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    q = ((qs[:, :, None, :] >> _SHIFTS[None, None, :, None]) & 15).to(torch.float32)  # [N, G, 2, 16]
    w = q * d[:, :, None, None] + m[:, :, None, None]
    return (x.reshape(x.shape[0], 1, qs.shape[1], 2, 16) * w[None]).sum((-1, -2, -3))


# ---------------------------------------------------------------------------------------------------- measurements

def load(model: str) -> tuple[llama.LlamaForward, list[Weight], Path]:
    model_dir = resolve_model(model)
    fwd = llama.LlamaForward.from_dir(model_dir, torch.float32)
    return fwd, pair_weights(fwd, fetch_gguf(model)), model_dir


def _load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def cmd_exact(weights: list[Weight], candidates: list[str], layers: int) -> None:
    """x = identity rows through each candidate gives W^T as the candidate computes it; compare bit for bit."""
    print("## Weights reproduced (identity rows through the candidate's matmul, compared with the fp32 tensor)\n")
    print("| candidate | tensors checked | elements equal (bit for bit) | max abs diff | note |")
    print("|---|---|---|---|---|")
    for c in candidates:
        if c == "fp32":
            continue
        equal = total = count = 0
        worst = 0.0
        slow = c in ("int4pack", "inductor")  # scalar / generated loops: layer 0 only (identity is K rows)
        for wt in weights:
            if (slow and wt.layer >= 1) or (wt.layer >= layers) or (wt.blocks.m is None and c not in ("gguf", "int8pack")):
                continue
            k = wt.w.shape[1]
            got = torch.cat([make(c, wt)(torch.eye(k)[i:i + 256]) for i in range(0, k, 256)]).t()
            equal += int((got == wt.w).sum())
            total += wt.w.numel()
            worst = max(worst, float((got - wt.w).abs().max()))
            count += 1
        note = "layer 0 only" if slow else ("incl. lm_head (Q8_0)" if c in ("gguf", "int8pack") else "Q4_1 only")
        print(f"| {c} | {count} | {equal / total:.6f} ({total - equal} differ) | {worst:.3g} | {note} |", flush=True)
    print(f"\nload average (1/5/15 min): {_load()}\n")
    print("## Invariance: is a row's output the same whatever else runs with it? (layer 0 and lm_head, x = "
          "randn(16, K))\n")
    print("| candidate | rows of M=16 == the same rows at M=1 | 1 thread == 2 threads (M=16) |")
    print("|---|---|---|")
    torch.manual_seed(0)
    for c in [c for c in candidates if c in ("fp32", "gguf")]:
        batch = threads = total = 0
        for wt in [wt for wt in weights if wt.layer == 0]:
            f, x = make(c, wt), torch.randn(16, wt.w.shape[1])
            torch.set_num_threads(2)
            y16, y1 = f(x), torch.cat([f(x[i:i + 1]) for i in range(16)])
            torch.set_num_threads(1)
            batch += int((y16 == y1).sum())
            threads += int((f(x) == y16).sum())
            total += y16.numel()
        print(f"| {c} | {batch / total:.4f} of elements | {threads / total:.4f} of elements |", flush=True)
    print()


def _time(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def cmd_linear(weights: list[Weight], candidates: list[str], rows: list[int], threads: list[int],
               rounds: int) -> None:
    shapes = ["qkv", "o", "gate_up", "down", "lm_head"]
    calls = {c: {wt.shape + str(wt.layer): make(c, wt) for wt in weights} for c in candidates}
    print(f"## Per-linear time (us per call, median of {rounds} rounds; each round calls every layer's weight of "
          "the shape once, candidates alternating)\n")
    print("| threads | shape (N x K) | M | " + " | ".join(candidates) + " | " +
          " | ".join(f"fp32 / {c}" for c in candidates if c != "fp32") + " | load avg |")
    print("|---" * (3 + 2 * len(candidates) - 1 + 1) + "|")
    for t in threads:
        torch.set_num_threads(t)
        for shape in shapes:
            ws = [wt for wt in weights if wt.shape == shape]
            n, k = ws[0].w.shape
            for m in rows:
                x = torch.randn(m, k)
                cs = [c for c in candidates if not (c == "int4pack" and m > 4)]  # scalar loop: minutes at M=64
                for c in cs:  # warm-up (and inductor's compile for this M)
                    calls[c][shape + str(ws[0].layer)](x)
                per: dict[str, list[float]] = {c: [] for c in cs}
                for _ in range(rounds):
                    for c in cs:
                        fs = [calls[c][shape + str(wt.layer)] for wt in ws]
                        per[c].append(1e6 * _time(lambda: [f(x) for f in fs]) / len(fs))
                med = {c: statistics.median(v) for c, v in per.items()}
                cells = [f"{med[c]:.0f}" if c in med else "-" for c in candidates]
                ratios = [f"{med['fp32'] / med[c]:.2f}x" if c in med else "-" for c in candidates if c != "fp32"]
                print(f"| {t} | {shape} ({n} x {k}) | {m} | " + " | ".join(cells) + " | " + " | ".join(ratios) +
                      f" | {os.getloadavg()[0]:.2f} |", flush=True)
    print(f"\nload average at the end (1/5/15 min): {_load()}\n")


class Shim:
    """Stands in for `torch.nn.functional` inside llama.py: `linear` on a known weight goes to the active
    candidate, everything else is torch's own."""

    def __init__(self, routes: dict[str, dict[int, Linear]]) -> None:
        self.routes = routes
        self.active = "fp32"

    def linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        fn = self.routes[self.active].get(w.data_ptr())
        if fn is None or bias is not None:
            return F.linear(x, w, bias)
        shape = x.shape
        return fn(x.reshape(-1, shape[-1])).reshape(*shape[:-1], w.shape[0])

    def __getattr__(self, name: str) -> object:
        return getattr(F, name)


def greedy(fwd: llama.LlamaForward, ids: list[int], new_tokens: int) -> tuple[list[int], float]:
    """Greedy ids after `ids` (EOS ignored) and the seconds of the steps after the prefill."""
    cache = fwd.new_cache(len(ids) + new_tokens)
    with torch.inference_mode():
        hidden = fwd.forward(cache, torch.tensor(ids), torch.arange(len(ids)), None)[-1:]
        out = [int(fwd.logits(hidden).argmax(-1))]
        started = time.perf_counter()
        while len(out) < new_tokens:
            pos = len(ids) + len(out) - 1
            hidden = fwd.forward(cache, torch.tensor([out[-1]]), torch.tensor([pos]), None)
            out.append(int(fwd.logits(hidden).argmax(-1)))
        return out, time.perf_counter() - started


def cmd_decode(fwd: llama.LlamaForward, weights: list[Weight], model_dir: Path, candidates: list[str],
               threads: list[int], rounds: int, prompts: int, new_tokens: int) -> None:
    tok = load_tokenizer(model_dir)
    inputs = [list(tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                      add_generation_prompt=True), add_special_tokens=False))
              for p in PROMPTS[:prompts]]
    shim = Shim({c: {wt.w.data_ptr(): make(c, wt) for wt in weights} for c in candidates})
    llama.F = shim  # type: ignore[assignment]  # the harness's swap; the module is not edited
    print(f"## Plain greedy decode ({prompts} prompts x {new_tokens} tokens, EOS ignored, {rounds} rounds, "
          "candidates alternating per round)\n")
    print("| threads | candidate | tok/s (median) | tok/s per round | vs fp32 | prompts identical to fp32 | "
          "first divergence (prompt, token) | load avg start / end |")
    print("|---|---|---|---|---|---|---|---|")
    for t in threads:
        torch.set_num_threads(t)
        load_start = os.getloadavg()[0]
        rates: dict[str, list[float]] = {c: [] for c in candidates}
        outputs: dict[str, list[list[int]]] = {}
        shim.active = candidates[0]
        greedy(fwd, inputs[0], 8)  # warm-up
        for _ in range(rounds):
            for c in candidates:
                shim.active = c
                outs, seconds = zip(*(greedy(fwd, ids, new_tokens) for ids in inputs))
                rates[c].append(sum(len(o) - 1 for o in outs) / sum(seconds))
                if c in outputs and outputs[c] != list(outs):
                    print(f"  note: {c} at {t} thread(s) gave different tokens in another round", flush=True)
                outputs[c] = list(outs)
        load_end = os.getloadavg()[0]
        ref = outputs["fp32"] if "fp32" in outputs else outputs[candidates[0]]
        base = statistics.median(rates["fp32"]) if "fp32" in rates else float("nan")
        for c in candidates:
            same = sum(a == b for a, b in zip(outputs[c], ref))
            div = [(i, next(j for j, (x, y) in enumerate(zip(a, b)) if x != y))
                   for i, (a, b) in enumerate(zip(outputs[c], ref)) if a != b]
            med = statistics.median(rates[c])
            print(f"| {t} | {c} | {med:.1f} | {', '.join(f'{r:.1f}' for r in rates[c])} | {med / base:.2f}x | "
                  f"{same} of {len(ref)} | {div[0] if div else '-'} | {load_start:.2f} / {load_end:.2f} |",
                  flush=True)
    llama.F = F  # type: ignore[assignment]
    print()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("exact", "linear", "decode"))
    p.add_argument("--model", default="smollm2-135m", help="a known GGUF model id whose tensors are Q4_1 / Q8_0")
    p.add_argument("--candidates", nargs="+", choices=ALL, default=None,
                   help="default: exact/linear all, decode fp32 gguf")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64], help="linear: M (query rows)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--layers", type=int, default=30, help="exact: layers checked (lm_head always)")
    p.add_argument("--prompts", type=int, default=6, choices=range(1, len(PROMPTS) + 1))
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    candidates = args.candidates or (["fp32", "gguf"] if args.what == "decode" else list(ALL))
    fwd, weights, model_dir = load(args.model)
    print(f"# {args.what}: {args.model}, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
          f"{os.cpu_count()} CPUs, load average at the start {_load()}\n", flush=True)
    if args.what == "exact":
        torch.set_num_threads(max(args.threads))
        cmd_exact(weights, candidates, args.layers)
    elif args.what == "linear":
        cmd_linear(weights, candidates, args.rows, args.threads, args.rounds)
    else:
        cmd_decode(fwd, weights, model_dir, candidates, args.threads, args.rounds, args.prompts, args.new_tokens)
    return 0



if __name__ == "__main__":
    sys.exit(main())
