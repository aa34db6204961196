"""The TARGET_VERIFY branch SGLang 0.5.23's torch-native attention backend lacks.

`TorchNativeAttnBackend.forward_extend` (`srt/layers/attention/torch_native_backend.py`) handles prefill only: a
speculative verify batch carries no `extend_prefix_lens`, so every NGRAM step on a CPU without AMX fails with
`AttributeError: 'NoneType' object has no attribute 'shape'`. What `intel_amx_backend.py` does for verify is the
model here: write the drafts' K/V at `out_cache_loc`, then let each draft token attend the request's whole committed
prefix plus its own ancestors in the draft tree (`spec_info.custom_mask`, on CPU the per-request n x n QLEN mask:
row i marks the nodes i may attend, itself included).

`patch(module)` wraps the class's `forward_extend` after SGLang's module is imported (no SGLang file is edited); the
wrapper sends TARGET_VERIFY batches to `verify_forward_extend` and everything else to the original. Tied to 0.5.23's
internal signatures: the launcher refuses any other SGLang version.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention

__all__ = ["patch", "tree_verify_attention", "verify_forward_extend"]


def tree_verify_attention(query: torch.Tensor, output: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                          tree_mask: torch.Tensor, draft_token_num: int, scaling: float | None = None,
                          enable_gqa: bool = False) -> torch.Tensor:
    """Attention of every request's `draft_token_num` draft tokens over its prefix + drafts, masked by the tree.

    query/output: [bs * n, heads, dim]; k_cache/v_cache: [slots, kv_heads, dim] holding the drafts' K/V already;
    req_to_token[req_pool_indices[b], :seq_lens[b] + n] = the request's slots (prefix, then its n drafts);
    seq_lens: committed prefix lengths (drafts excluded); tree_mask: bool [bs * n * n] (QLEN layout)."""
    n = draft_token_num
    batch = int(seq_lens.shape[0])
    if tree_mask.numel() != batch * n * n:
        raise ValueError(f"verify: tree mask has {tree_mask.numel()} entries, expected {batch} x {n} x {n} "
                         "(QLEN layout); a FULL_MASK layout is not produced on CPU")
    masks = tree_mask.reshape(batch, n, n).to(torch.bool)
    for b in range(batch):
        prefix = int(seq_lens[b])
        slots = req_to_token[int(req_pool_indices[b]), : prefix + n].to(torch.int64)
        key = k_cache[slots].movedim(0, 1).unsqueeze(0)  # [1, kv_heads, prefix + n, dim]
        value = v_cache[slots].movedim(0, 1).unsqueeze(0)
        q = query[b * n:(b + 1) * n].movedim(0, 1).unsqueeze(0)  # [1, heads, n, dim]
        if key.dtype != q.dtype:
            key, value = key.to(q.dtype), value.to(q.dtype)
        allowed = torch.ones((n, prefix + n), dtype=torch.bool)
        allowed[:, prefix:] = masks[b]
        out = scaled_dot_product_attention(q, key, value, attn_mask=allowed, scale=scaling, enable_gqa=enable_gqa)
        output[b * n:(b + 1) * n] = out.squeeze(0).movedim(0, 1)
    return output


def verify_forward_extend(backend: Any, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                          layer: Any, forward_batch: Any, save_kv_cache: bool = True,
                          kv_write_loc: Any = None) -> torch.Tensor:
    """`forward_extend` of a TARGET_VERIFY batch, as the torch-native backend would run it if it had the branch.
    `kv_write_loc` is SGLang's `KVWriteLoc` class (from the backend's module)."""
    if layer.is_cross_attention or (layer.sliding_window_size is not None and layer.sliding_window_size > -1):
        raise NotImplementedError("speculative verify on SGLang's CPU torch-native backend: cross-attention and "
                                  "sliding-window layers are not supported by specdec-tuner's verify branch")
    if layer.qk_head_dim != layer.v_head_dim:
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
    else:
        o = torch.empty_like(q)
    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, kv_write_loc(forward_batch.out_cache_loc, backend.swa_out_cache_loc), k, v)
    spec = forward_batch.spec_info
    tree_verify_attention(
        q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), o.view(-1, layer.tp_q_head_num, layer.v_head_dim),
        backend.token_to_kv_pool.get_key_buffer(layer.layer_id),
        backend.token_to_kv_pool.get_value_buffer(layer.layer_id),
        backend.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
        spec.custom_mask, int(spec.draft_token_num), scaling=layer.scaling,
        enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num)
    return o


def patch(module: ModuleType) -> None:
    """Give `module.TorchNativeAttnBackend` (SGLang's torch_native_backend module) its TARGET_VERIFY branch. Once."""
    cls = module.TorchNativeAttnBackend
    original = cls.forward_extend
    if getattr(original, "specdec_verify_branch", False):
        return
    kv_write_loc = module.KVWriteLoc

    def forward_extend(self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
                       save_kv_cache: bool = True, **kwargs: Any) -> Any:
        if forward_batch.forward_mode.is_target_verify():
            return verify_forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache, kv_write_loc)
        return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    forward_extend.specdec_verify_branch = True  # type: ignore[attr-defined]
    cls.forward_extend = forward_extend
