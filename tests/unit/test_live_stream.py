"""What the ingress measures of an answer as it passes (serve/closed_loop/live_stream.py) and the ring it keeps the records in
(serve/closed_loop/live_book.py): the usage chunk and the spec counters the ingress asked for never reach a client that did not,
bytes are forwarded as they came, and a reader of the feed learns what it missed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

import pytest
from prometheus_client import CollectorRegistry

from serve.http_errors import RequestRejected
from serve.closed_loop.live_book import LiveBook, feed_query, subsample, version_label
from serve.closed_loop.live_stream import CLIENT_CLOSED, Added, Measure, ask_spec_details, ask_usage, metered


def _event(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


TEXT = [_event({"choices": [{"index": 0, "text": piece}]}) for piece in ("He", "llo", "")]
USAGE = _event({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})
DONE = b"data: [DONE]\n\n"


def _run(chunks: list[bytes], strip: bool, close_after: int | None = None,
         spec: bool = False) -> tuple[bytes, Measure, list[float]]:
    measure = Measure(arrived=0.0, api="/v1/completions", route="low", concurrency=1, streamed=True)
    ended: list[float] = []

    async def source():
        for chunk in chunks:
            yield chunk

    async def drain() -> bytes:
        out = b""
        stream = metered(source(), measure, Added(usage=strip, spec=spec), lambda m, at: ended.append(at))
        assert isinstance(stream, AsyncGenerator), f"metered returned {type(stream).__name__}, which cannot be closed"
        async for piece in stream:
            out += piece
            if close_after is not None and len(out) >= close_after:
                await stream.aclose()  # the client left
                break
        return out

    return asyncio.run(drain()), measure, ended


def test_the_usage_chunk_the_ingress_asked_for_is_counted_and_not_forwarded():
    whole = b"".join([*TEXT, USAGE, DONE])
    split = [whole[i:i + 7] for i in range(0, len(whole), 7)]  # events cut anywhere, as a network may
    sent, measure, ended = _run(split, strip=True)
    assert sent == b"".join([*TEXT, DONE])
    assert (measure.prompt_tokens, measure.completion_tokens) == (5, 3)
    assert len(measure.gaps) == 1 and measure.first_text is not None  # two text chunks; the empty one is none
    assert measure.status(200) == 200 and len(ended) == 1
    asked, measure, _ = _run([*TEXT, USAGE, DONE], strip=False)
    assert asked == b"".join([*TEXT, USAGE, DONE]) and measure.completion_tokens == 3


def test_usage_riding_on_a_chunk_with_choices_is_removed_from_that_chunk_only():
    chunk = {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}], "usage": {"completion_tokens": 1},
             "sglext": {"spec_tokens_details": {"spec_verify_ct": 1}}}
    sent, measure, _ = _run([_event(chunk), DONE], strip=True)
    first = json.loads(sent.split(b"\n\n")[0][6:])
    assert "usage" not in first and first["choices"][0]["text"] == "!"
    assert measure.completion_tokens == 1 and measure.verify_steps == 1


SPEC = {"spec_verify_ct": 2, "spec_accept_length": 1.5}
SGLEXT = _event({"choices": [], "sglext": {"spec_tokens_details": SPEC}})


def test_spec_details_the_ingress_asked_for_are_counted_and_kept_from_the_client():
    sent, measure, _ = _run([*TEXT, SGLEXT, USAGE, DONE], strip=True, spec=True)
    assert sent == b"".join([*TEXT, DONE]) and measure.verify_steps == 2
    # asked by the client: forwarded as they came; another extension field on the same chunk stays
    asked, measure, _ = _run([*TEXT, SGLEXT, USAGE, DONE], strip=False)
    assert asked == b"".join([*TEXT, SGLEXT, USAGE, DONE]) and measure.verify_steps == 2
    both = _event({"choices": [], "sglext": {"spec_tokens_details": SPEC, "routed_experts": "x"}})
    sent, _, _ = _run([both, DONE], strip=False, spec=True)
    assert json.loads(sent.split(b"\n\n")[0][6:]) == {"choices": [], "sglext": {"routed_experts": "x"}}


def test_a_non_streamed_answer_loses_only_the_spec_details_the_client_did_not_ask_for():
    answer = {"choices": [{"index": 0, "text": "Hi"}], "usage": {"completion_tokens": 3},
              "sglext": {"spec_tokens_details": SPEC}}
    payload = json.dumps(answer).encode()
    measure = Measure(0.0, "/v1/completions", "low", 1, False)
    kept = json.loads(measure.answer(payload, 1.0, Added(spec=True)))
    assert kept == {k: v for k, v in answer.items() if k != "sglext"} and measure.verify_steps == 2
    assert Measure(0.0, "/v1/completions", "low", 1, False).answer(payload, 1.0) == payload
    for odd in (b"not json", json.dumps({"choices": [], "sglext": "spec_tokens_details"}).encode()):
        assert Measure(0.0, "/v1/completions", "low", 1, False).answer(odd, 1.0, Added(spec=True)) == odd


def test_a_stream_cut_by_an_error_event_or_left_by_its_client_is_not_a_success():
    error = _event({"error": {"message": "took too long", "code": 504}})
    _, measure, _ = _run([TEXT[0], error, DONE], strip=True)
    assert measure.status(200) == 504
    _, measure, ended = _run([*TEXT, DONE], strip=True, close_after=1)
    assert measure.status(200) == CLIENT_CLOSED and len(ended) == 1


def test_ask_usage_adds_the_ask_only_when_the_client_did_not():
    data: dict = {"stream": True}
    assert ask_usage(data) and data["stream_options"] == {"include_usage": True}
    asked = {"stream": True, "stream_options": {"include_usage": True}}
    assert not ask_usage(asked)
    assert not ask_usage({"stream_options": "nonsense"})  # the engine refuses it with its own message


def test_ask_spec_details_leaves_a_clients_own_value():
    data: dict = {}
    assert ask_spec_details(data) and data == {"return_spec_tokens_details": True}
    for own in (True, False, "yes"):
        asked = {"return_spec_tokens_details": own}
        assert not ask_spec_details(asked) and asked == {"return_spec_tokens_details": own}


def test_the_feed_says_what_a_reader_missed_and_continues_above_a_replaced_replica():
    book = LiveBook(capacity=3, version="7", registry=CollectorRegistry())
    last_of_old = book.first_seq - 1000  # what a reader of the replica this one replaced holds
    for concurrency in (1, 2, 3, 4, 5):
        book.record(Measure(0.0, "/v1/completions", "low", concurrency, False), 200, 1.0)
    feed = book.feed(after=last_of_old, limit=2)
    assert feed.dropped == 2 and [r.concurrency for r in feed.records] == [3, 4]
    rest = book.feed(after=feed.next, limit=10)
    assert [r.concurrency for r in rest.records] == [5] and rest.dropped == 0
    assert book.feed(after=rest.next, limit=10).records == ()
    assert {f.bucket for f in book.summary().figures} == {"3-4", "5-8"}
    assert book.record(Measure(0.0, "/v1/other", "low", 1, False), 200, 1.0) is None  # not a record: not kept
    assert book.feed(after=rest.next, limit=10).records == ()


def test_itl_samples_are_bounded_and_spread_over_the_stream():
    gaps = [float(i) for i in range(1000)]
    kept = subsample(gaps, 256)
    assert len(kept) == 256 and kept[0] == 0.0 and kept[-1] >= 990.0
    assert subsample(gaps[:10], 256) == tuple(gaps[:10])


def test_feed_queries_are_checked_and_configs_from_files_are_named_by_content():
    assert feed_query({}) == (0, 1000) and feed_query({"after": "12", "limit": "5"}) == (12, 5)
    for bad in ({"after": "-1"}, {"limit": "0"}, {"limit": "x"}, {"limit": "100000"}):
        with pytest.raises(RequestRejected, match=next(iter(bad))):
            feed_query(bad)
    a = version_label({"origin": {"version": None}, "config": {"x": 1}})
    assert a.startswith("file:") and a != version_label({"origin": {}, "config": {"x": 2}})
    assert version_label({"origin": {"version": "3"}, "config": {}}) == "3"
