"""Torch stand-ins for the `sgl_kernel` CPU ops that SGLang 0.5.23's CPU path calls (`from sgl_kernel import X_cpu`).

The CPU build of sgl-kernel is not on PyPI (the PyPI `sgl-kernel`/`sglang-kernel` wheels are CUDA builds), so SGLang's
own server needs these to run on a CPU machine. Each function has the semantics of the C++ op of the same name in
sgl-kernel's `csrc/cpu/spec.cpp` and `csrc/cpu/kvcache.cpp`: same arguments, same in-place outputs, same -1
conventions. They are written for clarity, not speed: per-request Python loops over a handful of requests per step.

`OPS` are the top-level ops, `SPECULATIVE_OPS` those SGLang imports from `sgl_kernel.speculative`. Nothing here is
registered under `torch.ops.sgl_kernel`: SGLang reads a registered `convert_weight_packed` there as "the real
AMX-capable sgl-kernel is installed" and would then route every layer to kernels that do not exist here.
"""

from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np
import torch

__all__ = ["OPS", "SPECULATIVE_OPS", "assign_extend_cache_locs_cpu", "assign_req_to_token_pool_cpu",
           "copy_all_layer_kv_cache_cpu", "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",
           "reconstruct_indices_from_tree_mask", "verify_tree_greedy_cpu"]


def _spans(start_offset: torch.Tensor, end_offset: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, offset into the packed vector) per request: the C++ ops' exclusive prefix sum."""
    spans, packed = [], 0
    for start, end in zip(start_offset.tolist(), end_offset.tolist()):
        spans.append((int(start), int(end), packed))
        packed += int(end) - int(start)
    return spans


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[packed span of i] (int64 -> int32)."""
    rows = req_to_token.view(-1, pool_len)
    for i, (start, end, packed) in enumerate(_spans(start_offset, end_offset)):
        rows[int(req_pool_indices[i]), start:end] = out_cache_loc[packed:packed + end - start].to(rows.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor, out_cache_loc: torch.Tensor,
                                 pool_len: int) -> None:
    """The inverse gather: out_cache_loc[packed span of i] = req_to_token[req_pool_indices[i], start[i]:end[i]]."""
    rows = req_to_token.view(-1, pool_len)
    for i, (start, end, packed) in enumerate(_spans(start_offset, end_offset)):
        out_cache_loc[packed:packed + end - start] = rows[int(req_pool_indices[i]), start:end].to(out_cache_loc.dtype)


def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                  accept_out_cache_loc: torch.Tensor, size: int | None = None) -> None:
    """Compact the accepted tokens' KV slots: out_cache_loc at every accept_index that is not -1, in order.
    0.5.23 calls it without `size` (the whole accept_index)."""
    index = accept_index.reshape(-1)[: accept_index.numel() if size is None else size].to(torch.int64)
    kept = out_cache_loc.reshape(-1)[index[index > -1]]
    accept_out_cache_loc.reshape(-1)[: kept.numel()] = kept


def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor,
                          accept_stride: int) -> None:
    """bonus_tokens[i] = the last accepted token of request i (accept_lens counts the bonus token)."""
    flat = accept_tokens.reshape(-1)
    for i, length in enumerate(accept_lens.tolist()):
        bonus_tokens[i] = flat[accept_stride * i + int(length) - 1]


def verify_tree_greedy_cpu(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                           candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                           retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    """Greedy tree verification: from each request's root, follow first-child / next-sibling links and accept the
    child whose draft token equals the target's argmax at the last accepted node; stop at the first level without
    one. Writes the verified token of every accepted node and the bonus token (`predicts`, by flat draft index),
    the flat indices of the accepted path (`accept_index`, root first; the rest is left as given, -1 by SGLang) and
    the number of accepted drafts (`accept_token_num`, bonus excluded). `target_predict` is indexed flat, as in C++.
    """
    batch, num_draft = candidates.shape
    steps = accept_index.shape[1]
    cand, index = candidates.tolist(), retrive_index.tolist()
    next_token, next_sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    for b in range(batch):
        last = index[b][0]
        accept_index[b, 0] = last
        correct, cur = 0, 0
        for _ in range(1, steps):
            cur = next_token[b][cur]
            while cur != -1:
                if cand[b][cur] == target[last]:
                    predicts[last] = target[last]
                    correct += 1
                    accept_index[b, correct] = index[b][cur]
                    last = index[b][cur]
                    break
                cur = next_sibling[b][cur]
            if cur == -1:
                break
        accept_token_num[b] = correct
        predicts[last] = target[last]


def reconstruct_indices_from_tree_mask(tree_mask: torch.Tensor, verified_seq_len: torch.Tensor,
                                       positions: torch.Tensor, retrive_index: torch.Tensor,
                                       retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                                       batch_size: int, draft_token_num: int) -> None:
    """Tree links from NGRAM's QLEN-layout mask (`tree_mask[b, i, j]`: node j is an ancestor of node i, or i itself):
    position = prefix length + number of ancestors; retrive_index = flat index; first child = the first later node
    whose mask row has this node; next sibling = the first later node that has this node's parent and no ancestor
    between that parent and itself (sgl-kernel `reconstruct_indices_from_tree_mask_cpu`)."""
    n = draft_token_num
    mask = tree_mask.reshape(batch_size, n, n).to(torch.bool).tolist()
    seq_lens = verified_seq_len.tolist()
    pos, ri = positions.view(batch_size, n), retrive_index.view(batch_size, n)
    nxt, sib = retrive_next_token.view(batch_size, n), retrive_next_sibling.view(batch_size, n)
    for b in range(batch_size):
        rows = mask[b]
        for tid in range(n):
            ancestors = [i for i in range(tid) if rows[tid][i]]
            parent = ancestors[-1] if ancestors else -1
            ri[b, tid] = b * n + tid
            pos[b, tid] = len(ancestors) + int(seq_lens[b])
            nxt[b, tid] = next((i for i in range(tid + 1, n) if rows[i][tid]), -1)
            sibling = -1
            if parent != -1:
                for i in range(tid + 1, n):
                    if rows[i][parent] and not any(rows[i][parent + 1:i]):
                        sibling = i
                        break
            sib[b, tid] = sibling


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """For every K/V buffer (given by base address and bytes per slot row): rows src_loc -> rows tgt_loc, all
    sources read before any target is written (overlapping locations are safe, as in the C++ op). The op takes raw
    addresses, so each buffer is viewed through ctypes up to the highest row it touches."""
    targets, sources = tgt_loc.reshape(-1).to(torch.int64), src_loc.reshape(-1).to(torch.int64)
    if targets.numel() == 0:
        return
    rows_needed = int(max(int(targets.max()), int(sources.max()))) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows_needed * int(stride))).from_address(int(address))
        buffer = torch.from_numpy(np.ctypeslib.as_array(raw)).view(rows_needed, int(stride))
        staged = buffer[sources].clone()
        buffer[targets] = staged


OPS: dict[str, Callable[..., None]] = {f.__name__: f for f in (
    assign_req_to_token_pool_cpu, assign_extend_cache_locs_cpu, fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu, verify_tree_greedy_cpu, copy_all_layer_kv_cache_cpu)}
SPECULATIVE_OPS: dict[str, Callable[..., None]] = {"reconstruct_indices_from_tree_mask":
                                                   reconstruct_indices_from_tree_mask}
