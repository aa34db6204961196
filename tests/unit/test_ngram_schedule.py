"""NGRAM's schedule as SGLang 0.5.23 runs it (`NGRAMWorker`): the window ending at the verify root is inserted, a
round's inserts land when the next round begins, and each request carries its MatchState between steps. Expected
trees are derived by hand from those rules (the parity tests compare with SGLang's C++)."""

from __future__ import annotations

from typing import Any

import pytest

from serve.engines.cpu.decode import Request, StopRules
from serve.engines.cpu.verify import Sampling
from serve.ngram.trie import MatchState, NgramCache
from serve.engines.cpu.speculators import NgramSpeculator


def make_cache(**overrides: Any) -> NgramCache:
    # Breadth 1 everywhere and one draft node: the draft is the most recent child of the longest matched suffix.
    cfg: dict[str, Any] = dict(max_trie_depth=4, capacity=100_000, min_bfs_breadth=1, max_bfs_breadth=1,
                               match_type="BFS", num_draft_tokens=2)
    cfg.update(overrides)
    return NgramCache(**cfg)


def make_spec(**overrides) -> NgramSpeculator:
    cache = make_cache(**overrides)
    return NgramSpeculator(cache, cache._num_draft_tokens, cache._depth)


def request(rid: str, tokens: list[int]) -> Request:
    req = Request(rid=rid, prompt_ids=tokens[:1], sampling=Sampling(), rules=StopRules(max_new_tokens=100), seed=0)
    req.tokens = list(tokens)
    return req


def first(tree) -> int | None:
    return tree.tokens[0] if tree.num_real else None


# ----------------------------------------------------------------------------------------------- match state


def test_advanced_state_misses_a_longer_suffix_inserted_since_it_was_cached() -> None:
    cache = make_cache()
    cache.insert([5, 6, 2])
    state = MatchState()
    assert first(cache.draft([3, 5], state)) == 6  # cached: 5 matches, 3-5 does not
    cache.insert([3, 5, 6, 9])  # now 3-5-6 -> 9 exists ...
    cache.insert([5, 6, 2])  # ... and 5-6 and 6 continue with 2 most recently
    # One token appended: the state advances 5 -> 5-6 and root -> 6, but 3-5 was not in the trie when cached, so
    # 3-5-6 is not found; the longest match is 5-6, whose most recent child is 2. Rebuilt, 3-5-6 gives 9.
    assert first(cache.draft([3, 5, 6], state, total_len=3)) == 2
    assert first(cache.draft([3, 5, 6])) == 9
    assert first(cache.draft([3, 5, 6], MatchState(), total_len=3)) == 9


def test_state_rebuilds_after_a_flush_and_without_forward_progress() -> None:
    cache = make_cache()
    cache.insert([5, 6, 2])
    state = MatchState()
    cache.draft([3, 5], state, total_len=5)
    cache.insert([3, 5, 6, 9])
    cache.insert([5, 6, 2])
    # total_len below what the state covered: no forward progress, rebuilt from the context (3-5-6 -> 9).
    assert first(cache.draft([3, 5, 6], state, total_len=3)) == 9
    cache.reset()
    cache.insert([5, 6, 1])
    assert first(cache.draft([5, 6], state, total_len=4)) == 1  # a flush invalidates every cached state


def test_state_rebuilds_when_a_cached_anchor_was_evicted() -> None:
    # capacity 8 = root + 7 nodes, depth 3. After [1, 0] and [2, 3, 1] the trie holds 0, 1, 2, 2-3, 2-3-1, 3, 3-1
    # (1-0 was evicted), least recently used first: 0, 2-3-1, 2-3, 2, 3-1, 3, 1.
    cache = make_cache(capacity=8, max_trie_depth=3)
    cache.insert([1, 0])
    cache.insert([2, 3, 1])
    state = MatchState()
    cache.draft([2, 0], state)  # caches suffix [0] -> node 0 (a leaf), [2, 0] -> nothing
    # [0, 2, 2] evicts 0, 2-3-1, 2-3, then 2, 3-1; [2, 3] evicts 3, 1. Left: 0-2-2, 0-2, 0, 2-2, 2, 2-3, 3, where
    # 0 and 0-2 are new nodes: the cached node 0 was evicted.
    cache.insert([0, 2, 2])
    cache.insert([2, 3])
    # Rebuilt: [0, 2] matches 0-2 (child 2), the longest anchor. Advancing the stale node 0 would have found no
    # 0-2 and drafted from [2] alone, whose most recent child is 3.
    assert first(cache.draft([2, 0, 2], state, total_len=3)) == 2


def test_total_len_is_checked() -> None:
    cache = make_cache()
    with pytest.raises(ValueError, match="total_len"):
        cache.draft([1, 2, 3], MatchState(), total_len=2)


# ----------------------------------------------------------------------------------------------- insert schedule


def test_a_step_inserts_the_window_ending_at_its_verify_root() -> None:
    spec = make_spec()
    req = request("a", [1, 2, 3])
    spec.begin_round()
    spec.propose(req)
    req.tokens += [4, 5]  # accepted block of this step
    spec.observe(req, [0])
    spec.begin_round()
    # Landed: the window [1, 2, 3] (ending at the root 3), not the accepted 4, 5.
    assert first(spec.cache.draft([1, 2])) == 3
    assert first(spec.cache.draft([3])) is None


def test_the_final_accepted_block_is_never_inserted() -> None:
    spec = make_spec()
    req = request("a", [1, 2, 3])
    spec.begin_round()
    spec.propose(req)
    req.tokens += [4, 5]
    spec.observe(req, [0])
    spec.release(req)  # finished: it will not draft again
    spec.begin_round()
    spec.begin_round()
    assert spec.cache.num_nodes == 3 + 2 + 1  # suffixes of [1, 2, 3] only
    assert first(spec.cache.draft([3])) is None and first(spec.cache.draft([4])) is None


def test_a_rounds_inserts_land_after_every_request_of_the_round_drafted() -> None:
    spec = make_spec()
    a, b = request("a", [1, 2, 3]), request("b", [9, 1, 2])
    spec.begin_round()
    assert first(spec.propose(a)) is None
    a.tokens += [4]
    # Same round: a's window [1, 2, 3] has not landed, so 1-2 has no continuation for b yet.
    assert first(spec.propose(b)) is None
    b.tokens += [5]
    spec.begin_round()
    # Next round: a's window landed before anyone drafts (b's [9, 1, 2] too).
    assert first(spec.propose(request("c", [4, 1, 2]))) == 3
    assert first(spec.cache.draft([9, 1])) == 2


def test_without_a_scheduler_every_draft_is_a_round_of_its_own() -> None:
    # A caller that steps the Decoder itself (no begin_round) gets SGLang with a batch of one.
    spec = make_spec()
    req = request("a", [1, 2, 3])
    assert first(spec.propose(req)) is None  # queues [1, 2, 3]
    req.tokens += [1, 2]
    assert first(spec.propose(req)) == 3  # [1, 2, 3] landed first: 1-2 -> 3; queues [2, 3, 1, 2]
    req.tokens += [5]
    spec.release(req)
    # The finished request's last queued window lands before the next request drafts: 3-1 -> 2 exists only there.
    assert first(spec.propose(request("b", [9, 3, 1]))) == 2


def test_flush_drops_queued_inserts() -> None:
    spec = make_spec()
    req = request("a", [1, 2, 3])
    spec.propose(req)
    spec.release(req)
    spec.reset()
    spec.begin_round()
    assert spec.cache.num_nodes == 0


def test_the_scheduler_begins_every_round_before_its_steps() -> None:
    import threading

    from serve.engines.cpu.decode import StepStats
    from serve.engines.cpu.scheduler import Scheduler

    class Recorder:
        """Each request finishes after two steps (a prefill and one verify step)."""

        speculator = None

        def __init__(self) -> None:
            self.log: list[str] = []

        def begin_round(self) -> None:
            self.log.append("|")

        def step(self, req: Request) -> StepStats:
            self.log.append(req.rid)
            req.output_ids.append(1)
            if len(req.output_ids) >= 2:
                req.finish_reason = {"type": "length", "length": 2}
            return StepStats(verify=len(req.output_ids) > 1, emitted=1, proposed=0)

        def step_many(self, reqs: list[Request]) -> list[StepStats]:
            return [self.step(req) for req in reqs]

        def release(self, req: Request) -> None:
            pass

    decoder = Recorder()
    sched = Scheduler(decoder, 2)
    done = threading.Event()
    left = {"a", "b"}

    def sink(req, error):
        if req.finished:
            left.discard(req.rid)
            if not left:
                done.set()

    for rid in ("a", "b"):
        sched.submit(request(rid, [1]), sink)
    sched.start()
    try:
        assert done.wait(10)
    finally:
        sched.stop()
    assert decoder.log[:6] == ["|", "a", "b", "|", "a", "b"]
