"""SGLang 0.5.23's tree-verify layout and its attention paths in torch, for `check_tree_verify.py` (loaded from there
by file path; needs torch alone). A draft tree here is the trie's `DraftTree`; the verify width n counts the root."""

from __future__ import annotations

from typing import Any, Callable

import torch

TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1e-2, 2e-2)}


def qlen_mask(tree: Any) -> torch.Tensor:
    """fillResult's n x n mask: row 0 the root, row i >= 1 the draft node i - 1; [i, j] = j is i or an ancestor."""
    n = len(tree.tokens) + 1
    mask = torch.zeros(n, n, dtype=torch.bool)
    mask[0, 0] = True
    for i, parent in enumerate(tree.parents, start=1):
        mask[i] = mask[parent + 1]
        mask[i, i] = True
    return mask


def branches(tree: Any) -> bool:
    """Two real draft nodes or more under one parent, the root included; pads are left out (they always hang under
    the root, so every padded tree would count)."""
    parents = list(tree.parents[:tree.num_real])
    return any(parents.count(p) > 1 for p in set(parents))


def causal_differs(batch: Batch) -> torch.Tensor:
    """bool [bs * n]: rows of a branching tree (`branches`) whose causal view is not their tree view."""
    return torch.cat([(m != torch.ones_like(m).tril()).any(1) & branches(t) for m, t in zip(batch.masks, batch.trees)])


def full_custom_mask(masks: list[torch.Tensor], prefixes: list[int]) -> torch.Tensor:
    """SGLang's FULL_MASK `custom_mask` (ngram_worker.py, USE_FULL_MASK on a GPU): per request [n, prefix + n]."""
    return torch.cat([torch.cat([torch.ones(m.shape[0], p, dtype=torch.bool), m], dim=1).flatten()
                      for m, p in zip(masks, prefixes)])


class Batch:
    """Drafts of one batch in a paged pool: request b's slots are req_to_token[pool[b], :prefix_b + n], scattered."""

    def __init__(self, trees: list[Any], prefixes: list[int], gen: torch.Generator) -> None:
        self.trees, self.n, self.bs = trees, len(trees[0].tokens) + 1, len(trees)
        self.prefixes = torch.tensor(prefixes, dtype=torch.int64)
        self.masks = [qlen_mask(t) for t in trees]
        self.qlen = torch.cat([m.flatten() for m in self.masks])
        self.custom_mask = full_custom_mask(self.masks, prefixes)
        lengths = [p + self.n for p in prefixes]
        self.slots = sum(lengths) + 7
        self.pool = torch.randperm(self.bs, generator=gen)
        self.req_to_token = torch.zeros(self.bs, max(lengths), dtype=torch.int64)
        order, start = torch.randperm(self.slots, generator=gen), 0
        for b, length in enumerate(lengths):
            self.req_to_token[int(self.pool[b]), :length] = order[start:start + length]
            start += length
        # SGLang's positions (reconstruct_indices_from_tree_mask): prefix length + ancestors in the mask row
        self.positions = torch.cat([p + m.sum(1) - 1 for m, p in zip(self.masks, prefixes)])

    def slot_rows(self, b: int, length: int) -> torch.Tensor:
        return self.req_to_token[int(self.pool[b]), :length]


# ---------------------------------------------------------------- attention paths

def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 attention. q [nq, H, D], k/v [nk, Hkv, D/Dv], allowed [nq, nk] -> (out [nq, H, Dv], lse [nq, H]).
    Query head h reads kv head h // (H / Hkv), as SGLang's kernels and SDPA's enable_gqa do."""
    nq, heads, dim = q.shape
    kv_heads = k.shape[1]
    qg = q.float().reshape(nq, kv_heads, heads // kv_heads, dim).permute(1, 0, 2, 3).reshape(kv_heads, -1, dim)
    scores = (qg @ k.float().permute(1, 2, 0)).view(kv_heads, nq, heads // kv_heads, -1) * scale
    scores = scores.masked_fill(~allowed.to(scores.device)[None, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse[..., None]).view(kv_heads, -1, k.shape[0])
    out = (probs @ v.float().permute(1, 0, 2)).view(kv_heads, nq, heads // kv_heads, -1)
    return out.permute(1, 0, 2, 3).reshape(nq, heads, -1), lse.permute(1, 0, 2).reshape(nq, heads)


def reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, batch: Batch, scale: float) -> torch.Tensor:
    """Dense fp32 attention under the FULL_MASK rows of `custom_mask`, read back from the flat tensor."""
    n, outs, offset = batch.n, [], 0
    for b in range(batch.bs):
        length = int(batch.prefixes[b]) + n
        allowed = batch.custom_mask[offset:offset + n * length].view(n, length)
        offset += n * length
        slots = batch.slot_rows(b, length)
        outs.append(attend(q[b * n:(b + 1) * n], kc[slots], vc[slots], allowed, scale)[0])
    return torch.cat(outs)


def fa3_expand_metadata(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """flashattention_backend.py init_forward_metadata, target verify, topk > 1: the draft pass's page table and
    cache_seqlens, from `custom_mask` with the backend's own index arithmetic."""
    n, seq_lens = batch.n, batch.prefixes
    offsets = torch.arange(n).unsqueeze(0)
    cols = offsets.expand(batch.bs, -1) + seq_lens.unsqueeze(1)
    cum_len = torch.nn.functional.pad(torch.cumsum((seq_lens + n).repeat_interleave(n), dim=0), (1, 0))[:-1]
    extraction = (cols.repeat_interleave(n, dim=0) + cum_len[:, None]).view(1, -1)
    mask = batch.custom_mask[extraction].view(-1, n)
    col_indices = offsets.expand(mask.shape[0], n)
    _, sort_order = torch.sort(torch.where(mask, col_indices, col_indices + n), dim=1)
    table = batch.req_to_token[batch.pool, :].gather(1, cols).repeat_interleave(n, dim=0)
    return table.gather(1, sort_order), mask.sum(dim=1)


def fa3_two_pass(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, batch: Batch, scale: float) -> torch.Tensor:
    """The cascade: outputs of each pass rounded to the input dtype (the kernel's `out`), LSE in fp32, merged in
    fp32 as merge_state_v2 does."""
    n, dtype = batch.n, q.dtype
    o1, lse1 = [], []
    for b in range(batch.bs):  # prefix pass: cache_seqlens = seq_lens, not causal
        slots = batch.slot_rows(b, int(batch.prefixes[b]))
        out, lse = attend(q[b * n:(b + 1) * n], kc[slots], vc[slots], torch.ones(n, len(slots), dtype=torch.bool),
                          scale)
        o1.append(out.to(dtype))
        lse1.append(lse)
    table, seqlens = fa3_expand_metadata(batch)
    o2, lse2 = [], []
    for row in range(q.shape[0]):  # draft pass: one query per sequence, its keys the row's masked draft slots
        slots = table[row, :int(seqlens[row])]
        out, lse = attend(q[row:row + 1], kc[slots], vc[slots], torch.ones(1, len(slots), dtype=torch.bool), scale)
        o2.append(out.to(dtype))
        lse2.append(lse)
    a, la, c, lc = torch.cat(o1).float(), torch.cat(lse1), torch.cat(o2).float(), torch.cat(lse2)
    top = torch.maximum(la, lc)
    wa, wc = torch.exp(la - top)[..., None], torch.exp(lc - top)[..., None]
    return ((a * wa + c * wc) / (wa + wc)).to(dtype)


def fa3_causal(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, batch: Batch, scale: float) -> torch.Tensor:
    """topk <= 1: cache_seqlens = seq_lens + n, causal (bottom-right aligned), custom_mask never read."""
    n, outs = batch.n, []
    for b in range(batch.bs):
        length = int(batch.prefixes[b]) + n
        slots = batch.slot_rows(b, length)
        allowed = torch.ones(n, length, dtype=torch.bool).tril(length - n)
        outs.append(attend(q[b * n:(b + 1) * n], kc[slots], vc[slots], allowed, scale)[0].to(q.dtype))
    return torch.cat(outs)


def cpu_engine(module: Any) -> Callable[..., torch.Tensor]:
    def run(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, batch: Batch, scale: float) -> torch.Tensor:
        out = torch.empty(q.shape[0], q.shape[1], vc.shape[-1], dtype=q.dtype)
        module.tree_verify_attention(q.cpu(), out, kc.cpu(), vc.cpu(), batch.req_to_token, batch.pool,
                                     batch.prefixes, batch.qlen, batch.n, scaling=scale,
                                     enable_gqa=q.shape[1] != kc.shape[1])
        return out.to(q.device)
    return run


def max_violation(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """(max |out - ref|, max of |out - ref| / (atol + rtol |ref|)): the second is <= 1 within tolerance."""
    atol, rtol = TOLERANCE[dtype]
    diff = (out.float() - ref.float()).abs()
    return float(diff.max()), float((diff / (atol + rtol * ref.float().abs())).max())
