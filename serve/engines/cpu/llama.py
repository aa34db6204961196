"""A hand-written forward for Llama-family decoders (Llama, and Qwen2 without sliding-window layers) over fused
weights, with a preallocated KV cache. `ModelRunner` uses it for every model it accepts (`unsupported_reason`) and
HF's own modules for the rest (Gemma 3).

Why: a decode step of a 135M model is a few dozen small ops per layer; HF's generic modules add mask building, cache
bookkeeping (a `torch.cat` of the whole history per layer and step), hooks and kwargs plumbing around each of them,
which made plain decoding about half per-op overhead on 2 cores. Here a layer is: fused RMSNorm, one QKV matmul, one
RoPE pass over queries and keys together, two in-place cache writes, one SDPA call (GQA inside the kernel), the output
projection, fused RMSNorm, one gate/up matmul, SiLU * up, the down projection.

Numerics follow HF's Llama ops (RMSNorm in fp32, RoPE table computed as HF does, SDPA with an explicit additive mask
for every query and the model's scale), so fp32 greedy outputs are the ones the HF path produced; the equivalence
tests check that on a tiny random Llama against HF's full forward and on SmolLM2-135M.

Weights: `qkv` = [q; k; v] rows, `gate_up` = [gate; up] rows. Built from an HF module (`from_hf`: the module's own
parameters are re-pointed to views of the fused tensors, so memory is not doubled and the module keeps working) or
straight from a safetensors dir (`from_dir`: no transformers modeling import, no `from_pretrained`; what the engine
uses to start fast).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import torch
import torch.nn.functional as F

__all__ = ["FORWARD_VERSION", "KERNEL_MAX_ROWS", "BlockWeight", "LlamaShape", "LlamaForward", "KVCache", "Query",
           "unsupported_reason"]

FORWARD_VERSION = 2  # part of the verify-cost cache key (probe.py): bump when the forward's cost profile changes
# (2: small products may run on the GGUF kernel, `use_gguf`; the weights mode is in the key as well)

# Products of at most this many rows run on the GGUF kernel once `use_gguf` ran; larger ones (prefill) on F.linear
# over the fp32 tensors. Measured per linear on a 2-core AVX-512 box (`benchmarks/q4_linear.py linear` at commit 04695d1), with both
# kernel builds: the kernel is 1.5-3.4x MKL's fp32 up to 16 rows, ~1.0x at 24, 0.8-0.95x at 32.
KERNEL_MAX_ROWS = 24

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
_MIN_CAPACITY = 256  # KV columns allocated at least: a prompt plus a few hundred tokens without a regrow


def unsupported_reason(config: Mapping[str, Any]) -> str | None:
    """Why the fast forward cannot run a model with this `config.json` content, or None if it can."""
    archs = list(config.get("architectures") or [])
    model_type = config.get("model_type")
    if model_type not in ("llama", "qwen2") or (archs and archs[0] not in ARCHITECTURES):
        return f"architecture {archs or model_type} (fast path: {', '.join(ARCHITECTURES)})"
    if config.get("hidden_act", "silu") != "silu":
        return f"hidden_act {config.get('hidden_act')!r}"
    if config.get("mlp_bias"):
        return "mlp_bias"
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope_type {rope.get('rope_type', rope.get('type'))!r}"
    layer_types = config.get("layer_types") or []
    if config.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
        return "sliding-window layers"
    return None


@dataclass(frozen=True)
class LlamaShape:
    """What the forward needs from `config.json`."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    attention_bias: bool  # Qwen2: q/k/v have biases, o does not
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, c: Mapping[str, Any]) -> LlamaShape:
        reason = unsupported_reason(c)
        if reason is not None:
            raise ValueError(f"model: the fast Llama forward does not support {reason}")
        heads = int(c["num_attention_heads"])
        rope = c.get("rope_parameters") or {}
        return cls(
            vocab_size=int(c["vocab_size"]), hidden_size=int(c["hidden_size"]),
            num_layers=int(c["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
            intermediate_size=int(c["intermediate_size"]), rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            max_position_embeddings=int(c.get("max_position_embeddings") or 4096),
            attention_bias=bool(c.get("attention_bias", c.get("model_type") == "qwen2")),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        )


class KVCache:
    """Keys and values of every layer in two preallocated tensors [layers, kv_heads, capacity, head_dim]; columns
    [0, length) are valid. Grows by doubling (one copy), so a forward never concatenates history."""

    __slots__ = ("keys", "values", "length")

    def __init__(self, shape: LlamaShape, dtype: torch.dtype, capacity: int = 0) -> None:
        self.length = 0
        self.keys = self.values = torch.empty(0)
        self._allocate(shape, dtype, max(capacity, _MIN_CAPACITY))

    def _allocate(self, shape: LlamaShape, dtype: torch.dtype, capacity: int) -> None:
        dims = (shape.num_layers, shape.num_kv_heads, capacity, shape.head_dim)
        keys, values = torch.empty(dims, dtype=dtype), torch.empty(dims, dtype=dtype)
        if self.length:
            keys[:, :, :self.length] = self.keys[:, :, :self.length]
            values[:, :, :self.length] = self.values[:, :, :self.length]
        self.keys, self.values = keys, values

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[2])

    def reserve(self, shape: LlamaShape, columns: int) -> None:
        if columns > self.capacity:
            self._allocate(shape, self.keys.dtype, max(columns, 2 * self.capacity))

    def keep(self, base: int, keep_rel: Sequence[int]) -> None:
        """Keep columns [0, base) + base+keep_rel (increasing): kept rows move down in place, the rest is dropped."""
        k = len(keep_rel)
        if list(keep_rel) != list(range(k)):
            idx = torch.tensor([base + r for r in keep_rel], dtype=torch.long)
            # index_select copies first, so overlapping source and destination columns are safe
            self.keys[:, :, base:base + k] = self.keys.index_select(2, idx)
            self.values[:, :, base:base + k] = self.values.index_select(2, idx)
        self.length = base + k


@dataclass(frozen=True)
class Query:
    """One request's part of a forward: `token_ids` [N] at `positions` [N] after the `cache`'s columns, under an
    additive `mask` [N, P+N] (None: plain causal attention over an empty cache)."""

    cache: KVCache
    token_ids: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor | None


class LlamaForward:
    """The model as plain tensors. Not thread-safe: one worker thread drives it (as `ModelRunner`)."""

    def __init__(self, shape: LlamaShape, weights: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 generation_config: Any = None) -> None:
        self.shape = shape
        self.dtype = dtype
        self.generation_config = generation_config
        s = shape
        self.q_size = s.num_heads * s.head_dim
        self.kv_size = s.num_kv_heads * s.head_dim
        self.scale = s.head_dim ** -0.5
        self.embed = weights["model.embed_tokens.weight"]
        head = weights.get("lm_head.weight")
        self.head = self.embed if head is None or s.tie_word_embeddings else head
        self.final_norm = weights["model.norm.weight"]
        self.layers = [_layer(weights, f"model.layers.{i}.", s) for i in range(s.num_layers)]
        self._rope_tables(_MIN_CAPACITY * 8)
        # GGUF blocks per layer (qkv, o, gate_up, down) and of the head, used for products of <= KERNEL_MAX_ROWS
        # rows once `use_gguf` ran; the fp32 tensors stay for prefill (the kernel is compute-bound at large M).
        self.kernel: Any = None
        self._gguf: list[tuple[BlockWeight, BlockWeight, BlockWeight, BlockWeight]] = []
        self._gguf_head: BlockWeight | None = None

    def use_gguf(self, weights: Mapping[str, BlockWeight], kernel: Any) -> None:
        """Run small products on `kernel` over `weights` (`gguf_linear.model_weights`: the same values as the fp32
        tensors, bit for bit). Checks that every weight has its tensor's shape."""
        if self.dtype != torch.float32:
            raise ValueError(f"use_gguf: the kernel computes in float32, the forward is {self.dtype}")
        for i, layer in enumerate(self.layers):
            for name in ("qkv", "o", "gate_up", "down"):
                want = tuple(getattr(layer, name).shape)
                if weights[f"{i}.{name}"].shape != want:
                    raise ValueError(f"use_gguf: {i}.{name} is {weights[f'{i}.{name}'].shape} in the GGUF, {want} "
                                     "in the model dir (not the same model)")
        if weights["head"].shape != tuple(self.head.shape):
            raise ValueError(f"use_gguf: head is {weights['head'].shape} in the GGUF, {tuple(self.head.shape)} here")
        self._gguf = [tuple(weights[f"{i}.{n}"] for n in ("qkv", "o", "gate_up", "down"))  # type: ignore[misc]
                      for i in range(len(self.layers))]
        self._gguf_head = weights["head"]
        self.kernel = kernel

    def _linear(self, x: torch.Tensor, w: torch.Tensor, q: BlockWeight | None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        if q is None or x.shape[0] > KERNEL_MAX_ROWS:
            return F.linear(x, w, bias)
        y = q.matmul(self.kernel, x)
        return y if bias is None else y + bias

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_hf(cls, model: Any) -> LlamaForward:
        """From a loaded HF LlamaForCausalLM / Qwen2ForCausalLM. Its q/k/v and gate/up parameters become views of
        the fused tensors (same values), so the HF module still runs and no weight is held twice."""
        config = model.config.to_dict()
        shape = LlamaShape.from_config(config)
        dtype = next(model.parameters()).dtype
        weights = {name: p.detach() for name, p in model.named_parameters()}
        weights.setdefault("lm_head.weight", model.get_output_embeddings().weight.detach())
        forward = cls(shape, weights, dtype, getattr(model, "generation_config", None))
        for layer, hf in zip(forward.layers, model.model.layers):
            attn, mlp = hf.self_attn, hf.mlp
            q, k, v = layer.qkv.split([forward.q_size, forward.kv_size, forward.kv_size])
            attn.q_proj.weight.data, attn.k_proj.weight.data, attn.v_proj.weight.data = q, k, v
            if layer.qkv_bias is not None:
                qb, kb, vb = layer.qkv_bias.split([forward.q_size, forward.kv_size, forward.kv_size])
                attn.q_proj.bias.data, attn.k_proj.bias.data, attn.v_proj.bias.data = qb, kb, vb
            gate, up = layer.gate_up.split([shape.intermediate_size, shape.intermediate_size])
            mlp.gate_proj.weight.data, mlp.up_proj.weight.data = gate, up
        return forward

    @classmethod
    def from_dir(cls, model_dir: Path, dtype: torch.dtype) -> LlamaForward:
        """From an HF dir holding safetensors (one file or an index of shards), without building an HF module."""
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        shape = LlamaShape.from_config(config)
        index = model_dir / "model.safetensors.index.json"
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
                 else ["model.safetensors"])
        weights: dict[str, torch.Tensor] = {}
        for name in files:
            weights.update(load_file(str(model_dir / name)))
        weights = {k: (v if v.dtype == dtype else v.to(dtype)) for k, v in weights.items()}
        return cls(shape, weights, dtype, _generation_config(model_dir))

    def _rope_tables(self, positions: int) -> None:
        # As HF's default rotary embedding: inv_freq in fp32, freqs = position * inv_freq, cat(freqs, freqs).
        # rotate_half(x) * sin == roll(x, half) * [-sin_half, sin_half] exactly (a sign flip is exact).
        dim = self.shape.head_dim
        inv_freq = 1.0 / (self.shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos().to(self.dtype)
        sin = emb.sin().to(self.dtype)
        self._sin = torch.cat((-sin[:, : dim // 2], sin[:, dim // 2:]), dim=-1)

    # ------------------------------------------------------------------ cache

    def new_cache(self, capacity: int = 0) -> KVCache:
        return KVCache(self.shape, self.dtype, capacity)

    # ------------------------------------------------------------------ forward

    def forward(self, cache: KVCache, token_ids: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """Hidden states [N, d] (after the final norm) of `token_ids` [N] at `positions` [N]; appends N cache
        columns. `mask` is an additive [N, P+N] mask, or None for plain causal attention over an empty cache."""
        return self.forward_many([Query(cache, token_ids, positions, mask)])[0]

    def forward_many(self, queries: Sequence[Query]) -> list[torch.Tensor]:
        """One forward for several requests (each with its own cache): the hidden states [N_i, d] of each.

        Every weight matmul runs once over all requests' rows stacked, so the weights are read once per round
        instead of once per request (what makes a batched decode step cheaper per token, as on a GPU); attention
        runs per request against its own cache. A failure leaves every cache's `length` as it was."""
        s = self.shape
        sizes = [int(q.token_ids.shape[0]) for q in queries]
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        total = bounds[-1]
        token_ids = torch.cat([q.token_ids for q in queries]) if len(queries) > 1 else queries[0].token_ids
        positions = torch.cat([q.positions for q in queries]) if len(queries) > 1 else queries[0].positions
        for q, n in zip(queries, sizes):
            q.cache.reserve(s, q.cache.length + n)
        top = int(positions.max()) + 1
        if top > self._cos.shape[0]:
            self._rope_tables(max(top, 2 * self._cos.shape[0]))
        cos = self._cos[positions][:, None, :]  # [T, 1, hd]: broadcast over heads
        sin = self._sin[positions][:, None, :]
        masks = [None if q.mask is None else q.mask[None, None] for q in queries]
        heads_qk = s.num_heads + s.num_kv_heads
        half = s.head_dim // 2
        x = F.embedding(token_ids, self.embed)
        attn_out = torch.empty(total, self.q_size, dtype=self.dtype)
        for i, layer in enumerate(self.layers):
            qw, ow, guw, dw = self._gguf[i] if self._gguf else (None, None, None, None)
            h = torch.rms_norm(x, (s.hidden_size,), layer.in_norm, s.rms_norm_eps)
            qkv = self._linear(h, layer.qkv, qw, layer.qkv_bias).view(total, heads_qk + s.num_kv_heads, s.head_dim)
            qk = qkv[:, :heads_qk]
            qk = qk * cos + torch.roll(qk, half, -1) * sin
            for j, query in enumerate(queries):
                a, b = bounds[j], bounds[j + 1]
                n, start = b - a, query.cache.length
                end = start + n
                keys, values = query.cache.keys, query.cache.values
                keys[i, :, start:end] = qk[a:b, s.num_heads:].transpose(0, 1)
                values[i, :, start:end] = qkv[a:b, heads_qk:].transpose(0, 1)
                attn = F.scaled_dot_product_attention(
                    qk[a:b, :s.num_heads].transpose(0, 1)[None], keys[i, :, :end][None], values[i, :, :end][None],
                    attn_mask=masks[j], is_causal=masks[j] is None and n > 1, scale=self.scale, enable_gqa=True)
                attn_out[a:b] = attn[0].transpose(0, 1).reshape(n, self.q_size)
            x = x + self._linear(attn_out, layer.o, ow)
            h = torch.rms_norm(x, (s.hidden_size,), layer.post_norm, s.rms_norm_eps)
            gate_up = self._linear(h, layer.gate_up, guw)
            x = x + self._linear(F.silu(gate_up[:, :s.intermediate_size]) * gate_up[:, s.intermediate_size:],
                                 layer.down, dw)
        for query, n in zip(queries, sizes):
            query.cache.length += n
        out = torch.rms_norm(x, (s.hidden_size,), self.final_norm, s.rms_norm_eps)
        return [out[bounds[j]:bounds[j + 1]] for j in range(len(queries))]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._linear(hidden, self.head, self._gguf_head)


class BlockWeight(Protocol):
    """A weight [N, K] the GGUF kernel multiplies by (`gguf_linear.GgufWeight`)."""

    @property
    def shape(self) -> tuple[int, int]: ...

    def matmul(self, kernel: Any, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class _Layer:
    in_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def _layer(w: Mapping[str, torch.Tensor], p: str, s: LlamaShape) -> _Layer:
    a, m = p + "self_attn.", p + "mlp."
    bias = None
    if s.attention_bias:
        bias = torch.cat([w[a + "q_proj.bias"], w[a + "k_proj.bias"], w[a + "v_proj.bias"]])
    return _Layer(
        in_norm=w[p + "input_layernorm.weight"],
        qkv=torch.cat([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]]),
        qkv_bias=bias, o=w[a + "o_proj.weight"], post_norm=w[p + "post_attention_layernorm.weight"],
        gate_up=torch.cat([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]]), down=w[m + "down_proj.weight"])


def _generation_config(model_dir: Path) -> SimpleNamespace:
    """The part of generation_config.json the engine reads (EOS ids), without importing transformers."""
    path = model_dir / "generation_config.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    return SimpleNamespace(eos_token_id=data.get("eos_token_id"))
