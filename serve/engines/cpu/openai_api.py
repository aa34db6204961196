"""OpenAI-compatible routes: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (both streaming).

One choice per request (`n` = 1); no logprobs, tools or response formats (400 if asked). Chat prompts are rendered
with the tokenizer's own chat template. Types are strict (`"2"` is not 2); stop strings are bounded as in `params`;
`max_tokens` absent means 16 for completions (OpenAI's default) and the room left in the context for chat, and the
token budget of the scheduler bounds what that can reserve. A client that disconnects cancels its request.
Usage reports prompt/completion/total tokens. A request with `return_spec_tokens_details: true` also gets the
request's speculative counters where SGLang 0.5.23 puts them: `sglext.spec_tokens_details` of the answer, or of a
chunk without choices sent after the finish chunk and before the usage chunk of a stream; absent on a request that
verified no draft (no speculation), as SGLang leaves it out when meta_info has no spec keys.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from serve.engines.cpu.engine import LoadedEngine
from serve.engines.cpu.params import INT64, BadRequest, SamplingParams, check_stops, parse_model
from serve.engines.cpu.streaming import RequestStream, Snapshot, collect, error_response, read_json, sse

__all__ = ["register_openai_routes", "spec_tokens_details"]


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    n: int = Field(1, ge=1, le=1)
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    user: str | None = None
    return_spec_tokens_details: bool = False  # SGLang's extension: the request's spec counters in `sglext`

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        return check_stops(value)


class CompletionBody(_Common):
    prompt: str | list[str] | list[int]
    echo: bool = Field(False, description="not implemented: only false")
    logprobs: None = None
    best_of: int | None = Field(None, ge=1, le=1)
    suffix: None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class ChatBody(_Common):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="not implemented: only false")


def register_openai_routes(app: FastAPI, engine: LoadedEngine) -> None:
    name = engine.config.served_model_name

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [
            {"id": name, "object": "model", "created": int(engine.started_at), "owned_by": "specdec-tuner",
             "root": name, "max_model_len": engine.context_length}]})

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        body: CompletionBody = parse_model(CompletionBody, await read_json(http))
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise BadRequest("prompt: the CPU engine takes one prompt per request, got a list of "
                                 f"{len(prompt)}; send them as separate requests")
            prompt = prompt[0]
        if body.echo:
            raise BadRequest("echo: not implemented by the CPU engine; send false")
        token_ids = None if isinstance(prompt, str) else [t for t in prompt if isinstance(t, int)]
        ids = await engine.factory.prompt_ids_async(prompt if isinstance(prompt, str) else None, token_ids)
        return await _run(engine, http, body, ids, body.max_tokens if body.max_tokens is not None else 16,
                          chat=False)

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest):
        body: ChatBody = parse_model(ChatBody, await read_json(http))
        if body.logprobs:
            raise BadRequest("logprobs: not implemented by the CPU engine; send false")
        tokenizer = engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise BadRequest(f"messages: model {name!r} has no chat template; use /v1/completions with a plain prompt")
        messages = [_flatten(m) for m in body.messages]
        size = sum(len(m["content"]) for m in messages)
        engine.factory.check_length("".join(m["content"] for m in messages), "messages")  # the cheap bound first

        def render(tok: Any) -> list[int]:
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            engine.factory.check_length(text, "messages")
            return list(tok.encode(text, add_special_tokens=False))

        ids = await engine.factory.tokenize(render, size)
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if limit is None:  # OpenAI/SGLang: up to the context; bounded here by the room left
            limit = max(1, engine.context_length - len(ids))
        return await _run(engine, http, body, ids, limit, chat=True)


def _flatten(message: _Message) -> dict:
    content = message.content
    if isinstance(content, list):
        parts = []
        for part in content:
            if part.get("type") != "text":
                raise BadRequest(f"messages: content part type {part.get('type')!r} is not supported (text only)")
            piece = part.get("text", "")
            if not isinstance(piece, str):
                raise BadRequest(f"messages: a text part's `text` must be a string, got {type(piece).__name__}")
            parts.append(piece)
        content = "".join(parts)
    return {"role": message.role, "content": content or ""}


async def _run(engine: LoadedEngine, http: HttpRequest, body: _Common, ids: list[int], max_tokens: int, chat: bool):
    params = parse_model(SamplingParams, {
        "max_new_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
        "min_p": body.min_p, "stop": body.stop, "seed": body.seed, "ignore_eos": body.ignore_eos,
        "frequency_penalty": body.frequency_penalty, "presence_penalty": body.presence_penalty})
    field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
    req = engine.factory.build(ids, params, field=field)
    kind = "chatcmpl" if chat else "cmpl"
    rid, created, model = f"{kind}-{req.rid}", int(time.time()), engine.config.served_model_name
    factory = engine.factory

    def usage(snap: Snapshot) -> dict:
        done = snap.meta_info["completion_tokens"]
        return {"prompt_tokens": len(ids), "completion_tokens": done, "total_tokens": len(ids) + done}

    def sglext(snap: Snapshot) -> dict | None:
        details = spec_tokens_details(snap.meta_info) if body.return_spec_tokens_details else None
        return None if details is None else {"spec_tokens_details": details}

    def finish(snap: Snapshot) -> str | None:
        reason = snap.meta_info["finish_reason"]
        return None if reason is None else ("length" if reason["type"] == "length" else "stop")

    stream = RequestStream(engine, req)
    if not body.stream:
        last = await collect(stream, http)
        if last is None:  # the client is gone; nobody reads this
            return error_response("client disconnected", 499)
        if last.error:
            return error_response(last.error, 500)
        text = factory.text_of(last.output_ids, last.meta_info["finish_reason"], params, True)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish(last), "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        answer = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                  "model": model, "choices": [choice], "usage": usage(last)}
        extension = sglext(last)
        return JSONResponse(answer if extension is None else {**answer, "sglext": extension})

    obj = "chat.completion.chunk" if chat else "text_completion"
    include_usage = bool((body.stream_options or {}).get("include_usage"))

    def chunk(delta: str | None, reason: str | None, first: bool = False) -> bytes:
        if chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else ({} if delta is None else
                                                                                    {"content": delta})
            choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
        return sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]})

    async def events() -> AsyncIterator[bytes]:
        sent = ""
        if chat:
            yield chunk(None, None, first=True)
        async for snap in stream:
            if snap.error:
                yield sse({"error": {"message": snap.error, "code": 500}})
                break
            text = factory.text_of(snap.output_ids, snap.meta_info["finish_reason"], params, snap.finished)
            delta = text[len(sent):] if text.startswith(sent) else ""
            if delta:
                sent += delta
                yield chunk(delta, None)
            if snap.finished:
                yield chunk(None, finish(snap))
                extension = sglext(snap)
                if extension is not None:
                    yield sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                               "sglext": extension})
                if include_usage:
                    yield sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                                "usage": usage(snap)})
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def spec_tokens_details(meta_info: dict[str, Any]) -> dict[str, Any] | None:
    """SGLang 0.5.23's `SpecTokensDetails` from a request's meta_info (`spec_tokens_details_from_meta_info` in
    sglang/srt/entrypoints/openai/utils.py): every field, 0 or [] where meta_info lacks it; None without spec keys."""
    if not any(key in meta_info for key in _SPEC_DETAIL_KEYS):
        return None
    return {key: meta_info.get(key) or (list(empty) if isinstance(empty, list) else empty)
            for key, empty in _SPEC_DETAIL_KEYS.items()}


_SPEC_DETAIL_KEYS: dict[str, Any] = {
    "spec_accept_rate": 0.0, "spec_accept_length": 0.0, "spec_cap_length": 0.0, "spec_block_accept_length": 0.0,
    "spec_num_correct_drafts": 0, "spec_num_proposed_drafts": 0, "spec_verify_ct": 0,
    "spec_correct_drafts_histogram": [], "spec_cap_lens_histogram": []}
