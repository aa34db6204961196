"""The production ingress as Serve ships it, and the pure parts of its error handling (issue #31 items 1, 2, 3, 4, 7).

`@serve.ingress` freezes the FastAPI app while serve/production/ingress.py is still being imported, which rebinds the class's
methods to a copy of the module's globals as they were at that moment: a helper defined below the class is missing in
the replica (every invalid max_tokens was a NameError 500). The first test checks the methods Serve ships, so it
fails for any such helper, whatever request would reach it."""

from __future__ import annotations

import asyncio
import builtins
import dis
import inspect
import json
from typing import Any, cast

import httpx
import pytest
from ray.serve import Deployment
from starlette.requests import Request

import serve.production.ingress as ingress
from serve.closed_loop.capture import Capture
from serve.http_errors import EngineUnavailable, RequestRejected, failure_answer
from serve.http_limits import MAX_JSON_DEPTH, BadJson, check_max_tokens, fill_max_tokens, parse_json, read_body
from serve.production.settings import ProductionSettings
from serve.production.stream_relay import relay


def _global_names(code):
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            yield instruction.argval
    for const in code.co_consts:
        if inspect.iscode(const):
            yield from _global_names(const)


def _shipped_classes():
    """OpenAIIngress as Serve deploys it: the wrapper Serve builds and the user class under it."""
    # mypy keeps a decorated class's own type; @serve.deployment made the name a Deployment
    deployed = cast(Deployment, ingress.OpenAIIngress).func_or_class
    assert isinstance(deployed, type)
    return [c for c in deployed.__mro__ if c.__module__ == "serve.production.ingress"]


def test_every_global_a_shipped_method_uses_exists_where_it_runs():
    missing = []
    for cls in _shipped_classes():
        for name, member in vars(cls).items():
            function = getattr(member, "__func__", member)
            if not inspect.isfunction(function):
                continue
            for used in _global_names(function.__code__):
                if used not in function.__globals__ and not hasattr(builtins, used):
                    missing.append(f"{cls.__qualname__}.{name} uses {used}")
    assert missing == [], "bind these above the class in serve/production/ingress.py (or import them)"


def _request(path: str = "/v1/completions", body: bytes = b"{}") -> Request:
    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    return Request({"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}, receive)


def _bare_ingress():
    """The shipped class with the state `_guarded` reads, without Serve (no engine is asked)."""
    cls = _shipped_classes()[-1]
    obj = object.__new__(cls)
    obj.settings = ProductionSettings(config_file="unused.json")
    obj.metrics = ingress.IngressMetrics()
    obj.capture = Capture(None)
    obj.enforce = False
    return obj


def test_an_unexpected_failure_is_a_500_in_openai_shape_and_is_counted():
    obj = _bare_ingress()

    async def broken(_request):
        raise KeyError("something nobody expected")

    response = asyncio.run(obj._guarded(_request(), "/v1/completions", broken))
    assert response.status_code == 500
    error = json.loads(response.body)["error"]
    assert error["code"] == 500 and "KeyError" in error["message"]
    assert obj.metrics.requests.labels("/v1/completions", "500")._value.get() == 1


def test_a_dead_engine_is_a_503_with_retry_after_and_is_counted():
    obj = _bare_ingress()

    async def engine_gone(_request):
        raise EngineUnavailable("the engine exited with code -9")

    response = asyncio.run(obj._guarded(_request(), "/v1/completions", engine_gone))
    assert response.status_code == 503 and response.headers["retry-after"] == str(obj.settings.retry_after_s)
    assert "exited with code -9" in json.loads(response.body)["error"]["message"]
    assert obj.metrics.requests.labels("/v1/completions", "503")._value.get() == 1


class _HealthCall:
    """A Serve handle call to an engine's /health: answers `answer` (an exception is raised), or never answers when
    it is None, as a paused engine; records its cancellation."""

    def __init__(self, answer: tuple | BaseException | None) -> None:
        self.answer, self.cancelled = answer, False

    def __await__(self):
        if isinstance(self.answer, BaseException):
            raise self.answer
        if self.answer is None:
            yield from asyncio.Event().wait().__await__()
        return self.answer

    def cancel(self) -> None:
        self.cancelled = True


class _EngineHandle:
    def __init__(self, answer: tuple | BaseException | None) -> None:
        self.answer, self.call = answer, self
        self.calls: list[_HealthCall] = []

    def remote(self, method: str, path: str) -> _HealthCall:
        assert (method, path) == ("GET", "/health")
        self.calls.append(_HealthCall(self.answer))
        return self.calls[-1]


def _health(obj) -> Any:
    return asyncio.run(asyncio.wait_for(obj.health(), 60))  # a /health that hangs fails here instead


def test_health_is_503_for_a_dead_engine_and_a_bounded_504_for_one_that_never_answers():
    # The cheap check of what tests/end_to_end/test_production_faults.py does to a real engine (SIGKILL, SIGSTOP).
    obj = _bare_ingress()
    obj.settings = ProductionSettings(config_file="unused.json", health_timeout_s=0.05)
    obj.gap = None
    healthy: tuple[int, dict, bytes] = (200, {}, b"")
    obj.engines = {"low": _EngineHandle(healthy), "high": _EngineHandle(healthy)}
    assert _health(obj).status_code == 200
    obj.engines["high"] = _EngineHandle(EngineUnavailable("the engine exited with code -9"))
    gone = _health(obj)
    assert gone.status_code == 503 and gone.headers["retry-after"] == str(obj.settings.retry_after_s)
    assert "exited with code -9" in json.loads(gone.body)["error"]["message"]
    paused = obj.engines["high"] = _EngineHandle(None)  # healthy only when every engine is
    wedged = _health(obj)
    error = json.loads(wedged.body)["error"]
    assert wedged.status_code == 504 and error["code"] == 504 and "health_timeout_s=0.05" in error["message"]
    assert paused.calls[-1].cancelled
    assert [obj.metrics.requests.labels("/health", s)._value.get() for s in ("200", "503", "504")] == [1, 1, 1]


class _DyingStream:
    """A Serve streaming call that gives one chunk cut mid-event, then fails as a killed engine's call does."""

    def __init__(self) -> None:
        self.sent, self.cancelled = False, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        if not self.sent:
            self.sent = True
            return b'data: {"choices": [{"text": "one,'
        raise EngineUnavailable("the engine exited with code -9")

    def cancel(self) -> None:
        self.cancelled = True


def test_a_stream_whose_engine_dies_ends_with_a_503_event_then_done():
    stream, failed, released = _DyingStream(), list[int](), list[bool]()

    async def scenario() -> list[bytes]:
        return [chunk async for chunk in relay(stream, 60, lambda: released.append(True), failed.append)]

    chunks = asyncio.run(scenario())
    assert len(chunks) == 2 and chunks[0].startswith(b"data: ")
    # the cut event is closed first, so that the client reads the error as an event of its own
    assert chunks[1].startswith(b"\n\ndata: ") and chunks[1].endswith(b"data: [DONE]\n\n")
    error = json.loads(chunks[1].split(b"data: ")[1])["error"]
    assert error["code"] == 503 and "exited with code -9" in error["message"]
    assert failed == [503] and stream.cancelled and released == [True]


def test_failures_map_to_their_cause():
    from ray.exceptions import ActorDiedError, RayTaskError

    try:
        raise EngineUnavailable("the engine exited with code -9")
    except EngineUnavailable as exc:
        remote = RayTaskError("call", "a long remote traceback", exc).as_instanceof_cause()
    assert failure_answer(remote) == (503, "the engine is unavailable (the engine exited with code -9)")
    assert failure_answer(httpx.ConnectError("refused"))[0] == 503
    assert failure_answer(httpx.ReadTimeout("slow"))[0] == 504
    assert failure_answer(ActorDiedError())[0] == 503
    assert failure_answer(ValueError("a bug"))[0] == 500


@pytest.mark.parametrize("body, needle", [
    (b"[" * 5000 + b"]" * 5000, "nested deeper"),
    (b'{"a": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}", "nested deeper"),
    (b'{"max_tokens": ' + b"9" * 5000 + b"}", "more digits"),
    (b'{"temperature": Infinity}', "Infinity is not a JSON number"),
    (b'{"temperature": -Infinity}', "Infinity is not a JSON number"),
    (b'{"temperature": NaN}', "NaN is not a JSON number"),
    (b'{"temperature": 1e400}', "out of range"),
    (b'{"prompt": "x"', "not valid JSON"),
    (b'{"prompt": "\xff"}', "not valid JSON"),
])
def test_non_standard_or_hostile_json_is_refused_naming_why(body, needle):
    with pytest.raises(BadJson, match=needle):
        parse_json(body)


def test_standard_json_passes():
    assert parse_json(b'{"temperature": 0.5, "stop": ["a"], "n": [[1]]}') == {"temperature": 0.5, "stop": ["a"],
                                                                              "n": [[1]]}


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit():
    sent = []

    async def receive():  # an endless chunked upload: 64 KiB at a time
        sent.append(1)
        return {"type": "http.request", "body": b"x" * 65536, "more_body": True}

    with pytest.raises(RequestRejected) as refused:
        asyncio.run(read_body(receive, 1_000_000))
    assert refused.value.status == 413 and refused.value.headers == {"Connection": "close"}
    assert len(sent) == 1_000_000 // 65536 + 1  # read until past the limit, not one message more
    with pytest.raises(RequestRejected) as declared:
        asyncio.run(read_body(receive, 1_000_000, declared=str(600 * 2**20)))
    assert declared.value.status == 413 and declared.value.headers == {}  # refused before reading at all
    assert len(sent) == 1_000_000 // 65536 + 1


@pytest.mark.parametrize("value", [0, -1, "5", 5.0, 5.5, True, 10**6])
def test_every_invalid_max_tokens_form_is_422(value):
    for key in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(RequestRejected) as refused:
            check_max_tokens({key: value}, 2048)
        assert refused.value.status == 422 and key in refused.value.message


def test_absent_max_tokens_is_filled_as_documented():
    chat: dict[str, Any] = {}
    plain: dict[str, Any] = {}
    given = {"max_tokens": 3}
    assert fill_max_tokens(chat, True, 64) == 64 and chat == {"max_tokens": 64}
    assert fill_max_tokens(plain, False, 64) == 16 and plain == {"max_tokens": 16}
    assert fill_max_tokens(given, False, 64) is None and given == {"max_tokens": 3}
