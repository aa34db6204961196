"""Decode matmuls straight from a model's GGUF blocks (Q4_1 / Q8_0), with weights bit-identical to the engine's
dequantized fp32 tensors.

Why: plain fp32 decode of SmolLM2-135M reads 538 MB of weights per token and sits at the memory-bandwidth floor;
its GGUF holds the same weights in 96 MB (Q4_1 for the 210 layer linears, Q8_0 for the tied LM head). The kernel
(`csrc/gguf_mm.cpp`) forms every weight exactly (`fma(q, d, m)` in fp32, as the conversion did) and sums x * w in
fp32, in an order that depends only on the row itself: a row computed among M rows equals the row alone, and 1
thread equals 2 (fp32 `F.linear` has neither property). It is compute-bound, so only small-M products use it
(decode, verify, drafting: `llama.KERNEL_MAX_ROWS`); prefill stays on `F.linear` over the fp32 tensors.

The kernel is C++ built once per machine with `torch.utils.cpp_extension.load` (g++, ninja; ~25-30 s) under
`cache_root()/kernels/` and kept by its content (`kernel_store`: another venv with the same Python and torch imports it
without building), one build per ISA, the ISA in the extension's name: AVX-512 (16 lanes) where torch reports
it, else AVX2 + FMA + F16C (8 lanes), else none. `SPECDEC_GGUF_KERNEL` overrides the choice: `off` disables the
kernel (as on a machine without it), `avx2` / `avx512` force a build.

`python -m serve.engines.cpu.gguf_linear build [MODEL_DIR ...]` builds it now and caches each model dir's blocks
(`models fetch` runs it); prints the ISA and each model's weights mode, or why not.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from serve.engines.cpu import kernel_store
from serve.engines.cpu.llama import KERNEL_MAX_ROWS, LlamaShape, unsupported_reason
from serve.model_store import SOURCE_MARKER

__all__ = ["GgufWeight", "KernelUnavailable", "WeightsError", "WeightsChoice", "KERNEL_ENV",
           "WEIGHTS_MODES", "choose_weights", "resolve_weights", "gguf_source", "cached_model_weights", "prepare_dir",
           "kernel_isa", "load_kernel", "read_gguf_weights", "model_weights",
           "unpermute_rows", "main"]

WEIGHTS_MODES: tuple[str, ...] = ("auto", "fp32", "gguf")
KERNEL_ENV = "SPECDEC_GGUF_KERNEL"
SOURCE = Path(__file__).with_name("csrc") / "gguf_mm.cpp"
_ISA_FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"],
              "avx2": ["-mavx2", "-mfma", "-mf16c"]}
BLOCKS_FILE = "gguf-blocks.safetensors"  # the forward's weights as GGUF blocks, next to the converted safetensors
_BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}  # per 32 weights: fp16 d (+ fp16 m) + packed q


class KernelUnavailable(RuntimeError):
    """This machine cannot run the kernel (ISA, compiler, disabled); the message says why."""


class WeightsError(ValueError):
    """`weights: gguf` was asked for but cannot be used for this model on this machine; the message says why and
    what to do."""


@dataclass(frozen=True)
class GgufWeight:
    """One weight [N, K] as GGUF blocks of 32 along K, rows in the engine's (HF) order: `qs` uint8 [N, K/32, 16
    (Q4_1) or 32 (Q8_0)], `d` and `m` fp16 [N, K/32] (`m` None for Q8_0)."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def kind(self) -> str:
        return "Q8_0" if self.m is None else "Q4_1"

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.qs.shape[0]), int(self.qs.shape[1]) * 32

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K] as the conversion computed it (q * d is exact, so adding m rounds once, as one FMA)."""
        if self.m is None:
            q = self.qs.view(torch.int8).float()
            return (q * self.d.float()[..., None]).reshape(self.shape)
        q = torch.cat([self.qs & 15, self.qs >> 4], -1).float()  # byte j: q_j low nibble, q_{j+16} high
        return (q * self.d.float()[..., None] + self.m.float()[..., None]).reshape(self.shape)

    @staticmethod
    def cat(parts: list[GgufWeight]) -> GgufWeight:
        """Row-wise concatenation (the forward's fused qkv and gate_up)."""
        ms = [p.m for p in parts]
        m = None if any(x is None for x in ms) else torch.cat([x for x in ms if x is not None])
        if m is None and any(x is not None for x in ms):
            raise ValueError("GgufWeight.cat: parts mix Q4_1 and Q8_0")
        return GgufWeight(torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m)

    def matmul(self, kernel: Any, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] fp32 @ W^T -> [M, N] fp32."""
        x = x.contiguous()
        if self.m is None:
            return kernel.q8_0_mm(x, self.qs, self.d)
        return kernel.q4_1_mm(x, self.qs, self.d, self.m)


def unpermute_rows(a: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows permuted for its RoPE; HF's GGUF loader undoes it, so the engine's tensors have HF's
    row order. Whole rows move (the blocks run along K), so blocks can be un-permuted as they are."""
    half = a.shape[0] // heads // 2
    return a.reshape(heads, half, 2, *a.shape[1:]).swapaxes(2, 1).reshape(a.shape)


def read_gguf_weights(gguf_path: Path, heads: int, kv_heads: int) -> tuple[dict[str, GgufWeight], dict[str, str]]:
    """(GGUF tensor name -> GgufWeight in HF row order for every Q4_1 / Q8_0 tensor, name -> type of the others)."""
    import gguf

    out: dict[str, GgufWeight] = {}
    others: dict[str, str] = {}
    for t in gguf.GGUFReader(str(gguf_path)).tensors:
        kind = t.tensor_type.name
        if kind not in _BLOCK_BYTES:
            others[t.name] = kind
            continue
        raw = np.asarray(t.data).reshape(t.data.shape[0], -1, _BLOCK_BYTES[kind])
        if ".attn_q." in t.name or ".attn_k." in t.name:
            raw = unpermute_rows(raw, heads if ".attn_q." in t.name else kv_heads)
        d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0])
        if kind == "Q4_1":
            m = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0])
            out[t.name] = GgufWeight(torch.from_numpy(raw[..., 4:].copy()), d, m)
        else:
            out[t.name] = GgufWeight(torch.from_numpy(raw[..., 2:].copy()), d, None)
    return out, others


def model_weights(blocks: Mapping[str, GgufWeight], others: Mapping[str, str], num_layers: int,
                  tied: bool) -> dict[str, GgufWeight]:
    """The forward's matmul weights as GgufWeights, keyed `{i}.qkv`, `{i}.o`, `{i}.gate_up`, `{i}.down` and `head`,
    in the forward's fused row order. KernelUnavailable (naming the tensor and its type) if one is not Q4_1 / Q8_0
    or its shape does not fit the kernel (K % 32, N % 8)."""
    names: dict[str, list[str]] = {}
    for i in range(num_layers):
        b = f"blk.{i}."
        names[f"{i}.qkv"] = [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"]
        names[f"{i}.o"] = [b + "attn_output.weight"]
        names[f"{i}.gate_up"] = [b + "ffn_gate.weight", b + "ffn_up.weight"]
        names[f"{i}.down"] = [b + "ffn_down.weight"]
    names["head"] = ["token_embd.weight" if tied or "output.weight" not in {**blocks, **others} else "output.weight"]
    out: dict[str, GgufWeight] = {}
    for key, parts in names.items():
        missing = [p for p in parts if p not in blocks]
        if missing:
            kind = others.get(missing[0], "absent")
            raise KernelUnavailable(f"GGUF tensor {missing[0]} is {kind} (the kernel reads Q4_1 and Q8_0 only)")
        kinds = {blocks[p].kind for p in parts}
        if len(kinds) > 1:
            raise KernelUnavailable(f"GGUF tensors {', '.join(parts)} mix {' and '.join(sorted(kinds))}")
        w = GgufWeight.cat([blocks[p] for p in parts]) if len(parts) > 1 else blocks[parts[0]]
        if w.shape[0] % 8:
            raise KernelUnavailable(f"GGUF tensor(s) {', '.join(parts)}: {w.shape[0]} rows, not a multiple of 8")
        out[key] = w
    return out


def gguf_source(model_dir: Path) -> Path | None:
    """The GGUF a converted model dir was made from (`models.SOURCE_MARKER`), None for a plain HF dir."""
    marker = Path(model_dir) / SOURCE_MARKER
    try:
        source = json.loads(marker.read_text()).get("gguf")
    except (OSError, ValueError):
        return None
    return Path(source) if source and Path(source).is_file() else None


def cached_model_weights(model_dir: Path, gguf_path: Path, num_heads: int, num_kv_heads: int, num_layers: int,
                         tied: bool) -> dict[str, GgufWeight]:
    """`model_weights` of the GGUF, kept as `BLOCKS_FILE` in the converted model dir: gguf's reader parses every
    metadata field (the 49k-token vocabulary too) in ~3-4 s, the safetensors reload takes ~0.1 s. The file records
    the GGUF's size and mtime and is rewritten when they change."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    stat = gguf_path.stat()
    stamp = {"format": "1", "gguf": str(gguf_path), "gguf_size": str(stat.st_size),
             "gguf_mtime_ns": str(stat.st_mtime_ns)}
    path = Path(model_dir) / BLOCKS_FILE
    if path.exists():
        with safe_open(str(path), "pt") as handle:
            if handle.metadata() == stamp:
                flat = {k: handle.get_tensor(k) for k in handle.keys()}
                return {key: GgufWeight(flat[key + ".qs"], flat[key + ".d"], flat.get(key + ".m"))
                        for key in {k.rsplit(".", 1)[0] for k in flat}}
    blocks, others = read_gguf_weights(gguf_path, num_heads, num_kv_heads)
    weights = model_weights(blocks, others, num_layers, tied)
    flat = {}
    for key, w in weights.items():
        flat[key + ".qs"], flat[key + ".d"] = w.qs, w.d
        if w.m is not None:
            flat[key + ".m"] = w.m
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(flat, str(tmp), metadata=stamp)
        os.replace(tmp, path)  # atomic: a concurrent engine reads the old file or the new one
    except OSError:
        tmp.unlink(missing_ok=True)  # a read-only model dir: use the blocks without caching them
    return weights


# ------------------------------------------------------------------------------------------------------ the kernel

def kernel_isa() -> tuple[str | None, str]:
    """(the build this machine runs: "avx512", "avx2" or None, why). Pure apart from reading the environment and
    torch's CPU capability (which follows `ATEN_CPU_CAPABILITY` too)."""
    forced = os.environ.get(KERNEL_ENV, "").strip().lower()
    if forced in ("off", "0", "none", "false"):
        return None, f"disabled by {KERNEL_ENV}={forced}"
    capability = torch.backends.cpu.get_cpu_capability()  # "AVX512", "AVX2", "DEFAULT", "ZVECTOR", ...
    have = {"AVX512": ["avx512", "avx2"], "AVX2": ["avx2"]}.get(capability, [])
    if "avx2" in have and not _cpu_flag("f16c"):
        have = []
    if forced in _ISA_FLAGS:
        if forced not in have:
            return None, f"{KERNEL_ENV}={forced}, but this CPU offers {capability} (torch's view)"
        return forced, f"forced by {KERNEL_ENV}={forced}"
    if forced not in ("", "auto"):
        return None, f"{KERNEL_ENV}={forced!r} is not one of auto, avx512, avx2, off"
    if not have:
        return None, f"CPU capability {capability}: the kernel needs AVX-512 or AVX2 with FMA and F16C"
    return have[0], f"CPU capability {capability}"


def _cpu_flag(flag: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True  # no /proc (not Linux): torch's capability check stands alone
    return any(flag in line.split() for line in text.splitlines() if line.startswith("flags"))


_LOADED: dict[str, Any] = {}
_LOAD_LOCK = threading.Lock()


def build_folder(isa: str) -> str:
    return f"gguf_mm_{isa}"


def load_kernel(verbose: bool = False) -> tuple[Any, str]:
    """(the loaded extension, its ISA): the build kept for this source, flags, Python and torch (any venv's), else
    built now (torch's file lock in the build dir serialises concurrent builds of several engines).
    KernelUnavailable with the reason if this machine cannot run it."""
    isa, why = kernel_isa()
    if isa is None:
        raise KernelUnavailable(why)
    with _LOAD_LOCK:
        if isa not in _LOADED:
            try:
                _LOADED[isa] = kernel_store.load_or_build(
                    f"specdec_gguf_mm_{isa}", SOURCE,
                    # -fopenmp: at::parallel_for is inlined from ATen's OpenMP header, serial without it;
                    # -ffp-contract=off: only the FMAs written in the source, so both builds' sums are as written
                    ["-O3", "-fopenmp", "-ffp-contract=off", *_ISA_FLAGS[isa]], ["-fopenmp"], build_folder(isa),
                    verbose)
            except Exception as err:  # compiler or ninja missing, build error: the reason is the message
                text = " ".join(str(err).split())
                raise KernelUnavailable(f"building the {isa} kernel in {kernel_store.build_dir(build_folder(isa))} "
                                        f"failed: {text[-600:]} (needs g++ and ninja: pip install ninja)") from err
    return _LOADED[isa], isa


# ------------------------------------------------------------------------------------------------------ the choice

@dataclass(frozen=True)
class WeightsChoice:
    """What the engine runs its decode matmuls on: `mode` "gguf" or "fp32", `isa` of the kernel (None for fp32),
    and why (for the log and /server_info)."""

    requested: str
    mode: Literal["fp32", "gguf"]
    isa: str | None
    reason: str


def choose_weights(requested: str, problem: str | None, isa: str | None = None) -> WeightsChoice:
    """Pure: `problem` is why the kernel cannot serve this model here (None: it can). `auto` falls back to fp32 with
    the problem as the reason; `gguf` raises WeightsError with it."""
    if requested not in WEIGHTS_MODES:
        raise WeightsError(f"--weights: {requested!r} is not one of {', '.join(WEIGHTS_MODES)}")
    if requested == "fp32":
        return WeightsChoice(requested, "fp32", None, "requested (--weights fp32)")
    if problem is None:
        return WeightsChoice(requested, "gguf", isa, f"GGUF Q4_1/Q8_0 kernel ({isa}) for products of <= "
                             f"{KERNEL_MAX_ROWS} rows, fp32 F.linear above")
    if requested == "gguf":
        raise WeightsError(f"--weights gguf: {problem}. Fix: use --weights auto (falls back to fp32) or fp32")
    return WeightsChoice(requested, "fp32", None, f"fp32 fallback: {problem}")


def resolve_weights(requested: str, model_dir: Path, shape: LlamaShape | None, dtype: str
                    ) -> tuple[WeightsChoice, dict[str, GgufWeight] | None, Any]:
    """(the choice, the forward's GGUF weights, the kernel) for a model dir: the weights and kernel are None unless
    the choice is gguf. `shape` is the fast forward's `LlamaShape`, None for a model on HF modules. Builds the
    kernel on first use (~25-30 s once per machine). WeightsError for `gguf` when it cannot be used."""
    if requested == "fp32":
        return choose_weights(requested, None), None, None
    problem: str | None = None
    source = gguf_source(model_dir)
    if shape is None:
        problem = "the model runs on HF's modules (the kernel serves the fast Llama forward only)"
    elif dtype != "float32":
        problem = f"--dtype {dtype} (the kernel computes in float32)"
    elif source is None:
        problem = f"{model_dir} was not converted from a GGUF file (no {SOURCE_MARKER} naming one)"
    kernel, isa, weights = None, None, None
    if problem is None and source is not None and shape is not None:
        try:
            kernel, isa = load_kernel()
            weights = cached_model_weights(model_dir, source, shape.num_heads, shape.num_kv_heads, shape.num_layers,
                                           shape.tie_word_embeddings)
        except KernelUnavailable as err:
            problem = str(err)
    choice = choose_weights(requested, problem, isa)
    return (choice, weights, kernel) if choice.mode == "gguf" else (choice, None, None)


def prepare_dir(model_dir: Path, requested: str = "auto") -> WeightsChoice:
    """`resolve_weights` for a model dir from its config.json alone (no fp32 load): builds the kernel and caches the
    dir's blocks where the choice is gguf."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shape = LlamaShape.from_config(config) if unsupported_reason(config) is None else None
    return resolve_weights(requested, Path(model_dir), shape, "float32")[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serve.engines.cpu.gguf_linear", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("build",), help="build the kernel for this machine now (cached)")
    parser.add_argument("model_dirs", nargs="*", metavar="MODEL_DIR",
                        help="converted model dirs whose GGUF blocks to cache too (`models path ID` prints one)")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    try:
        kernel, isa = load_kernel(verbose=args.verbose)
    except KernelUnavailable as err:
        print(f"gguf kernel: not available here (engines use fp32 weights): {err}", file=sys.stderr)
        return 1
    print(f"gguf kernel: {isa} ({kernel.lanes()} lanes) from {kernel.__file__}")
    for model_dir in args.model_dirs:
        choice = prepare_dir(Path(model_dir))
        print(f"gguf kernel: {model_dir}: weights {choice.mode} ({choice.reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
