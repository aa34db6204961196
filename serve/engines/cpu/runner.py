"""One HF causal LM driven by hand: prefill, a forward of arbitrary query tokens under an explicit visibility matrix
(tree verification, tree drafting), logits only where needed, and KV-cache pruning.

Why by hand: HF `generate()` was 1.2-1.3x slower with the same drafts, and it cannot verify a token tree in one
forward. The technique (measured in reference/cpu-engine-facts.md §4): the query tokens go in with explicit
`position_ids` and an additive float 4D mask [1, 1, N, P + N] (0 where a query may attend, dtype-min elsewhere);
transformers 5.x passes a 4D mask through untouched. Models with sliding-window layers (Gemma 3) get a dict of masks,
one per layer type, the sliding one restricted to the window.

Every cache layer is a plain `DynamicLayer` (full history, also for sliding-window layers): the window is enforced by
the mask instead, so that rejected tree nodes can be dropped without losing history the window still needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ModelRunner", "chain_visibility", "tree_visibility"]


def tree_visibility(prefix_len: int, parents: Sequence[int]) -> torch.Tensor:
    """bool [N, P+N]: query i sees the whole prefix, its ancestors among the queries, and itself.
    `parents[i]` is a query index < i, or -1 for a query whose parent is the last prefix token."""
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            anc[i] = anc[parent]
        anc[i, i] = True
    visible = torch.ones(n, prefix_len + n, dtype=torch.bool)
    visible[:, prefix_len:] = anc
    return visible


def chain_visibility(prefix_len: int, n: int) -> torch.Tensor:
    """bool [N, P+N] for N consecutive tokens (plain causal attention)."""
    return tree_visibility(prefix_len, [i - 1 for i in range(n)])


class ModelRunner:
    """Owns an HF causal LM in eval mode. Not thread-safe: one worker thread drives it."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = model.config.get_text_config(decoder=True)
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(self.config.vocab_size)
        self._base = model.model
        self._head = model.get_output_embeddings()
        self._softcap = getattr(self.config, "final_logit_softcapping", None)
        layer_types = list(getattr(self.config, "layer_types", None) or [])
        self._mask_types = sorted(set(layer_types))  # non-empty: the model takes a dict of masks by layer type
        window = getattr(self.config, "sliding_window", None)
        self.sliding_window: int | None = int(window) if window and "sliding_attention" in layer_types else None
        self._min = torch.finfo(self.dtype).min

    # ------------------------------------------------------------------ cache

    @staticmethod
    def new_cache() -> Any:
        from transformers import DynamicCache

        return DynamicCache()  # no config: every layer a full DynamicLayer (see module docstring)

    @staticmethod
    def cache_len(cache: Any) -> int:
        return int(cache.get_seq_length())

    @staticmethod
    @torch.inference_mode()
    def keep(cache: Any, base: int, keep_rel: Sequence[int]) -> None:
        """After a forward appended queries at columns base.., keep columns [0, base) + base+keep_rel (increasing)."""
        k = len(keep_rel)
        contiguous = list(keep_rel) == list(range(k))
        idx = None if contiguous else torch.tensor([base + r for r in keep_rel], dtype=torch.long)
        for layer in cache.layers:
            if not getattr(layer, "is_initialized", False) or layer.keys is None or layer.keys.numel() == 0:
                continue
            if idx is not None:
                # Move the kept rows down in place, then cut: a view, no copy of the whole cache.
                layer.keys[:, :, base:base + k] = layer.keys.index_select(2, idx)
                layer.values[:, :, base:base + k] = layer.values.index_select(2, idx)
            layer.keys = layer.keys[:, :, :base + k]
            layer.values = layer.values[:, :, :base + k]

    # ------------------------------------------------------------------ forwards

    @torch.inference_mode()
    def prefill(self, cache: Any, token_ids: Sequence[int]) -> torch.Tensor:
        """Run `token_ids` after the cache with HF's own causal masks; returns the last hidden state [1, d]."""
        start = self.cache_len(cache)
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        positions = torch.arange(start, start + ids.shape[1], dtype=torch.long)[None]
        out = self._base(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
        return out.last_hidden_state[0, -1:]

    @torch.inference_mode()
    def forward(
        self,
        cache: Any,
        token_ids: Sequence[int],
        positions: Sequence[int],
        visible: torch.Tensor,
        key_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Queries `token_ids` at `positions`, attending where `visible` [N, P+N] is True; appends N columns to the
        cache. `key_positions` [P] are the positions of the cached columns (default 0..P-1), used for the sliding
        window. Returns the hidden states [N, d]; get logits with `logits()`."""
        prefix_len = self.cache_len(cache)
        n = len(token_ids)
        if tuple(visible.shape) != (n, prefix_len + n):
            raise ValueError(f"visible must have shape ({n}, {prefix_len + n}), got {tuple(visible.shape)}")
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        pos = torch.tensor(list(positions), dtype=torch.long)
        mask: Any = self._additive(visible)
        if self._mask_types:
            masks = {kind: mask for kind in self._mask_types}
            if self.sliding_window is not None:
                keys = torch.arange(prefix_len) if key_positions is None else key_positions
                key_pos = torch.cat([keys, pos])
                in_window = key_pos[None, :] > pos[:, None] - self.sliding_window
                masks["sliding_attention"] = self._additive(visible & in_window)
            mask = masks
        out = self._base(input_ids=ids, position_ids=pos[None], attention_mask=mask, cache=cache, use_cache=True)
        return out.last_hidden_state[0]

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        mask = torch.full(visible.shape, self._min, dtype=self.dtype)
        mask.masked_fill_(visible, 0.0)
        return mask[None, None]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [k, V] for hidden states [k, d] (the model's own head and final soft-capping)."""
        out = self._head(hidden)
        if self._softcap is not None:
            out = torch.tanh(out / self._softcap) * self._softcap
        return out.float()
