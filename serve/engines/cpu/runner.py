"""One causal LM driven by hand: prefill, a forward of arbitrary query tokens under an explicit visibility matrix
(tree verification, tree drafting), logits only where needed, and KV-cache pruning.

Two back ends behind one interface:
- Llama-family models (`llama.unsupported_reason` is None: Llama, Qwen2 without sliding windows) run the hand-written
  forward of `llama.py` over fused weights with a preallocated `KVCache` (about half the per-step time of HF's
  modules on 2 cores, same greedy tokens in fp32);
- the rest (Gemma 3) run HF's own modules with a `DynamicCache`.

Why by hand at all: HF `generate()` was 1.2-1.3x slower with the same drafts, and it cannot verify a token tree in one
forward. The technique (reference/cpu-engine-facts.md §4): the query tokens go in with explicit positions and an
additive float mask [N, P + N] (0 where a query may attend, dtype-min elsewhere); transformers 5.x passes a 4D mask
through untouched. Models with sliding-window layers (Gemma 3) get a dict of masks, one per layer type, the sliding
one restricted to the window. Every HF cache layer is a plain `DynamicLayer` (full history, also for sliding-window
layers): the window is enforced by the mask instead, so that rejected tree nodes can be dropped without losing history
the window still needs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from serve.engines.cpu.gguf_linear import WeightsChoice, choose_weights, resolve_weights
from serve.engines.cpu.llama import KVCache, LlamaForward, Query, unsupported_reason

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


def _check_visible(visible: torch.Tensor, n: int, prefix_len: int) -> None:
    if tuple(visible.shape) != (n, prefix_len + n):
        raise ValueError(f"visible must have shape ({n}, {prefix_len + n}), got {tuple(visible.shape)}")


class ModelRunner:
    """Owns a causal LM in eval mode: an HF module (`ModelRunner(model)`) or, for Llama-family models, the fast
    forward (`ModelRunner(model)` re-points the module's weights to fused ones; `ModelRunner.from_dir` skips HF's
    modules altogether). Not thread-safe: one worker thread drives it.

    `model` is the HF module, or the `LlamaForward` when loaded with `from_dir`; both carry `generation_config`."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.weights: WeightsChoice = choose_weights("fp32", None)  # `from_dir` may switch the fast forward to gguf
        if isinstance(model, LlamaForward):
            self.fast: LlamaForward | None = model
            self.config: Any = model.shape
            self.dtype = model.dtype
            self._mask_types: list[str] = []
            self.sliding_window: int | None = None
            self._softcap = None
        else:
            self.config = model.config.get_text_config(decoder=True)
            self.dtype = next(model.parameters()).dtype
            self.fast = LlamaForward.from_hf(model) if unsupported_reason(self.config.to_dict()) is None else None
            self._base = model.model
            self._head = model.get_output_embeddings()
            self._softcap = getattr(self.config, "final_logit_softcapping", None)
            layer_types = list(getattr(self.config, "layer_types", None) or [])
            self._mask_types = sorted(set(layer_types))  # non-empty: the model takes a dict of masks by layer type
            window = getattr(self.config, "sliding_window", None)
            self.sliding_window = int(window) if window and "sliding_attention" in layer_types else None
        self.vocab_size = int(self.config.vocab_size)
        self._min = torch.finfo(self.dtype).min

    @classmethod
    def from_dir(cls, model_dir: Path, dtype: str, weights: str = "fp32") -> ModelRunner:
        """The runner of an HF model dir: the fast forward straight from its safetensors where the architecture
        allows (no transformers modeling import, no `from_pretrained`), else HF's `from_pretrained`.

        `weights` (the engine's `--weights`): "fp32" runs every matmul on the dir's tensors; "gguf" runs the fast
        forward's small products on the GGUF kernel (`gguf_linear`), WeightsError where it cannot; "auto" does
        that where it can and falls back to fp32 otherwise. `runner.weights` says what was chosen and why."""
        from serve.engines.cpu.convert import load_hf_model, torch_dtype

        config = json.loads((Path(model_dir) / "config.json").read_text())
        if unsupported_reason(config) is None and any(Path(model_dir).glob("*.safetensors")):
            forward = LlamaForward.from_dir(Path(model_dir), torch_dtype(dtype))
            choice, blocks, kernel = resolve_weights(weights, Path(model_dir), forward.shape, dtype)
            if blocks is not None:
                forward.use_gguf(blocks, kernel)
            runner = cls(forward)
        else:
            choice = resolve_weights(weights, Path(model_dir), None, dtype)[0]  # fails early for "gguf"
            runner = cls(load_hf_model(Path(model_dir), dtype))
        runner.weights = choice
        return runner

    @property
    def backend(self) -> str:
        """"fast-llama" or "hf" (reported in /server_info)."""
        return "hf" if self.fast is None else "fast-llama"

    # ------------------------------------------------------------------ cache

    def new_cache(self) -> Any:
        if self.fast is not None:
            return self.fast.new_cache()
        from transformers import DynamicCache

        return DynamicCache()  # no config: every layer a full DynamicLayer (see module docstring)

    @staticmethod
    def cache_len(cache: Any) -> int:
        if isinstance(cache, KVCache):
            return cache.length
        return int(cache.get_seq_length())

    @staticmethod
    @torch.inference_mode()
    def keep(cache: Any, base: int, keep_rel: Sequence[int]) -> None:
        """After a forward appended queries at columns base.., keep columns [0, base) + base+keep_rel (increasing)."""
        if isinstance(cache, KVCache):
            cache.keep(base, keep_rel)
            return
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
        """Run `token_ids` after the cache with causal attention; returns the last hidden state [1, d]."""
        start = self.cache_len(cache)
        ids = torch.tensor(list(token_ids), dtype=torch.long)
        positions = torch.arange(start, start + ids.shape[0], dtype=torch.long)
        if self.fast is not None:
            mask = None if start == 0 else self._additive(chain_visibility(start, ids.shape[0]))
            return self.fast.forward(cache, ids, positions, mask)[-1:]
        out = self._base(input_ids=ids[None], position_ids=positions[None], cache=cache, use_cache=True)
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
        _check_visible(visible, n, prefix_len)
        ids = torch.tensor(list(token_ids), dtype=torch.long)
        pos = torch.tensor(list(positions), dtype=torch.long)
        if self.fast is not None:
            return self.fast.forward(cache, ids, pos, self._additive(visible))
        mask: Any = self._additive(visible)[None, None]
        if self._mask_types:
            masks = {kind: mask for kind in self._mask_types}
            if self.sliding_window is not None:
                keys = torch.arange(prefix_len) if key_positions is None else key_positions
                key_pos = torch.cat([keys, pos])
                in_window = key_pos[None, :] > pos[:, None] - self.sliding_window
                masks["sliding_attention"] = self._additive(visible & in_window)[None, None]
            mask = masks
        out = self._base(input_ids=ids[None], position_ids=pos[None], attention_mask=mask, cache=cache,
                         use_cache=True)
        return out.last_hidden_state[0]

    @property
    def batches(self) -> bool:
        """Whether `forward_many` runs several requests in one forward (the fast Llama path); else it loops."""
        return self.fast is not None

    @torch.inference_mode()
    def forward_many(self, items: Sequence[tuple[Any, Sequence[int], Sequence[int], torch.Tensor]]
                     ) -> list[torch.Tensor]:
        """`forward` for several requests at once: items of (cache, token_ids, positions, visible), each with its
        own cache. On the fast path one forward with every weight read once (`LlamaForward.forward_many`); on HF
        modules one forward per item. Returns each item's hidden states [N_i, d]."""
        if self.fast is None:
            return [self.forward(cache, ids, pos, visible) for cache, ids, pos, visible in items]
        queries = []
        for cache, token_ids, positions, visible in items:
            _check_visible(visible, len(token_ids), cache.length)
            queries.append(Query(cache, torch.tensor(list(token_ids), dtype=torch.long),
                                 torch.tensor(list(positions), dtype=torch.long), self._additive(visible)))
        return self.fast.forward_many(queries)

    def _additive(self, visible: torch.Tensor) -> torch.Tensor:
        mask = torch.full(visible.shape, self._min, dtype=self.dtype)
        mask.masked_fill_(visible, 0.0)
        return mask

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [k, V] for hidden states [k, d] (the model's own head and final soft-capping)."""
        if self.fast is not None:
            return self.fast.logits(hidden).float()
        out = self._head(hidden)
        if self._softcap is not None:
            out = torch.tanh(out / self._softcap) * self._softcap
        return out.float()
