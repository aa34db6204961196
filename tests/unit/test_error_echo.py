"""A 400 names only the fields the user sent (issue #63 item 9): the production ingress adds
`return_spec_tokens_details` (and a stream's `stream_options.include_usage`) to what it forwards, and the CPU
engine's "field required" error echoed the whole body, those fields included."""

from __future__ import annotations

import pytest

from serve.engines.cpu.openai_api import ChatBody, CompletionBody
from serve.engines.cpu.params import BadRequest, parse_model
from serve.http_errors import RequestRejected
from serve.http_limits import check_required

FORWARDED = {"model": "m", "max_tokens": 3, "stream": True, "return_spec_tokens_details": True,
             "stream_options": {"include_usage": True}}


@pytest.mark.parametrize("kind", [CompletionBody, ChatBody])
def test_the_engine_names_the_missing_field_without_echoing_the_body(kind):
    with pytest.raises(BadRequest) as err:
        parse_model(kind, FORWARDED)
    message = str(err.value)
    assert message == ("prompt: field required" if kind is CompletionBody else "messages: field required")
    assert "return_spec_tokens_details" not in message and "include_usage" not in message


@pytest.mark.parametrize(("path", "field"), [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_the_ingress_refuses_a_request_without_its_prompt_before_forwarding(path, field):
    with pytest.raises(RequestRejected) as err:
        check_required({"model": "m"}, path)
    assert err.value.status == 400 and err.value.message == f"{field}: field required"
    check_required({field: "x"}, path)  # present: passes, whatever its value (the engine checks it)
