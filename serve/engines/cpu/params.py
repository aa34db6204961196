"""Request bodies of `/generate` (SGLang 0.5.23 names and defaults) and their translation into `decode.Request`s.

Unknown fields are errors (HTTP 400 naming them). SGLang parameters the engine does not implement are accepted only
at their neutral value (e.g. `frequency_penalty` 0), so that a client is never silently given something else.

Hostile input is refused with 400, never a 500 or a stalled server: types are strict (`"2"` is not 2, `true` is not a
token id), numbers finite (no NaN or infinity), seeds must fit int64, text must be valid Unicode (no lone
surrogates), and stop strings are bounded (at most `MAX_STOP_STRINGS` of at most `MAX_STOP_CHARS` characters each,
as OpenAI bounds them to 4) and checked in time linear in their length (`held_back`). A prompt text longer than
`INLINE_TOKENIZE_CHARS` is tokenized on a worker thread (`prompt_ids_async`, `tokenize`), not on the event loop: a
520,000-character prompt costs a quarter to one second of tokenizing, which would stall every other request and
`/health` meanwhile.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from serve.engines.cpu.decode import Request, StopRules
from serve.engines.cpu.verify import Sampling

__all__ = ["BadRequest", "SamplingParams", "GenerateBody", "RequestFactory", "parse_model", "DEFAULT_MAX_NEW_TOKENS",
           "MAX_STOP_STRINGS", "MAX_STOP_CHARS", "MAX_STOP_TOKEN_IDS", "held_back", "check_text", "stop_list",
           "check_stops", "INT64", "INLINE_TOKENIZE_CHARS"]

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # a stop string is a short marker; a 400k-character one blocked the event loop for 13.8 s
MAX_STOP_TOKEN_IDS = 64
INT64 = (-(2**63), 2**63 - 1)
MAX_CHARS_PER_TOKEN = 64  # a prompt longer than context_length * this cannot fit: refuse it before tokenizing
INLINE_TOKENIZE_CHARS = 16_384  # tokenizing this much takes a few ms: done on the event loop; more on the thread
T = TypeVar("T")


class BadRequest(ValueError):
    """Client error: becomes HTTP 400 with this message."""


class _Strict(BaseModel):
    # strict: JSON has real numbers and booleans, so a string "2" or a `true` where an int is due is a client bug;
    # and no float is NaN or infinite (`1e400` parses as infinity)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SamplingParams(_Strict):
    max_new_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    sampling_seed: int | None = Field(None, ge=INT64[0], le=INT64[1])  # SGLang's name for the per-request seed
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(1, ge=1, le=1, description="the CPU engine returns one sample per request")
    min_new_tokens: int = Field(0, ge=0, le=0, description="not implemented: only 0")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not implemented: only 0")
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not implemented: only 0")
    repetition_penalty: float = Field(1.0, ge=1.0, le=1.0, description="not implemented: only 1")

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        return check_stops(value)


class GenerateBody(_Strict):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)

    @field_validator("sampling_params", mode="before")
    @classmethod
    def _none_is_default(cls, value: Any) -> Any:
        return {} if value is None else value
    stream: bool = False
    rid: str | None = Field(None, max_length=256)  # echoed in every meta_info: bounded
    return_logprob: bool = Field(False, description="not implemented: only false")
    log_metrics: bool = True


def stop_list(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def check_stops(value: str | list[str] | None) -> str | list[str] | None:
    """A pydantic validator body: at most MAX_STOP_STRINGS non-empty stops of at most MAX_STOP_CHARS characters."""
    stops = stop_list(value)
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    for s in stops:
        if not s:
            raise ValueError("empty stop strings are not allowed")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters, got one of {len(s)}")
    return value


def check_text(data: Any, where: str = "body") -> None:
    """Raise BadRequest naming the first string in `data` that is not valid Unicode (a lone surrogate, which JSON's
    `\\ud800` escapes can carry and which no tokenizer can encode)."""
    stack = [(where, data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                raise BadRequest(f"{path}: not valid Unicode (lone surrogate at character {err.start}); "
                                 "send UTF-8 text") from None
        elif isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path != "body" else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", v) for i, v in enumerate(value))


def held_back(text: str, stops: list[str]) -> int:
    """How many trailing characters of `text` may be the start of a stop string (so must not be streamed yet):
    the longest proper prefix of any stop that `text` ends with. Knuth-Morris-Pratt over the last len(stop) - 1
    characters, so the cost is linear in the stop lengths, whatever the text."""
    longest = 0
    for stop in stops:
        m = len(stop)
        if m < 2:
            continue
        fail = [0] * m  # fail[i]: longest proper border of stop[:i + 1]
        k = 0
        for i in range(1, m):
            while k and stop[i] != stop[k]:
                k = fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            fail[i] = k
        k = 0
        for ch in text[-(m - 1):]:
            while k and ch != stop[k]:
                k = fail[k - 1]
            if ch == stop[k]:
                k += 1
        longest = max(longest, k)
    return longest


def parse_model(kind: type[BaseModel], data: Any) -> Any:
    """Validate `data` as `kind`; raise BadRequest naming each bad field, its value and the rule."""
    check_text(data)
    try:
        return kind.model_validate(data)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"]) or "body"
            if e["type"] == "extra_forbidden":
                problems.append(f"{where}: unknown field")
            elif e["type"] == "missing":  # its input is the whole enclosing object: fields the caller never sent
                problems.append(f"{where}: field required")
            else:
                problems.append(f"{where}: {e['msg']}, got {_short(e.get('input'))}")
        raise BadRequest("; ".join(problems)) from None


def _short(value: Any, limit: int = 80) -> str:
    # error messages echo the bad value, but never a 900 KB one
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class RequestFactory:
    """Turns validated parameters into `Request`s for one model: tokenization, context and stop rules, seeds."""

    def __init__(self, tokenizer: Any, eos_ids: frozenset[int], context_length: int, vocab_size: int,
                 random_seed: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.context_length = context_length
        self.vocab_size = vocab_size
        self._seed = random_seed
        self._count = 0
        self._pool: ThreadPoolExecutor | None = None
        self._own: Any = None  # the worker thread's tokenizer: a copy, never used by two threads at once
        self._pool_lock = threading.Lock()

    async def tokenize(self, work: Callable[[Any], T], chars: int) -> T:
        """`work(tokenizer)`: inline when `chars` (the text's size) is small, else on the one tokenizer thread with
        its own copy of the tokenizer (a fast tokenizer must not be used by two threads at once), so the event loop
        keeps serving. Big prompts wait for each other there, not for the loop."""
        if chars <= INLINE_TOKENIZE_CHARS:
            return work(self.tokenizer)
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

        def run() -> T:
            if self._own is None:
                self._own = copy.deepcopy(self.tokenizer)
            return work(self._own)

        return await asyncio.get_running_loop().run_in_executor(self._pool, run)

    def prompt_ids(self, text: str | None, input_ids: list[int] | None) -> list[int]:
        """The prompt's token ids, tokenized here (tests, tools); the routes use `prompt_ids_async`."""
        self._check_prompt(text, input_ids)
        return self._checked_ids(list(self.tokenizer.encode(text)) if text is not None else None, input_ids)

    async def prompt_ids_async(self, text: str | None, input_ids: list[int] | None) -> list[int]:
        """`prompt_ids`, with a long text tokenized off the event loop (`tokenize`)."""
        self._check_prompt(text, input_ids)
        ids = None
        if text is not None:
            ids = await self.tokenize(lambda tok: list(tok.encode(text)), len(text))
        return self._checked_ids(ids, input_ids)

    def _check_prompt(self, text: str | None, input_ids: list[int] | None) -> None:
        if (text is None) == (input_ids is None):
            raise BadRequest("body: exactly one of `text` or `input_ids` is required"
                             + (" (got both)" if text is not None else " (got neither)"))
        if text is not None:
            self.check_length(text, "text")

    def _checked_ids(self, encoded: list[int] | None, input_ids: list[int] | None) -> list[int]:
        if encoded is not None:
            ids = encoded
        else:
            given = input_ids or []
            bad = [t for t in given if not 0 <= t < self.vocab_size]
            if bad:
                raise BadRequest(f"input_ids: token ids must be in [0, {self.vocab_size}), got {bad[0]}")
            ids = list(given)
        if not ids:
            raise BadRequest("body: the prompt is empty (no tokens); send a non-empty `text` or `input_ids`")
        return ids

    def check_length(self, text: str, where: str) -> None:
        """Refuse text that cannot fit the context before tokenizing it (the cheap bound, checked first)."""
        limit = self.context_length * MAX_CHARS_PER_TOKEN
        if len(text) > limit:
            raise BadRequest(f"{where}: {len(text)} characters cannot fit context_length={self.context_length} "
                             f"(limit {limit} characters); send a shorter prompt")

    def build(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None,
              field: str = "sampling_params.max_new_tokens") -> Request:
        """`field`: the name the client used for max_new_tokens (the OpenAI routes: `max_tokens`), for messages."""
        room = self.context_length - len(prompt_ids)
        if room <= 0:
            raise BadRequest(f"prompt: {len(prompt_ids)} tokens leave no room in context_length={self.context_length}")
        if params.max_new_tokens is None:
            max_new = min(DEFAULT_MAX_NEW_TOKENS, room)
        else:
            max_new = params.max_new_tokens
            if max_new <= 0:
                raise BadRequest(f"{field}: must be >= 1, got {max_new}")
            if max_new > room:
                name = field.rsplit(".", 1)[-1]
                raise BadRequest(
                    f"{field}: prompt_tokens + {name} = {len(prompt_ids)} + {max_new} exceeds "
                    f"context_length={self.context_length}; lower {name} to <= {room}")
        stops = stop_list(params.stop)
        bad_stop_ids = [t for t in params.stop_token_ids or () if not 0 <= t < self.vocab_size]
        if bad_stop_ids:
            raise BadRequest(f"sampling_params.stop_token_ids: token ids must be in [0, {self.vocab_size}), "
                             f"got {bad_stop_ids[0]}")
        stop_len = max((len(self.tokenizer.encode(s, add_special_tokens=False)) for s in stops), default=0)
        rules = StopRules(
            max_new_tokens=max_new, eos_ids=self.eos_ids, stop_token_ids=frozenset(params.stop_token_ids or ()),
            stop_strs=tuple(stops), stop_str_max_tokens=stop_len, ignore_eos=params.ignore_eos)
        sampling = Sampling(temperature=params.temperature, top_p=params.top_p,
                            top_k=params.top_k if params.top_k > 0 else -1, min_p=params.min_p)
        self._count += 1
        seed = params.sampling_seed if params.sampling_seed is not None else params.seed
        if seed is None:
            seed = (self._seed * 1_000_003 + self._count) % 2**63
        return Request(rid=rid or uuid.uuid4().hex, prompt_ids=prompt_ids, sampling=sampling, rules=rules, seed=seed)

    def text_of(self, output_ids: list[int], finish_reason: dict | None, params: SamplingParams,
                final: bool) -> str:
        """Output text as SGLang returns it: special tokens skipped, cut before a matched stop string. While the
        request runs (`final` False), an incomplete UTF-8 tail and a tail that may be the start of a stop string are
        held back, so that streamed text only ever grows."""
        text = self.tokenizer.decode(output_ids, skip_special_tokens=params.skip_special_tokens)
        matched = (finish_reason or {}).get("matched")
        if isinstance(matched, str) and not params.no_stop_trim:
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        if final:
            return text
        text = text.rstrip("\ufffd")
        return text[: len(text) - held_back(text, stop_list(params.stop))]
