"""Request-body limits shared by the production ingress and the CPU engine: bounded reading, strict JSON, and the
endpoint's `max_tokens` rules.

- `read_body`: reads an ASGI request body chunk by chunk and stops as soon as it passes the limit, whether or not
  the client declared a Content-Length (a chunked upload of 600 MB is refused after the first megabyte, not after
  it has been held in memory whole).
- `parse_json`: standard JSON only. Non-standard `NaN` / `Infinity`, numbers that overflow to infinity (`1e400`),
  integers Python refuses to convert (more than 4300 digits) and nesting deeper than `MAX_JSON_DEPTH` are errors,
  so the caller answers 400 instead of a `RecursionError` or `ValueError` becoming a 500.
- `check_required`: a generation request without its prompt (`prompt`, `messages`) is refused here, naming only
  that field: an engine's own "field required" error echoes the whole body, fields the ingress added included.
- `check_max_tokens` / `fill_max_tokens`: `max_tokens` and `max_completion_tokens` must be positive integers within
  the endpoint's limit (422 otherwise); an absent one becomes the limit (chat) or min(16, limit) (completions).
Standard library only (both floors of the house and the engine import it).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from serve.http_errors import RequestRejected, short

__all__ = ["MAX_JSON_DEPTH", "COMPLETIONS_DEFAULT_MAX_TOKENS", "BadJson", "read_body", "parse_json",
           "check_max_tokens", "fill_max_tokens", "MAX_TOKEN_FIELDS", "check_required"]

MAX_JSON_DEPTH = 64  # an OpenAI request nests ~5 deep (messages, content parts); tool schemas a few more
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


class BadJson(ValueError):
    """The body is not standard JSON the server accepts; the message says why (no echo of the body)."""


async def read_body(receive: Any, limit: int, declared: str | None = None) -> bytes:
    """The request body from ASGI `receive`, refused with 413 as soon as it exceeds `limit` bytes. A declared
    Content-Length above the limit is refused before reading (the server discards the declared body, so the client
    can finish sending and read its 413); an undeclared (chunked) body is refused once it passes the limit, and that
    413 closes the connection, so the rest of the upload is not read at all."""
    close = {"Connection": "close"}
    if declared and declared.isdigit() and int(declared) > limit:
        raise RequestRejected(413, f"request body of {declared} bytes exceeds the limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise RequestRejected(400, "the client closed the connection before the body was complete")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise RequestRejected(413, f"request body exceeds the limit of {limit} bytes (stopped reading after "
                                       f"{size})", headers=close)
        if chunk:
            chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _refuse_constant(name: str) -> Any:
    raise BadJson(f"{name} is not a JSON number (standard JSON has no NaN or Infinity); send a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise BadJson(f"the number {short(text, 40)} is out of range (it overflows to infinity); send a finite "
                      "number")
    return value


def parse_json(body: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Parse a request body as strict JSON (see the module docstring); BadJson says what is wrong."""
    try:
        data = json.loads(body, parse_constant=_refuse_constant, parse_float=_finite_float)
    except BadJson:
        raise
    except RecursionError:
        raise BadJson(f"nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, Python's 4300-digit integer limit
        if "digits" in str(exc) and not isinstance(exc, json.JSONDecodeError):
            raise BadJson(f"a number has more digits than the {sys.get_int_max_str_digits()} accepted") from None
        raise BadJson(f"not valid JSON ({str(exc)[:160]})") from None
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:  # iterative: a deep document must not recurse here either
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > max_depth:
                raise BadJson(f"nested deeper than {max_depth} levels")
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return data


def check_required(data: dict[str, Any], path: str) -> None:
    """400 when a generation request to `path` lacks its prompt: `messages` (chat) or `prompt` (completions)."""
    field = "messages" if path.endswith("/chat/completions") else "prompt"
    if field not in data:
        raise RequestRejected(400, f"{field}: field required")


def check_max_tokens(data: dict[str, Any], limit: int) -> None:
    """422 unless each of `max_tokens` / `max_completion_tokens` is absent, null or an integer in [1, limit]
    (`true`, `"5"`, `5.0` are not integers)."""
    for key in MAX_TOKEN_FIELDS:
        value = data.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RequestRejected(422, f"{key} must be a positive integer, got {short(value)}")
        if value > limit:
            raise RequestRejected(422, f"{key}={short(value)} exceeds this endpoint's limit of {limit}")


def fill_max_tokens(data: dict[str, Any], chat: bool, limit: int) -> int | None:
    """Give a request without `max_tokens` / `max_completion_tokens` the endpoint's default (in place): the limit
    for chat (absent would mean "up to the context"), min(16, limit) for completions. Returns the value filled in,
    None when the client sent one."""
    if any(data.get(key) is not None for key in MAX_TOKEN_FIELDS):
        return None
    value = limit if chat else min(COMPLETIONS_DEFAULT_MAX_TOKENS, limit)
    data["max_tokens"] = value
    return value
