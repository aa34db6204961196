"""Request bodies of `/generate` (SGLang 0.5.23 names and defaults) and their translation into `decode.Request`s.

Unknown fields are errors (HTTP 400 naming them). SGLang parameters the engine does not implement are accepted only
at their neutral value (e.g. `frequency_penalty` 0), so that a client is never silently given something else.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from serve.engines.cpu.decode import Request, StopRules
from serve.engines.cpu.verify import Sampling

__all__ = ["BadRequest", "SamplingParams", "GenerateBody", "RequestFactory", "parse_model", "DEFAULT_MAX_NEW_TOKENS"]

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


class BadRequest(ValueError):
    """Client error: becomes HTTP 400 with this message."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingParams(_Strict):
    max_new_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    sampling_seed: int | None = None  # SGLang's name for the per-request seed
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = Field(1, ge=1, le=1, description="the CPU engine returns one sample per request")
    min_new_tokens: int = Field(0, ge=0, le=0, description="not implemented: only 0")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not implemented: only 0")
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not implemented: only 0")
    repetition_penalty: float = Field(1.0, ge=1.0, le=1.0, description="not implemented: only 1")


class GenerateBody(_Strict):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)

    @field_validator("sampling_params", mode="before")
    @classmethod
    def _none_is_default(cls, value: Any) -> Any:
        return {} if value is None else value
    stream: bool = False
    rid: str | None = None
    return_logprob: bool = Field(False, description="not implemented: only false")
    log_metrics: bool = True


def parse_model(kind: type[BaseModel], data: Any) -> Any:
    """Validate `data` as `kind`; raise BadRequest naming each bad field, its value and the rule."""
    try:
        return kind.model_validate(data)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            where = ".".join(str(p) for p in e["loc"]) or "body"
            if e["type"] == "extra_forbidden":
                problems.append(f"{where}: unknown field")
            else:
                problems.append(f"{where}: {e['msg']}, got {e.get('input')!r}")
        raise BadRequest("; ".join(problems)) from None


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

    def prompt_ids(self, text: str | None, input_ids: list[int] | None) -> list[int]:
        if (text is None) == (input_ids is None):
            raise BadRequest("body: exactly one of `text` or `input_ids` is required"
                             + (" (got both)" if text is not None else " (got neither)"))
        if text is not None:
            ids = list(self.tokenizer.encode(text))
        else:
            bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise BadRequest(f"input_ids: token ids must be in [0, {self.vocab_size}), got {bad[0]}")
            ids = list(input_ids)
        if not ids:
            raise BadRequest("body: the prompt is empty (no tokens); send a non-empty `text` or `input_ids`")
        return ids

    def build(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None) -> Request:
        room = self.context_length - len(prompt_ids)
        if room <= 0:
            raise BadRequest(f"prompt: {len(prompt_ids)} tokens leave no room in context_length={self.context_length}")
        if params.max_new_tokens is None:
            max_new = min(DEFAULT_MAX_NEW_TOKENS, room)
        else:
            max_new = params.max_new_tokens
            if max_new <= 0:
                raise BadRequest(f"sampling_params.max_new_tokens: must be >= 1, got {max_new}")
            if max_new > room:
                raise BadRequest(
                    f"sampling_params.max_new_tokens: prompt_tokens + max_new_tokens = {len(prompt_ids)} + {max_new} "
                    f"exceeds context_length={self.context_length}; lower max_new_tokens to <= {room}")
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        if any(s == "" for s in stops):
            raise BadRequest("sampling_params.stop: empty stop strings are not allowed")
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
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return text[: len(text) - hold]
