"""The engine's prefix cache as the simulator sees it: how many of a request's prompt tokens its prefill computes.

SGLang's radix cache (on unless `--disable-radix-cache`) keeps the KV of what it served since the last flush, and a
new request's prefill extends only the tokens past its longest cached prefix. Its TTFT follows those *uncached*
tokens, not the prompt's length: on the CPU, with templated prompts that share a long prefix, the baseline's cache
misses took 527-569 ms to the first token and its hits 167-247 ms (docs/benchmarks.md, "First launch per engine").
So for an engine with a prefix cache the cost model's prefill line (pipeline.simulate.cost) is fitted to, and
charged for, uncached tokens: `uncached_tokens` counts them for a launch's recorded requests (what the engine saw,
in order, since the trial's flush), and the replay (pipeline.simulate.replay) counts them for a predicted config
with `HeldPrefixes`, on the requests the config would send.

What the cache holds, as SGLang 0.5.23 fills it (`schedule_batch.Req.init_next_round_input`, `radix_cache`):
- after a request's prefill, its prompt (`cache_unfinished_req`); when it finishes, its prompt and every output token
  but the last (the last token's KV is never computed);
- a hit is the longest held prefix, in whole pages, and at most all but the prompt's last token (the prefill must
  compute one position for the first token's logits: `max_prefix_len = input_len - 1`);
- nothing is evicted: a study's prompts and answers are far below the KV pool's size.

Engines without one: the CPU engine (its `cached_tokens` is always 0). llama-server's `cache_prompt` reuses only the
previous sequence of the slot a request lands in, a different rule, and simulate-first does not run there (the
simulator does not replay llama.cpp's n-gram drafting), so it is not modelled. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import Field

from pipeline.measure.server_info import ServerInfo
from pipeline.measure.summary import RequestRecord
from serve.spec import FrozenModel

__all__ = ["HeldPrefixes", "PrefixCache", "prefix_cache_of", "uncached_tokens"]


class PrefixCache(FrozenModel):
    """An engine's prefix cache: matches count in whole pages of `page_size` tokens."""

    page_size: int = Field(1, ge=1)


def prefix_cache_of(server_info: ServerInfo | None) -> PrefixCache | None:
    """The prefix cache the engine runs with, from its `/server_info`: SGLang reports its resolved server arguments
    there, `disable_radix_cache` among them (resolved: True also where SGLang itself turned the cache off for the
    model or the speculative algorithm), and `page_size`. An engine that reports no such field (the CPU engine,
    llama-server) has none for the simulator, so its predictions charge every prompt token."""
    raw = server_info.raw if server_info is not None else {}
    if raw.get("disable_radix_cache") is not False:
        return None
    page = raw.get("page_size")
    return PrefixCache(page_size=page if isinstance(page, int) and not isinstance(page, bool) and page >= 1 else 1)


class HeldPrefixes:
    """The token sequences a prefix cache holds, as a trie of token ids (a match walks one prompt once: a space's
    thousands of replays each ask for a dozen prompts of a few hundred tokens)."""

    def __init__(self, cache: PrefixCache) -> None:
        self.page_size = cache.page_size
        self._root: dict[int, dict[Any, Any]] = {}

    def hold(self, tokens: Iterable[int]) -> None:
        node = self._root
        for token in tokens:
            node = node.setdefault(token, {})

    def hit(self, prompt: Sequence[int]) -> int:
        """Tokens of `prompt` the cache holds: its longest held prefix, in whole pages, at most all but its last."""
        node, matched = self._root, 0
        for token in prompt[:len(prompt) - 1]:
            child = node.get(token)
            if child is None:
                break
            node, matched = child, matched + 1
        return matched - matched % self.page_size

    def uncached(self, prompt: Sequence[int]) -> int:
        return len(prompt) - self.hit(prompt)


# Event kinds in one phase's time order; at equal times a finished request's sequence is held before the next one
# arrives (a closed loop's next request follows the reply), and a request's own arrival comes before its prompt is
# held (it cannot hit itself).
_FINISHED, _ARRIVED, _PREFILLED = 0, 1, 2


def uncached_tokens(records: Sequence[RequestRecord], cache: PrefixCache | None, *,
                    flushed_after_warmup: bool = False) -> list[int]:
    """The prompt tokens the engine's prefill computed for each successful measured record of one launch, in the
    records' order (the trial's records: its warm-up, then its measured requests, what the engine served since the
    flush before the warm-up; the `reference` phase comes after and is left out). Each phase is replayed in its own
    time order (`start_s`, first token and finish), so requests that overlapped at concurrency > 1 only see what was
    held when they arrived. `flushed_after_warmup`: the engine was flushed between the two phases (a baseline whose
    study has no warm-up split settles on the measured prompts, then flushes them:
    pipeline.trial.engine_pass.settle_requests). Without a cache, or for a record without prompt ids, every prompt
    token counts."""
    measured = [r for r in records if r.phase == "measure" and r.ok]
    out = [r.prompt_tokens for r in measured]
    if cache is None:
        return out
    held = HeldPrefixes(cache)
    for phase in ("warmup", "measure"):
        if phase == "measure" and flushed_after_warmup:
            held = HeldPrefixes(cache)
        mine = measured if phase == "measure" else [r for r in records if r.phase == phase and r.ok]
        events: list[tuple[float, int, int]] = []
        for i, r in enumerate(mine):
            if r.prompt_ids is None:  # unknown tokens: neither matched nor held
                continue
            events.append((r.start_s, _ARRIVED, i))
            if r.ttft_s is not None:
                events.append((r.start_s + r.ttft_s, _PREFILLED, i))
                events.append((r.start_s + r.e2e_s, _FINISHED, i))
        for _, kind, i in sorted(events):
            r = mine[i]
            prompt = r.prompt_ids or ()
            if kind == _ARRIVED:
                if phase == "measure":
                    out[i] = held.uncached(prompt)
            elif kind == _PREFILLED:
                held.hold(prompt)
            else:
                held.hold(prompt + r.output_ids[:-1])
    return out
