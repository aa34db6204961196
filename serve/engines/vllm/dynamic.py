"""vLLM's own per-batch-size controller as an output: a study's per-concurrency decision written as
`num_speculative_tokens_per_batch_size` (`[[start, end, K], ...]`, inclusive batch-size ranges, K = 0 where
speculation loses), the key of vLLM's `--speculative-config` for dynamic speculative decoding. Pure.

`level_table` reads the table off a study's served policy (the replica served at each measured level) where one vLLM
server can express it: the configs differ in K only, the baseline's levels K = 0. Such a server is the per-level
decision in vLLM's own form, not a measured config: each range's K was measured at its level on a server of its own
(where K = 0, on the baseline, a server without a speculative config).

A batch size between two measured levels routes to the largest measured level at or below it (the rule this project
uses for SGLang's adaptive buckets too): a measured K is never applied to batches smaller than the level it was
measured at, where verifying costs relatively more. Sizes below the smallest level take that level's K.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from serve.engines.base import ReplicaConfig
from serve.spec import NoSpec, VllmSuffixSpec, draft_token_count

__all__ = ["LevelTable", "level_table", "per_batch_size", "with_per_batch_size"]


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


@dataclass(frozen=True)
class LevelTable:
    """The per-level decision as vLLM's table: `ks` = the K served at each measured level (0 = the baseline),
    `table` = `per_batch_size` of them (None where one server cannot express the policy), `replica` = the
    speculative replica whose command carries it, `reason` = why there is no table, or where it comes from."""

    ks: dict[int, int] = field(default_factory=dict)
    table: list[list[int]] | None = None
    replica: ReplicaConfig | None = None
    reason: str = ""


def level_table(served: Mapping[int, ReplicaConfig]) -> LevelTable:
    """The table of the replica served at each measured level (module docstring), or why there is none."""
    levels = sorted(served)
    ks = {level: draft_token_count(served[level].spec) for level in levels}  # the baseline's: 0

    def refused(reason: str) -> LevelTable:
        return LevelTable(ks=ks, reason=reason)

    speculative = [served[level] for level in levels if not isinstance(served[level].spec, NoSpec)]
    if not speculative:
        return refused("the baseline is served at every level: no speculative config to schedule")
    first = speculative[0]

    def without_k(replica: ReplicaConfig) -> dict[str, Any]:
        return replica.model_dump(exclude={"spec": {"num_speculative_tokens"}})

    other = next((r for r in speculative if without_k(r) != without_k(first)), None)
    if other is not None:
        return refused(f"the levels serve configs that differ in more than K ({first.spec!r} vs {other.spec!r}); "
                       "one vLLM server varies K only")
    settings = [served[level].model_dump(exclude={"spec"}) for level in levels]
    if any(one != settings[0] for one in settings):
        return refused("the baseline and the speculative config differ in more than the spec (engine settings); one "
                       "vLLM server has one set of them")
    if len(set(ks.values())) == 1:
        return refused(f"K {ks[levels[0]]} at every level: the winner's own command is the whole policy")
    if isinstance(first.spec, VllmSuffixSpec):
        # vllm/v1/spec_decode/suffix_decoding.py: `assert num_speculative_tokens == self.num_speculative_tokens` on
        # every step, so a batch in a range of another K (0 included) would stop the engine
        return refused("vLLM 0.32.0's suffix proposer asserts that the scheduled K is num_speculative_tokens on every "
                       "step: a table with another K would stop the engine at the first such batch")
    try:
        table = per_batch_size(ks, first.max_running_requests or levels[-1])  # None: vLLM carries the last K on
    except ValueError as exc:
        return refused(str(exc))
    ranges = ", ".join(f"batch {start}-{end}: K {k}" for start, end, k in table)
    return LevelTable(ks=ks, table=table, replica=first, reason=(
        f"{ranges}, from K per measured level {ks} (0 = the baseline won there; a batch takes the K of the largest "
        "level at or below its size)"))
