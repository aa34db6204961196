#!/usr/bin/env python3
"""Tree verify of NGRAM drafts, as SGLang 0.5.23 lays it out, on one GPU (or a CPU) with torch alone.

    python3 tests/gpu/check_tree_verify.py [--device cpu|cuda] [--size small|full] [--seed N]

Needs only torch: the project's trie (serve/ngram/trie.py), the SGLang-on-CPU engine's tree-verify attention
(serve/engines/sglang/cpu/verify.py) and the CPU engine's acceptance walk (serve/engines/cpu/verify.py) are loaded
from the source tree by file path, so no project package (pydantic, Ray) and no SGLang is imported.

What it checks. NGRAM drafts from the trie at max_bfs_breadth 1/2/4/8, BFS and PROB, padded to the verify width, for
a batch of requests of varied prefix lengths; SGLang's `custom_mask` in the FULL_MASK layout its GPU path hands the
attention backend (`ngram_worker.py`: per request [n, prefix + n], ones over the prefix, then the n x n tree mask of
`fillResult`, row 0 the root); random Q/K/V in a paged KV pool, MHA (GQA) and absorbed MLA (latent 512 + rope 64).
Each attention path is compared with a dense fp32 masked attention (the reference) in bf16 and fp32:
  - fa3 topk > 1: `flashattention_backend.py`'s cascade, reproduced in torch from its own index arithmetic (mask
    rows extracted from `custom_mask`, the sorted per-row page table, `cache_seqlens = mask.sum`): a prefix pass, a
    masked draft pass, merged by log-sum-exp (`merge_state_v2`). Must match.
  - the SGLang-on-CPU engine's `tree_verify_attention` (QLEN mask; run on the CPU, where that engine runs). Must match.
  - fa3 topk <= 1: plain causal attention over prefix + drafts, no mask: what SGLang runs for NGRAM at breadth 1
    (it sets topk = max_bfs_breadth). Must DIVERGE on the branching breadth-1 trees (the trie merges anchors, and
    pads hang under the root, so a breadth-1 draft is rarely a chain).
Then a tiny random-weight decoder (fp32, MHA and MLA) verifies drafts step by step through each path, accepting
with the CPU engine's `walk_tree`, against sequential greedy decoding: the masked paths must emit the greedy tokens
and match the reference's logits; the causal path's logits must diverge on branching trees.
Tolerances (max |path - reference| <= atol + rtol * |reference|): fp32 1e-4 + 1e-4, bf16 1e-2 + 2e-2 (the inputs
are the same bf16 values for every path; what differs is accumulation and rounding of outputs).
Prints one table; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
import types
from pathlib import Path
from typing import Any, Callable

import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch alone runs without numpy
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SIZES: dict[str, dict[str, Any]] = {  # prefix lengths of the batch, verify width n, query heads, MHA head dim
    "small": dict(prefixes=[1, 3, 17, 64, 130, 255, 7, 31], n=10, heads=4, head_dim=64, new_tokens=16),
    "full": dict(prefixes=[1, 3, 17, 255, 1000, 2049, 4097, 31], n=16, heads=16, head_dim=128, new_tokens=32),
}
MLA_LATENT, MLA_ROPE, MLA_QK_HEAD = 512, 64, 192  # DeepSeek-V2/V3: the softmax scale is 1/sqrt(nope 128 + rope 64)
Path_ = Callable[..., torch.Tensor]


def load_by_path(name: str, relative: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {relative} from {ROOT}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def load_project() -> tuple[types.ModuleType, types.ModuleType, types.ModuleType, types.ModuleType]:
    """The trie, the SGLang-on-CPU verify, the CPU engine's verify and the paths, without running any package
    __init__: a project import (pydantic, Ray) must never become a dependency of this check."""
    for package, folder in (("serve", "serve"), ("serve.ngram", "serve/ngram")):
        if package not in sys.modules:
            stub = types.ModuleType(package)
            stub.__path__ = [str(ROOT / folder)]
            sys.modules[package] = stub
    for name in ("stdheap", "drafttree", "trie"):  # trie imports the other two by their package names
        if f"serve.ngram.{name}" not in sys.modules:
            load_by_path(f"serve.ngram.{name}", f"serve/ngram/{name}.py")
    return (sys.modules["serve.ngram.trie"],
            load_by_path("check_tree_verify_sglang_cpu", "serve/engines/sglang/cpu/verify.py"),
            load_by_path("check_tree_verify_cpu_verify", "serve/engines/cpu/verify.py"),
            load_by_path("check_tree_verify_paths", "tests/gpu/tree_verify_paths.py"))


# ---------------------------------------------------------------- drafts

def seeded_trie(trie: Any, breadth: int, match: str, n: int, corpora: list[list[int]]) -> Any:
    cache = trie.NgramCache(max_trie_depth=6, capacity=200_000, min_bfs_breadth=1, max_bfs_breadth=breadth,
                            match_type=match, num_draft_tokens=n)
    for seq in corpora:  # as the worker inserts after each step: every window of the sequence
        for end in range(2, len(seq) + 1):
            cache.insert(seq[:end])
    return cache


def draft_batch(trie: Any, breadth: int, match: str, n: int, count: int, rng: random.Random) -> list[Any]:
    """`count` draft trees over a small vocabulary; the last context ends on a rare token, so its tree is mostly
    pads."""
    corpora = [[rng.randrange(12) for _ in range(48)] for _ in range(6)] + [[90, 91, 92]]
    cache = seeded_trie(trie, breadth, match, n, corpora)
    contexts = [[rng.randrange(12) for _ in range(rng.randrange(1, 12))] for _ in range(count - 1)] + [[5, 90]]
    return [cache.draft(context) for context in contexts]


def kv_inputs(kind: str, tokens: int, slots: int, size: dict[str, Any], dtype: torch.dtype, device: str,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    if kind == "MHA":  # GQA: 2 KV heads
        dim = size["head_dim"]
        q = torch.randn(tokens, size["heads"], dim, generator=gen)
        kc, vc = torch.randn(slots, 2, dim, generator=gen), torch.randn(slots, 2, dim, generator=gen)
        q, kc, vc = q.to(device, dtype), kc.to(device, dtype), vc.to(device, dtype)
        return q, kc, vc, dim ** -0.5
    # absorbed MLA: one latent KV head, keys [c_kv | k_rope], values c_kv (a view of the same cache, as in SGLang)
    q = torch.randn(tokens, size["heads"], MLA_LATENT + MLA_ROPE, generator=gen).to(device, dtype)
    kc = torch.randn(slots, 1, MLA_LATENT + MLA_ROPE, generator=gen).to(device, dtype)
    return q, kc, kc[..., :MLA_LATENT], MLA_QK_HEAD ** -0.5


# ---------------------------------------------------------------- a tiny decoder

class TinyDecoder:
    """Random weights, fp32: MHA (GQA, RoPE on the whole head) or absorbed MLA (one latent KV head [latent | rope],
    RoPE on the rope part, values the latent), RMSNorm, a SiLU MLP."""

    def __init__(self, kind: str, gen: torch.Generator, device: str, vocab: int = 40, hidden: int = 64) -> None:
        self.kind, self.heads, self.vocab = kind, 4, vocab
        self.kv_heads, self.dk, self.dv, self.rope = (2, 16, 16, 16) if kind == "MHA" else (1, 48, 32, 16)
        self.scale = self.dk ** -0.5

        def w(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=gen) * cols ** -0.5).to(device)
        kv_out = self.kv_heads * (self.dk + self.dv) if kind == "MHA" else self.dk
        self.embed = torch.randn(vocab, hidden, generator=gen).to(device)
        self.layers = [dict(q=w(self.heads * self.dk, hidden), kv=w(kv_out, hidden), o=w(hidden, self.heads * self.dv),
                            gate=w(128, hidden), up=w(128, hidden), down=w(hidden, 128)) for _ in range(2)]
        self.head = w(vocab, hidden)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        half = self.rope // 2
        freq = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
        angle = positions.to(x.device, torch.float32)[:, None, None] * freq
        a, b = x[..., -self.rope:-half], x[..., -half:]
        rotated = torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], dim=-1)
        return torch.cat([x[..., :-self.rope], rotated], dim=-1)

    def qkv(self, layer: dict[str, torch.Tensor], x: torch.Tensor,
            positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
        q = self.rotate((h @ layer["q"].T).view(len(x), self.heads, self.dk), positions)
        kv = h @ layer["kv"].T
        if self.kind == "MHA":
            k = self.rotate(kv[:, :self.kv_heads * self.dk].view(len(x), self.kv_heads, self.dk), positions)
            return q, k, kv[:, self.kv_heads * self.dk:].view(len(x), self.kv_heads, self.dv)
        k = self.rotate(kv.view(len(x), 1, self.dk), positions)
        return q, k, k[..., :self.dv]

    def finish(self, layer: dict[str, torch.Tensor], x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + attn.reshape(len(x), -1).float() @ layer["o"].T
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
        return x + (torch.nn.functional.silu(h @ layer["gate"].T) * (h @ layer["up"].T)) @ layer["down"].T

    def causal(self, tokens: list[int], attend: Callable[..., Any]) -> tuple[torch.Tensor, list[tuple[Any, Any]]]:
        """Logits of a plain causal forward over `tokens`, and every layer's K/V (the prefill)."""
        x = self.embed[torch.tensor(tokens)]
        positions, kvs = torch.arange(len(tokens)), []
        allowed = torch.ones(len(tokens), len(tokens), dtype=torch.bool, device=x.device).tril()
        for layer in self.layers:
            q, k, v = self.qkv(layer, x, positions)
            kvs.append((k, v))
            x = self.finish(layer, x, attend(q, k, v, allowed, self.scale)[0])
        return torch.nn.functional.rms_norm(x, (x.shape[-1],)) @ self.head.T, kvs

    def verify(self, seqs: list[list[int]], trees: list[Any], batch: Any, path: Path_,
               prefill: list[list[tuple[Any, Any]]]) -> torch.Tensor:
        """Logits [bs * n, vocab] of one verify step: each request's prefix (all but its last token, its K/V in
        `prefill`) in a paged pool, then the root and its drafts through `path`, as SGLang's target verify does."""
        device = self.embed.device
        tokens = torch.tensor([t for seq, tree in zip(seqs, trees) for t in (seq[-1], *tree.tokens)])
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            q, k, v = self.qkv(layer, x, batch.positions)
            kc = torch.zeros(batch.slots, self.kv_heads, self.dk, device=device)
            vc = kc[..., :self.dv] if self.kind == "MLA" else torch.zeros(batch.slots, self.kv_heads, self.dv,
                                                                            device=device)
            for b, kvs in enumerate(prefill):
                prefix = int(batch.prefixes[b])
                slots = batch.slot_rows(b, prefix + batch.n).to(device)
                kc[slots[:prefix]], kc[slots[prefix:]] = kvs[i][0], k[b * batch.n:(b + 1) * batch.n]
                if self.kind == "MHA":
                    vc[slots[:prefix]], vc[slots[prefix:]] = kvs[i][1], v[b * batch.n:(b + 1) * batch.n]
            x = self.finish(layer, x, path(q, kc, vc, batch, self.scale))
        return torch.nn.functional.rms_norm(x, (x.shape[-1],)) @ self.head.T


def decoder_cases(table: Table, trie: Any, walk_tree: Callable[..., Any], paths: Any, size: dict[str, Any],
                  device: str, seed: int, sglang_cpu: Any) -> None:
    """Each path verifies its own drafts step by step (accepting with the CPU engine's walk_tree) until every
    request has `new_tokens` new tokens; its tokens must be sequential greedy's, and at every step its logits are
    compared with the reference path's on the same batch."""
    new_tokens, n = size["new_tokens"], size["n"]
    candidates: dict[str, Path_] = {"fa3 topk>1": paths.fa3_two_pass, "cpu engine": paths.cpu_engine(sglang_cpu),
                                    "fa3 topk<=1": paths.fa3_causal}
    for kind in ("MHA", "MLA"):
        for breadth in (1, 4):
            gen, rng = torch.Generator().manual_seed(seed + breadth), random.Random(seed + breadth)
            model = TinyDecoder(kind, gen, device)
            prompts = [[rng.randrange(model.vocab) for _ in range(rng.randrange(2, 14))] for _ in range(6)]
            greedy = []
            for prompt in prompts:
                seq = list(prompt)
                for _ in range(new_tokens):
                    seq.append(int(model.causal(seq, paths.attend)[0][-1].argmax()))
                greedy.append(seq)
            noise = [[rng.randrange(model.vocab) for _ in range(40)] for _ in range(4)]
            # the greedy runs go in last: they are the most recent children, as after an earlier identical request
            cache = seeded_trie(trie, breadth, "BFS", n, noise + greedy)
            cells, why, branched = [], [], 0
            for name in ("reference", *candidates):
                seqs, err, differs_err, steps, accepted = [list(p) for p in prompts], (0.0, 0.0), 0.0, 0, 0
                while min(len(s) - len(p) for s, p in zip(seqs, prompts)) < new_tokens and steps < new_tokens:
                    trees = [cache.draft(s) for s in seqs]
                    batch = paths.Batch(trees, [len(s) - 1 for s in seqs], gen)
                    prefill = [model.causal(s[:-1], paths.attend)[1] for s in seqs]
                    ref = model.verify(seqs, trees, batch, paths.reference, prefill)
                    logits = ref if name == "reference" else model.verify(seqs, trees, batch, candidates[name],
                                                                          prefill)
                    step_err = paths.max_violation(logits, ref, torch.float32)
                    err = max(err, step_err, key=lambda e: e[1])
                    differs = paths.causal_differs(batch).to(logits.device)
                    branched += int(name == "reference") * sum(paths.branches(t) for t in trees)
                    if differs.any():
                        differs_err = max(differs_err, float((logits - ref).abs()[differs].max()))
                    for b, (seq, tree) in enumerate(zip(seqs, trees)):
                        rows = logits[b * n:(b + 1) * n]
                        taken, emitted = walk_tree((seq[-1], *tree.tokens), (-1, *(p + 1 for p in tree.parents)),
                                                   lambda i: rows[i], lambda row: int(torch.argmax(row)))
                        seq.extend(emitted)
                        accepted += len(taken)
                    steps += 1
                same = sum(s[len(p):len(p) + new_tokens] == g[len(p):] for s, p, g in zip(seqs, prompts, greedy))
                greedy_cell = f"{same}/{len(prompts)} greedy, {accepted} acc/{steps} steps"
                if name == "fa3 topk<=1":
                    atol = paths.TOLERANCE[torch.float32][0]
                    cells.append(f"{differs_err:.1e} (branching rows); {greedy_cell}")
                    if breadth == 1 and not differs_err > atol:
                        why.append("causal logits did not diverge on a branching breadth-1 tree")
                    continue
                cells.append(("" if name == "reference" else f"{err[0]:.1e}; ") + greedy_cell)
                if same != len(prompts) or err[1] > 1 or accepted == 0:
                    why.append(f"{name}: greedy {same}/{len(prompts)}, err {err[0]:.1e}, {accepted} accepted")
            table.add(f"decoder {kind} fp32 BFS b{breadth}", f"{branched} branching trees", cells, not why,
                      "; ".join(why))


# ---------------------------------------------------------------- the table

class Table:
    def __init__(self) -> None:
        self.rows: list[list[str]] = []
        self.failures: list[str] = []

    def add(self, case: str, drafts: str, cells: list[str], ok: bool, why: str = "") -> None:
        self.rows.append([case, drafts, *cells, "ok" if ok else "MISMATCH"])
        if not ok:
            self.failures.append(f"{case}: {why}")

    def print(self, header: list[str]) -> None:
        widths = [max(len(r[i]) for r in [header, *self.rows]) for i in range(len(header))]
        for row in [header, ["-" * w for w in widths], *self.rows]:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


def attention_cases(table: Table, trie: Any, paths: Any, sglang_cpu: Any, size: dict[str, Any], device: str,
                    seed: int) -> None:
    masked: dict[str, Path_] = {"fa3 topk>1": paths.fa3_two_pass, "cpu engine": paths.cpu_engine(sglang_cpu)}
    for breadth in (1, 2, 4, 8):
        for match in ("BFS", "PROB"):
            rng, gen = random.Random(seed * 100 + breadth), torch.Generator().manual_seed(seed + breadth)
            trees = draft_batch(trie, breadth, match, size["n"], len(size["prefixes"]), rng)
            batch = paths.Batch(trees, size["prefixes"], gen)
            padded = sum(t.num_real < len(t.tokens) for t in trees)
            drafts = f"{sum(paths.branches(t) for t in trees)}/{len(trees)} branch, {padded} padded"
            differs = paths.causal_differs(batch)
            for kind in ("MHA", "MLA"):
                for dtype in (torch.float32, torch.bfloat16):
                    q, kc, vc, scale = kv_inputs(kind, batch.bs * batch.n, batch.slots, size, dtype, device, gen)
                    ref = paths.reference(q, kc, vc, batch, scale)
                    errs = [paths.max_violation(path(q, kc, vc, batch, scale), ref, dtype) for path in masked.values()]
                    atol, rtol = paths.TOLERANCE[dtype]
                    gap = (paths.fa3_causal(q, kc, vc, batch, scale).float() - ref).abs().amax(dim=(1, 2)).cpu()
                    over = gap > atol + rtol * ref.abs().amax(dim=(1, 2)).cpu()
                    worst = float(gap[differs].max()) if differs.any() else 0.0
                    causal = f"{worst:.1e} ({int((over & differs).sum())}/{int(differs.sum())} rows off)"
                    ok, why = all(e[1] <= 1 for e in errs), "a masked path is off the reference"
                    if breadth == 1:  # the claim under test: breadth 1 is a tree, and the causal path gets it wrong
                        ok = ok and bool((over & differs).any())
                        why += " or the causal path did not diverge on a branching breadth-1 tree"
                    name = f"{kind} {'bf16' if dtype == torch.bfloat16 else 'fp32'} {match} b{breadth}"
                    table.add(name, drafts, ["-", *[f"{e[0]:.1e} ({e[1]:.2f} of tol)" for e in errs],
                                             causal], ok, why)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tree verify of NGRAM drafts as SGLang lays it out (torch only).")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), help="batch and head sizes (default: full on cuda, small "
                        "on cpu)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False); use --device cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    torch.backends.cudnn.allow_tf32 = False
    size = SIZES[args.size or ("full" if args.device == "cuda" else "small")]
    if args.device == "cpu":
        # The work is thousands of small ops: one thread is as fast, and does not spin against a busy machine.
        torch.set_num_threads(1)
    started = time.monotonic()
    trie, sglang_cpu, cpu_verify, paths = load_project()
    table = Table()
    attention_cases(table, trie, paths, sglang_cpu, size, args.device, args.seed)
    decoder_cases(table, trie, cpu_verify.walk_tree, paths, size, args.device, args.seed, sglang_cpu)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"Tree verify of NGRAM drafts on {device}, torch {torch.__version__}, verify width n={size['n']}, "
          f"prefix lengths {size['prefixes']}. Attention rows: max |path - dense fp32 reference| ('!': over the "
          "tolerance); decoder rows: max logits error, greedy tokens matched.")
    table.print(["case", "drafts", "reference", "fa3 topk>1 (two-pass)", "cpu engine (sglang/cpu/verify.py)",
                 "fa3 topk<=1 (causal, no mask)", "verdict"])
    for failure in table.failures:
        print(f"MISMATCH {failure}")
    print(f"{len(table.rows) - len(table.failures)}/{len(table.rows)} cases ok in {time.monotonic() - started:.0f} s")
    return 1 if table.failures else 0


if __name__ == "__main__":
    sys.exit(main())
