"""What the simulator replays: the baseline's recorded answers, arranged the way a trial sends its requests.

`answers_of` turns the baseline trial's request records (warm-up, measurement and the `reference` phase, in which the
baseline answers the rest of the warm-up split) into one `Answer` per prompt: the prompt ids the engine saw
(`RequestRecord.prompt_ids`, checked against the engine's own `prompt_tokens`) and its greedy output ids. A greedy
lossless config emits the same tokens for the same prompt whatever it drafts, so one answer per prompt serves every
config.

`phases_for` is `pipeline.trial.lifecycle.measure_config`'s traffic for one trial: `warmup_requests` requests cycled
from the warm-up split at the trial's concurrency (closed loop), then the measurement split, closed loop at the
trial's concurrency or the study's seeded Poisson arrivals (`pipeline.measure.openloop.poisson_schedule`).

`corpus_automaton` loads an external corpus file the way the engine does (`serve.ngram.corpus.corpus_file_chunks`:
documents tokenized without special tokens, joined by the separator, SGLang's limit) into one suffix automaton.
Pure apart from reading the corpus file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from pipeline.measure.openloop import poisson_schedule
from pipeline.measure.summary import RequestRecord
from pipeline.simulate.replay import Answer, ClosedLoop, OpenLoop, Phase
from serve.ngram.corpus import corpus_file_chunks
from serve.ngram.sam import SuffixAutomaton

__all__ = ["Unsimulable", "answers_of", "corpus_automaton", "phases_for"]


class Unsimulable(ValueError):
    """The recorded baseline cannot be replayed (a missing answer or prompt ids, a failed request); the message
    says which request and why."""


def answers_of(records: Iterable[RequestRecord]) -> dict[int, Answer]:
    """prompt index -> Answer, from every successful record that carries prompt ids (any phase)."""
    out: dict[int, Answer] = {}
    for r in records:
        if not r.ok or not r.output_ids:
            continue
        if r.prompt_ids is None:
            continue
        if r.prompt_tokens and len(r.prompt_ids) != r.prompt_tokens:
            raise Unsimulable(
                f"request {r.request_id} (prompt {r.prompt_index}): the recorded prompt ids ({len(r.prompt_ids)}) "
                f"differ from the engine's prompt_tokens ({r.prompt_tokens}): the client tokenized the prompt "
                "differently from the engine, so the trie's inputs are unknown")
        if len(r.output_ids) != r.completion_tokens:
            raise Unsimulable(f"request {r.request_id}: {len(r.output_ids)} output ids for "
                              f"{r.completion_tokens} completion tokens")
        answer = Answer(tuple(r.prompt_ids), tuple(r.output_ids))
        known = out.setdefault(r.prompt_index, answer)
        if known != answer:
            raise Unsimulable(f"prompt {r.prompt_index} was answered twice with different tokens: greedy decoding "
                              "was not deterministic on this engine, so one answer per prompt does not hold")
    return out


def _need(answers: dict[int, Answer], index: int, split: str) -> Answer:
    answer = answers.get(index)
    if answer is None:
        raise Unsimulable(f"no recorded answer for {split} prompt {index}: the baseline must answer the whole "
                          "warm-up split (its `reference` phase) and the measurement split, with prompt ids")
    return answer


def phases_for(trial: Any, warmup: Sequence[Any], measure: Sequence[Any], answers: dict[int, Answer], *,
               arrival: Any = None, seed: int = 0, lag: int = 0) -> list[Phase]:
    """The phases a trial sends (`trial` is a TrialConfig; `warmup`/`measure` the study's LoadRequests;
    `arrival` its workload.arrival settings; `lag` the closed loop's rounds between a reply and its successor)."""
    warm_count = trial.warmup_requests if warmup else 0
    warm = tuple(_need(answers, warmup[i % len(warmup)].index, "warm-up") for i in range(warm_count))
    measured = tuple(_need(answers, item.index, "measurement") for item in measure)
    phases = [Phase("warmup", warm, ClosedLoop(trial.concurrency, lag))] if warm else []
    if arrival is not None and arrival.open_loop:
        offsets = poisson_schedule(len(measured), arrival.rate_per_s, seed=seed, max_duration_s=arrival.max_duration_s)
        phases.append(Phase("measure", measured, OpenLoop(tuple(offsets))))
    else:
        phases.append(Phase("measure", measured, ClosedLoop(trial.concurrency, lag)))
    return phases


def corpus_automaton(path: str | Path, encode: Callable[[str], Sequence[int]], max_tokens: int) -> SuffixAutomaton:
    """The suffix automaton the engine builds from a JSONL corpus file."""
    sam = SuffixAutomaton()
    for chunk in corpus_file_chunks(path, encode, max_tokens):
        sam.append(chunk)
    sam.finalize()
    return sam
