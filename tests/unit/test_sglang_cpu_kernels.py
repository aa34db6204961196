"""The sgl_kernel stand-in ops and the torch-native verify branch (serve/engines/sglang/cpu) against straightforward
references on random inputs: trees of breadth > 1, several requests in one batch. The references are written from
the ops' contracts (parent lists, explicit softmax), not from the code under test."""

import math
import random

import pytest
import torch

from serve.engines.sglang.cpu import kernels
from serve.engines.sglang.cpu.verify import tree_verify_attention


def random_tree(rng, n, breadth):
    """Parents of nodes 1..n-1 in topological order (node 0 is the root); some node gets `breadth` children."""
    parents = [-1]
    for node in range(1, n):
        parents.append(rng.randrange(0, node) if node > breadth else 0)  # the root gets `breadth` children first
    return parents


def ancestors_mask(parents):
    n = len(parents)
    mask = [[False] * n for _ in range(n)]
    for i in range(n):
        j = i
        while j != -1:
            mask[i][j] = True
            j = parents[j]
    return mask


def batch_of_trees(seed, bs=3, n=8, breadth=3):
    rng = random.Random(seed)
    trees = [random_tree(rng, n, breadth) for _ in range(bs)]
    masks = torch.tensor([ancestors_mask(p) for p in trees], dtype=torch.bool).reshape(-1)
    return rng, trees, masks


def reconstruct(masks, seq_lens, bs, n):
    out = [torch.full((bs * n,), -7, dtype=torch.int64) for _ in range(4)]
    positions, retrive_index, next_token, next_sibling = out
    kernels.reconstruct_indices_from_tree_mask(masks, seq_lens, positions, retrive_index, next_token, next_sibling,
                                               bs, n)
    return out


def test_reconstruct_indices_from_tree_mask_matches_the_parent_lists():
    for seed in range(20):
        _, trees, masks = batch_of_trees(seed)
        seq_lens = torch.tensor([5, 0, 11])
        positions, index, first_child, sibling = (t.view(3, 8) for t in reconstruct(masks, seq_lens, 3, 8))
        for b, parents in enumerate(trees):
            for node, parent in enumerate(parents):
                depth, j = 0, parent
                while j != -1:
                    depth, j = depth + 1, parents[j]
                children = [c for c, p in enumerate(parents) if p == node]
                later_siblings = [s for s, p in enumerate(parents) if parent != -1 and p == parent and s > node]
                assert positions[b, node] == depth + seq_lens[b]
                assert index[b, node] == b * 8 + node
                assert first_child[b, node] == (children[0] if children else -1)
                assert sibling[b, node] == (later_siblings[0] if later_siblings else -1)


def test_verify_tree_greedy_accepts_the_path_a_parent_list_walk_accepts():
    bs, n, steps = 3, 8, 5
    deep_paths = 0
    for seed in range(30):
        rng, trees, masks = batch_of_trees(seed, bs, n)
        _, index, first_child, sibling = reconstruct(masks, torch.zeros(bs, dtype=torch.int64), bs, n)
        candidates = torch.tensor([[rng.randrange(4) for _ in range(n)] for _ in range(bs)])
        target = torch.tensor([[rng.randrange(4) for _ in range(n)] for _ in range(bs)])
        predicts = torch.full((bs * n,), -1, dtype=torch.int32)
        accept_index = torch.full((bs, steps), -1, dtype=torch.int32)
        accept_num = torch.zeros(bs, dtype=torch.int32)
        kernels.verify_tree_greedy_cpu(predicts, accept_index, accept_num, candidates, index.view(bs, n),
                                       first_child.view(bs, n), sibling.view(bs, n), target)
        for b, parents in enumerate(trees):
            path, node = [0], 0
            while len(path) < steps:
                children = [c for c, p in enumerate(parents) if p == node]
                hit = next((c for c in children if candidates[b, c] == target[b, node]), None)
                if hit is None:
                    break
                path.append(hit)
                node = hit
            deep_paths += len(path) > 2
            assert accept_num[b] == len(path) - 1
            assert accept_index[b].tolist() == [b * n + p for p in path] + [-1] * (steps - len(path))
            for earlier, later in zip(path, path[1:] + [None]):
                want = target[b, earlier] if later is None else candidates[b, later]
                assert predicts[b * n + earlier] == want
    assert deep_paths > 0  # the seeds exercise acceptance beyond the first level


def test_cache_location_ops_match_element_loops():
    rng = torch.Generator().manual_seed(0)
    pool_len, bs = 16, 3
    req_to_token = torch.randint(0, 1000, (6, pool_len), generator=rng, dtype=torch.int32)
    pool_indices = torch.tensor([4, 0, 2])
    start, end = torch.tensor([3, 0, 7], dtype=torch.int32), torch.tensor([8, 4, 9], dtype=torch.int32)
    packed = torch.randint(0, 1000, (int((end - start).sum()),), generator=rng, dtype=torch.int64)

    expected = req_to_token.clone()
    k = 0
    for i in range(bs):
        for j in range(int(start[i]), int(end[i])):
            expected[pool_indices[i], j] = packed[k]
            k += 1
    written = req_to_token.clone()
    kernels.assign_req_to_token_pool_cpu(pool_indices, written, start, end, packed, pool_len)
    assert torch.equal(written, expected)

    gathered = torch.full_like(packed, -1)
    kernels.assign_extend_cache_locs_cpu(pool_indices, written, start.long(), end.long(), gathered, pool_len)
    assert torch.equal(gathered, packed)

    accept_index = torch.tensor([[0, 3, -1], [5, -1, -1], [9, 10, 11]], dtype=torch.int32)
    out_cache_loc = torch.arange(100, 112)
    compact = torch.full((6,), -1, dtype=torch.int64)
    kernels.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, compact)  # 0.5.23 passes no size
    assert compact.tolist() == [100, 103, 105, 109, 110, 111]

    bonus = torch.zeros(3, dtype=torch.int32)
    tokens = torch.tensor([[7, 8, 9], [4, 5, 6], [1, 2, 3]], dtype=torch.int32)
    kernels.fill_bonus_tokens_cpu(tokens, torch.tensor([2, 1, 3], dtype=torch.int32), bonus, 3)
    assert bonus.tolist() == [8, 4, 3]


def test_copy_all_layer_kv_cache_copies_rows_by_raw_address_even_when_they_overlap():
    layers = [torch.randn(12, 3, 4) for _ in range(4)]  # 2 layers x (K, V)
    before = [t.clone() for t in layers]
    data_ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64)
    strides = torch.tensor([t[0].numel() * t.element_size() for t in layers], dtype=torch.int64)
    src, tgt = torch.tensor([2, 3, 4, 5]), torch.tensor([3, 4, 5, 9])  # overlapping: gather before scatter
    kernels.copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt, src)
    for t, old in zip(layers, before):
        want = old.clone()
        want[tgt] = old[src]
        assert torch.equal(t, want)


def reference_verify(query, k_cache, v_cache, req_to_token, pool_indices, seq_lens, masks, n, scale):
    heads, kv_heads = query.shape[1], k_cache.shape[1]
    out = torch.zeros_like(query)
    for b in range(len(seq_lens)):
        prefix = int(seq_lens[b])
        slots = req_to_token[pool_indices[b], : prefix + n]
        for i in range(n):
            visible = list(range(prefix)) + [prefix + j for j in range(n) if masks[b][i][j]]
            for h in range(heads):
                q = query[b * n + i, h]
                keys = k_cache[slots[visible], h * kv_heads // heads]
                values = v_cache[slots[visible], h * kv_heads // heads]
                weights = torch.softmax(keys @ q * scale, dim=0)
                out[b * n + i, h] = weights @ values
    return out


@pytest.mark.parametrize("kv_heads", [4, 2])  # plain and grouped-query attention
def test_tree_verify_attention_attends_the_prefix_and_the_ancestors_only(kv_heads):
    rng, trees, masks = batch_of_trees(3, bs=3, n=6, breadth=3)
    n, heads, dim = 6, 4, 8
    seq_lens = torch.tensor([5, 1, 9])
    slots = torch.randperm(64)[: 3 * 16].view(3, 16).to(torch.int32)
    k_cache, v_cache = torch.randn(64, kv_heads, dim), torch.randn(64, kv_heads, dim)
    query = torch.randn(3 * n, heads, dim)
    scale = 1 / math.sqrt(dim)
    pool = torch.tensor([1, 2, 0])
    req_to_token = slots[[2, 0, 1]]  # rows addressed through the pool indices
    nested = masks.view(3, n, n).tolist()
    got = tree_verify_attention(query, torch.empty_like(query), k_cache, v_cache, req_to_token, pool, seq_lens,
                                masks, n, scaling=scale, enable_gqa=kv_heads != heads)
    want = reference_verify(query, k_cache, v_cache, req_to_token, pool, seq_lens, nested, n, scale)
    assert torch.allclose(got, want, atol=1e-5)
    # The tree mask is really used: a causal chain over the same tokens (what a missing mask means) differs.
    chain = torch.tril(torch.ones(n, n, dtype=torch.bool)).repeat(3, 1).reshape(-1)
    wrong = tree_verify_attention(query, torch.empty_like(query), k_cache, v_cache, req_to_token, pool, seq_lens,
                                  chain, n, scaling=scale, enable_gqa=kv_heads != heads)
    assert not torch.allclose(wrong, got, atol=1e-3)


def test_tree_verify_attention_refuses_a_mask_of_another_layout():
    with pytest.raises(ValueError, match="QLEN layout"):
        tree_verify_attention(torch.zeros(4, 1, 2), torch.zeros(4, 1, 2), torch.zeros(9, 1, 2), torch.zeros(9, 1, 2),
                              torch.zeros(1, 9, dtype=torch.int32), torch.tensor([0]), torch.tensor([5]),
                              torch.ones(4 * 9, dtype=torch.bool), 4)
