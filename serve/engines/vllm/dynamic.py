"""vLLM's own per-batch-size controller as an output: a study's per-concurrency decision written as
`num_speculative_tokens_per_batch_size` (`[[start, end, K], ...]`, inclusive batch-size ranges, K = 0 where
speculation loses), the key of vLLM's `--speculative-config` for dynamic speculative decoding. Pure.

A batch size between two measured levels routes to the largest measured level at or below it (the rule this project
uses for SGLang's adaptive buckets too): a measured K is never applied to batches smaller than the level it was
measured at, where verifying costs relatively more. Sizes below the smallest level take that level's K.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["per_batch_size", "with_per_batch_size"]


def per_batch_size(levels: Mapping[int, int], max_num_seqs: int) -> list[list[int]]:
    """`[[start, end, K], ...]` covering batch sizes 1..max_num_seqs from {concurrency level: K}; neighbouring ranges
    with the same K are merged."""
    if not levels:
        raise ValueError("num_speculative_tokens_per_batch_size: no concurrency level decided; give at least one")
    bad = {level: k for level, k in levels.items() if level < 1 or k < 0}
    if bad:
        raise ValueError(f"num_speculative_tokens_per_batch_size: levels must be >= 1 and K >= 0, got {bad}")
    if max_num_seqs < max(levels):
        raise ValueError(f"num_speculative_tokens_per_batch_size: max_num_seqs={max_num_seqs} is below the largest "
                         f"decided level {max(levels)}; serve with --max-num-seqs >= {max(levels)}")
    ordered = sorted(levels)
    ranges: list[list[int]] = []
    for i, level in enumerate(ordered):
        start = 1 if i == 0 else level
        end = ordered[i + 1] - 1 if i + 1 < len(ordered) else max_num_seqs
        if ranges and ranges[-1][2] == levels[level]:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, levels[level]])
    return ranges


def with_per_batch_size(config: Mapping[str, Any], levels: Mapping[int, int], max_num_seqs: int) -> dict[str, Any]:
    """A `--speculative-config` object with the table; its `num_speculative_tokens` is the table's largest K (vLLM
    sizes its buffers for it)."""
    table = per_batch_size(levels, max_num_seqs)
    return {**config, "num_speculative_tokens": max(k for _, _, k in table) or config["num_speculative_tokens"],
            "num_speculative_tokens_per_batch_size": table}
