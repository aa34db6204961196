"""Error answers of the production endpoint, in OpenAI's error shape, and how a failure becomes one.

Every answer the ingress gives for a failed request is built here: a refused request (`RequestRejected`: 400, 401,
413, 422), a busy engine (429 + Retry-After), an engine that is gone or restarting (503 + Retry-After), an engine
that did not answer in time (504), and anything unexpected (500, logged by type, never with the request body).
`failure_answer` maps an exception raised while forwarding (the engine client's `EngineUnavailable`, httpx's
connection errors, Ray's dead-actor errors, Serve's "no replica") to its status, so that a dead engine is a 503 and
never a bare 500. Pure, except for the log line of a 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi.responses import JSONResponse

__all__ = ["RequestRejected", "EngineUnavailable", "error_body", "error_response", "busy_response",
           "unavailable_response", "failure_answer", "short"]

log = logging.getLogger("serve.production.ingress")


class RequestRejected(Exception):
    """A request the endpoint refuses: `status` (4xx), a message naming the field and the fix, OpenAI's `kind`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.headers = dict(headers or {})


class EngineUnavailable(RuntimeError):
    """The engine cannot answer now: its process exited, its port refuses, or it dropped the connection. Raised by
    the engine client in the replica that owns the engine; the ingress answers 503 with Retry-After."""


def short(value: Any, limit: int = 80) -> str:
    """`repr(value)` cut to `limit` characters: error messages echo a bad value, never a megabyte of it."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": status}}


def error_response(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error shape, so clients raise their usual exception types."""
    return JSONResponse(error_body(status, message, kind), status_code=status, headers=headers)


def busy_response(why: str, retry_after_s: int) -> JSONResponse:
    return error_response(429, f"{why}; retry after {retry_after_s} s", "rate_limit_error",
                          {"Retry-After": str(retry_after_s)})


def unavailable_response(why: str, retry_after_s: int) -> JSONResponse:
    return error_response(503, f"{why}; retry after {retry_after_s} s", "service_unavailable",
                          {"Retry-After": str(retry_after_s)})


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc`, the exception a Ray task error wraps, and their `__cause__` chain (bounded)."""
    found: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo and len(found) < 16:
        current = todo.pop()
        if current is None or any(current is seen for seen in found):
            continue
        found.append(current)
        todo.extend([getattr(current, "cause", None), current.__cause__])
    return found


def failure_answer(exc: BaseException) -> tuple[int, str]:
    """(status, message) for an exception raised while forwarding a request to an engine: 503 when the engine (or
    the replica that owns it) is gone or unreachable, 504 when it did not answer in time, 500 otherwise. Pure."""
    import httpx

    try:
        from ray.exceptions import RayActorError, RayTaskError
        from ray.serve.exceptions import DeploymentUnavailableError
        gone: tuple[type[BaseException], ...] = (RayActorError, DeploymentUnavailableError)
        wrapper: tuple[type[BaseException], ...] = (RayTaskError,)
    except ImportError:  # pragma: no cover - Ray is pinned; without it only the engine's own errors are known
        gone = wrapper = ()
    for cause in _causes(exc):
        if wrapper and isinstance(cause, wrapper) and getattr(cause, "cause", None) is not None:
            continue  # the remote traceback: the exception it carries says what happened, in one line
        if isinstance(cause, EngineUnavailable):
            return 503, f"the engine is unavailable ({cause})"
        if isinstance(cause, httpx.TimeoutException):
            return 504, f"the engine did not answer in time ({type(cause).__name__})"
        if isinstance(cause, httpx.TransportError):
            return 503, f"the engine connection failed ({type(cause).__name__})"
        if gone and isinstance(cause, gone):
            return 503, "the engine's replica is restarting"
    return 500, f"internal error ({type(exc).__name__}); the request was not completed"


def log_failure(route: str, exc: BaseException) -> None:
    """One line for an unexpected failure: its type and message, never the request (it may hold user data)."""
    log.error("%s: unexpected %s: %s", route, type(exc).__name__, short(str(exc), 300))
