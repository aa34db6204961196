"""Acceptance replay: a lossless NGRAM config under greedy decoding emits exactly the baseline's tokens, so every
step's accepted length follows from the draft tree the trie (and the external corpora) propose from the token history.
Replay the baseline's recorded prompt and output ids through `serve.ngram.schedule.NgramDrafter` -- the object the CPU
engine drafts with, over the compiled trie where it builds (serve.ngram.compiled: the same decisions) -- on the
engine's round schedule, and walk each tree along the recorded continuation.

The schedule (`serve/engines/cpu/scheduler.py`, SGLang's decode batch): requests wait in one FIFO queue; each round
admits waiting requests while fewer than `max_running` run, lands the previous round's trie inserts, then gives every
running request one step in admission order -- a new request its prefill (one token), the others one draft + verify
step. A finished request leaves at once. Phases (warm-up, then the measurement) run one after the other on the same
trie, as a trial sends them. Who joins which round is the admission's business:
- `ClosedLoop(concurrency, lag)`: `concurrency` clients; each sends its next request when its previous one finished,
  joining `lag` rounds after the round it finished in (0: the next round, what an in-process client achieves; over
  HTTP a reply and a new request take a few milliseconds, so a request may join one round later at concurrency > 1;
  at concurrency 1 the lag changes nothing).
- `OpenLoop(offsets_s)`: request i arrives at offsets_s[i] seconds after the phase starts; needs a round cost.

With an engine's prefix cache (`prefix`, pipeline.simulate.prefix: SGLang's radix cache) a round's prefills count
only the tokens past what the cache held when the request was admitted; the cache starts empty (a trial flushes
before its warm-up) and lasts across the phases.

A STANDALONE config (a draft model) is replayed the same way from the draft replay's tables (`drafts`,
pipeline.simulate.drafts): its accepted drafts per round, and the draft forwards each round ran (`Round.drafts`).
llama-server's `ngram-simple` and vLLM's `ngram` (pipeline.simulate.chains) draft one chain a step from each
request's own tokens (llama-server's cut to what the request may still generate, vLLM's whole); their drafts vary in
length, so a round's width is the mean query count of its requests (both engines verify a batch's tokens in one
forward; at one request a round, exact), and its `trees` the drafts' lengths.

With a `RoundCost` (pipeline.simulate.cost) every round gets a duration and every request its start, first-token
and finish times; without one only the rounds' order is known (enough for accept lengths in a closed loop).
Pure: no I/O, no engine.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pipeline.simulate.chains import ChainDrafter, chain_drafter, matched
from pipeline.simulate.drafts import DraftTables, StandaloneSteps
from pipeline.simulate.prefix import HeldPrefixes, PrefixCache
from serve.ngram.compiled import ngram_cache
from serve.ngram.sam import SuffixAutomaton
from serve.ngram.schedule import DraftState, NgramDrafter
from serve.spec import LlamaNgramSimpleSpec, NgramSpec, NoSpec, StandaloneSpec, VllmNgramSpec

__all__ = ["Answer", "ClosedLoop", "OpenLoop", "Phase", "Replay", "RequestReplay", "Round", "Step", "replay"]


@dataclass(frozen=True)
class Answer:
    """One recorded request: the prompt ids the engine saw and the greedy output it produced."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("simulate: an answer needs at least one prompt token (the engine's prefill has one)")
        if not self.output_ids:
            raise ValueError("simulate: an answer needs at least one output token (the prefill emits one)")


@dataclass(frozen=True)
class ClosedLoop:
    concurrency: int
    lag: int = 0

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.lag < 0:
            raise ValueError(f"simulate: ClosedLoop needs concurrency >= 1 and lag >= 0, got concurrency="
                             f"{self.concurrency}, lag={self.lag}")


@dataclass(frozen=True)
class OpenLoop:
    offsets_s: tuple[float, ...]  # arrival of request i, seconds after the phase starts (nondecreasing)


@dataclass(frozen=True)
class Phase:
    name: str  # "warmup" | "measure"
    answers: tuple[Answer, ...]
    admission: ClosedLoop | OpenLoop


@dataclass(frozen=True)
class Step:
    """One verify step: tokens it kept (accepted drafts + the bonus, cut at the output's end), the real (non-pad)
    draft nodes of its tree, and the cache length before it (the context the queries attend to)."""

    kept: int
    tree: int
    context: int


@dataclass
class RequestReplay:
    phase: str
    position: int
    prompt_tokens: int
    completion_tokens: int
    steps: list[Step] = field(default_factory=list)
    admitted_round: int = -1
    finished_round: int = -1
    after_round: int = -1  # closed loop: the round whose end released this request (-1: the replay's start)
    arrival_s: float = 0.0  # when the request reached the engine's queue (cost given)
    first_token_s: float = 0.0  # end of its prefill round
    finished_s: float = 0.0  # end of its last round
    step_ends_s: list[float] = field(default_factory=list)  # end of each verify step's round

    @property
    def spec_verify_ct(self) -> int:
        return len(self.steps)

    @property
    def spec_num_correct_drafts(self) -> int:
        return sum(s.kept - 1 for s in self.steps)

    @property
    def accepted_lengths(self) -> list[int]:
        return [s.kept for s in self.steps]


@dataclass(frozen=True)
class Round:
    """What one engine round did: the tokens each of its prefills computed (the prompt's length, less what the
    engine's prefix cache held) and, for its verify forward, the requests' query width (num_draft_tokens: pads keep
    it constant), real draft nodes and contexts. `start_s`/`end_s` with a cost."""

    prefills: tuple[int, ...]
    width: int
    trees: tuple[int, ...]
    contexts: tuple[int, ...]
    start_s: float = 0.0
    end_s: float = 0.0
    drafts: tuple[int, ...] = ()  # STANDALONE: query rows of each draft-model forward the round ran

    @property
    def batch(self) -> int:
        return len(self.trees)


RoundCost = Callable[[Round], float]  # seconds of a round (without start/end times)


@dataclass(frozen=True)
class Replay:
    requests: tuple[RequestReplay, ...]  # every phase's requests, in phase and position order
    rounds: tuple[Round, ...]
    trie_nodes: int = -1  # NGRAM: the nodes its trie held at the end, the root apart (-1: no trie)

    def phase(self, name: str) -> list[RequestReplay]:
        return [r for r in self.requests if r.phase == name]


@dataclass
class _Live:
    record: RequestReplay
    answer: Answer
    tokens: list[int]
    emitted: int = 0  # output tokens out so far
    state: DraftState = field(default_factory=DraftState)
    client: int = 0
    previous: int | None = None  # STANDALONE: accepted drafts of its previous verify step
    sequence: tuple[int, ...] = ()  # NGRAM: prompt + the whole output (`tokens` is always its prefix)


Spec = NgramSpec | NoSpec | StandaloneSpec | LlamaNgramSimpleSpec | VllmNgramSpec  # what the replay drafts with


def _drafter(spec: Spec, sams: Sequence[SuffixAutomaton]) -> NgramDrafter | None:
    if not isinstance(spec, NgramSpec):
        return None
    # the compiled trie where it builds (serve.ngram.compiled: same decisions, several times faster)
    cache = ngram_cache(max_trie_depth=spec.max_trie_depth, capacity=spec.capacity,
                        min_bfs_breadth=spec.min_bfs_breadth, max_bfs_breadth=spec.max_bfs_breadth,
                        match_type=spec.match_type, num_draft_tokens=spec.num_draft_tokens)
    loaded = tuple(sams)
    # SGLang drafts from the corpora only when one was loaded and the budget is positive (as the engine does)
    return NgramDrafter(cache, spec.external_sam_budget if loaded else 0, (lambda: loaded) if loaded else None)


def replay(spec: Spec, phases: Sequence[Phase], *,
           sams: Sequence[SuffixAutomaton] = (), max_running: int | None = None, cost: RoundCost | None = None,
           drafts: DraftTables | None = None, prefix: PrefixCache | None = None) -> Replay:
    """Run `phases` through the engine's schedule with `spec`'s drafting (NoSpec: plain decoding, one token a step).
    `sams`: the external corpora the engine would have loaded (used when spec.external_sam_budget > 0); `drafts`:
    the draft replay of a STANDALONE spec's draft model; `prefix`: the engine's prefix cache (None: it has none)."""
    if max_running is not None and max_running < 1:
        raise ValueError(f"simulate: max_running must be >= 1 or None, got {max_running}")
    standalone: StandaloneSteps | None = None
    if isinstance(spec, StandaloneSpec):
        if drafts is None:
            raise ValueError("simulate: a STANDALONE config needs the draft replay of its draft model")
        standalone = StandaloneSteps(spec, drafts)
        drafter = None
    else:
        drafter = _drafter(spec, sams)
    lookup = chain_drafter(spec)
    width = spec.num_draft_tokens if isinstance(spec, (NgramSpec, StandaloneSpec)) and spec.num_draft_tokens else 1
    records: list[RequestReplay] = []
    rounds: list[Round] = []
    now = 0.0
    held = HeldPrefixes(prefix) if prefix is not None else None
    for phase in phases:
        if isinstance(phase.admission, OpenLoop) and cost is None:
            raise ValueError("simulate: open-loop arrivals need a round cost (arrival times are in seconds)")
        now = _run_phase(phase, drafter, width, max_running, cost, records, rounds, now, standalone, held, lookup)
    return Replay(tuple(records), tuple(rounds), drafter.cache.num_nodes if drafter is not None else -1)


def _run_phase(phase: Phase, drafter: NgramDrafter | None, width: int, max_running: int | None,
               cost: RoundCost | None, records: list[RequestReplay], rounds: list[Round], start: float,
               standalone: StandaloneSteps | None = None, held: HeldPrefixes | None = None,
               lookup: ChainDrafter | None = None) -> float:
    admission = phase.admission
    # open loop: requests whose arrival fell past the window are never sent (pipeline.measure.openloop)
    answers = phase.answers[:len(admission.offsets_s)] if isinstance(admission, OpenLoop) else phase.answers
    mine = [RequestReplay(phase.name, i, len(a.prompt_ids), len(a.output_ids), arrival_s=start,
                          after_round=len(rounds) - 1) for i, a in enumerate(answers)]
    records.extend(mine)
    waiting: collections.deque[int] = collections.deque()
    due: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)  # round -> (position, client)
    client_of: dict[int, int] = {}
    sent = 0
    if isinstance(admission, ClosedLoop):
        for client in range(min(admission.concurrency, len(answers))):
            waiting.append(client)
            client_of[client] = client
        sent = len(waiting)
    running: list[_Live] = []
    now = start
    while len(waiting) or running or sent < len(answers) or due:
        index = len(rounds)
        for position, client in due.pop(index, []):
            waiting.append(position)
            client_of[position] = client
            mine[position].arrival_s = now
        if isinstance(admission, OpenLoop):
            while sent < len(answers) and start + admission.offsets_s[sent] <= now:
                mine[sent].arrival_s = start + admission.offsets_s[sent]
                waiting.append(sent)
                sent += 1
            if not waiting and not running:
                if sent >= len(answers):
                    break
                now = start + admission.offsets_s[sent]  # the engine idles until the next arrival
                continue
        elif not waiting and not running:  # clients between requests: an empty round costs nothing in the engine
            if not due:
                break
            rounds.append(Round((), width, (), ()))  # keeps round numbers aligned with the lag
            continue
        while waiting and (max_running is None or len(running) < max_running):
            position = waiting.popleft()
            record = mine[position]
            record.admitted_round = index
            answer = answers[position]
            running.append(_Live(record, answer, list(answer.prompt_ids), client=client_of.get(position, 0),
                                 sequence=answer.prompt_ids + answer.output_ids if drafter is not None else ()))
        if drafter is not None:
            drafter.begin_round()
            # One decoding request and nobody to join it before it ends (closed loop, no cost: rounds have no
            # times): its remaining rounds are its steps alone, replayed in one call (the compiled trie).
            alone = (running[0] if len(running) == 1 and running[0].emitted and not waiting and not due and cost is None
                     and isinstance(admission, ClosedLoop) else None)
            steps = drafter.replay_alone(alone.state, alone.sequence, len(alone.tokens)) if alone else None
            if alone is not None and steps is not None and isinstance(admission, ClosedLoop):
                sent = _finish_alone(alone, steps, width, rounds, held, admission, sent, due, mine, now, answers)
                running = []
                continue
        prefills: list[int] = []
        trees: list[int] = []
        contexts: list[int] = []
        forwards: list[int] = []
        stepped: list[tuple[_Live, bool]] = []
        for live in running:
            answer = live.answer
            if live.emitted == 0:  # prefill: one token
                # matched against what was held when the round began: requests prefilled together do not share
                prefills.append(held.uncached(answer.prompt_ids) if held is not None else len(answer.prompt_ids))
                live.tokens.append(answer.output_ids[0])
                live.emitted = 1
                stepped.append((live, False))
                continue
            remaining = len(answer.output_ids) - live.emitted
            if drafter is not None:
                drafts, real = drafter.replay_step(live.state, live.sequence, len(live.tokens))
            elif standalone is not None:
                drafts, real, rows = standalone.step(phase.name, answer.prompt_ids, answer.output_ids, live.emitted,
                                                     live.previous)
                live.previous = drafts
                forwards.extend(rows)
            elif lookup is not None:
                draft = lookup.draft(answer, live.tokens, remaining)
                drafts, real = matched(draft, answer.output_ids, live.emitted), len(draft)
            else:
                drafts, real = 0, 0
            kept = min(drafts + 1, remaining)
            live.record.steps.append(Step(kept, real, len(live.tokens) - 1))
            trees.append(real)
            contexts.append(len(live.tokens) - 1)
            live.tokens.extend(answer.output_ids[live.emitted:live.emitted + kept])
            live.emitted += kept
            stepped.append((live, True))
        this = Round(tuple(prefills), width if lookup is None or not trees else -(-sum(trees) // len(trees)) + 1,
                     tuple(trees), tuple(contexts), drafts=tuple(forwards))
        if cost is not None:
            end = now + cost(this)
            this = dataclasses.replace(this, start_s=now, end_s=end)
            now = end
        rounds.append(this)
        still: list[_Live] = []
        for live, verified in stepped:
            record = live.record
            if held is not None:  # SGLang caches a prompt after its prefill, prompt and output when it finishes
                done = live.emitted >= len(live.answer.output_ids)
                if done:
                    held.hold(live.answer.prompt_ids + live.answer.output_ids[:-1])
                elif not verified:
                    held.hold(live.answer.prompt_ids)
            if verified:
                record.step_ends_s.append(now)
            else:
                record.first_token_s = now
            if live.emitted >= len(live.answer.output_ids):
                record.finished_round, record.finished_s = index, now
                if isinstance(admission, ClosedLoop) and sent < len(answers):
                    due[index + 1 + admission.lag].append((sent, live.client))
                    mine[sent].after_round = index
                    sent += 1
            else:
                still.append(live)
        running = still  # finished requests leave at once (their queued inserts still land)
    return now


_SOLO: dict[tuple[int, int, int, int], tuple[Step, Round]] = {}  # (width, kept, real, context) -> its step, round


def _finish_alone(live: _Live, steps: Sequence[tuple[int, int]], width: int, rounds: list[Round],
                  held: HeldPrefixes | None, admission: ClosedLoop, sent: int,
                  due: dict[int, list[tuple[int, int]]], mine: list[RequestReplay], now: float,
                  answers: Sequence[Answer]) -> int:
    """The rounds of a request that decodes alone to its end (`steps`: (kept, real nodes) per verify step), recorded
    as `_run_phase`'s loop records them one round at a time; returns the requests sent so far."""
    record, answer = live.record, live.answer
    context = len(live.tokens) - 1
    if len(_SOLO) > 1_000_000:
        _SOLO.clear()
    for kept, real in steps:
        # a space's replays repeat these (frozen) steps and rounds many times over: made once, shared
        key = (width, kept, real, context)
        made = _SOLO.get(key)
        if made is None:
            made = _SOLO[key] = (Step(kept, real, context), Round((), width, (real,), (context,)))
        record.steps.append(made[0])
        rounds.append(made[1])
        record.step_ends_s.append(now)
        context += kept
    live.emitted = len(answer.output_ids)
    if held is not None:  # SGLang caches a request's prompt and output when it finishes
        held.hold(answer.prompt_ids + answer.output_ids[:-1])
    index = len(rounds) - 1
    record.finished_round, record.finished_s = index, now
    if sent < len(answers):
        due[index + 1 + admission.lag].append((sent, live.client))
        mine[sent].after_round = index
        sent += 1
    return sent
