"""The engine contract (docs/design.md, "Engines") as a reusable test class.

Everything the pipeline relies on from an engine, checked over HTTP only, so the same tests run against the embedded
CPU engine (tests/integration/test_engine_contract_cpu.py, in CI) and against a real SGLang server
(tests/gpu/test_engine_contract_sglang.py, on a GPU node). A subclass provides the `engine` fixture: an object with
`.url` for an engine started with NGRAM speculation (so the speculative counters exist).
"""

from __future__ import annotations

import json

import httpx

PROMPT = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n# the same function again:\n"
META_KEYS = {"prompt_tokens", "completion_tokens", "finish_reason", "e2e_latency"}
SPEC_KEYS = {"spec_verify_ct", "spec_accept_length", "spec_num_correct_drafts", "spec_num_proposed_drafts"}


def generate(url: str, max_new_tokens: int = 24, stream: bool = False, **extra) -> httpx.Response:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}, "stream": stream}
    return httpx.post(f"{url}/generate", json={**body, **extra}, timeout=300)


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.text.splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


class EngineContract:
    def test_health(self, engine):
        assert httpx.get(f"{engine.url}/health", timeout=60).status_code == 200

    def test_server_info_has_the_resolved_speculative_config(self, engine):
        info = httpx.get(f"{engine.url}/server_info", timeout=60).json()
        assert info["speculative_algorithm"] == "NGRAM"
        for key in ("speculative_num_draft_tokens", "speculative_eagle_topk", "speculative_ngram_max_bfs_breadth",
                    "max_running_requests"):
            assert key in info
        assert info["speculative_eagle_topk"] == info["speculative_ngram_max_bfs_breadth"]  # SGLang's rewrite
        # avg_spec_accept_length is optional: SGLang adds it only after a 40-decode-batch window (the CPU engine too)
        assert isinstance(info["internal_states"], list) and info["internal_states"]

    def test_generate_returns_text_ids_and_counters(self, engine):
        data = generate(engine.url).json()
        meta = data["meta_info"]
        assert data["text"] and len(data["output_ids"]) == meta["completion_tokens"] == 24
        assert META_KEYS <= set(meta) and SPEC_KEYS <= set(meta)
        assert abs(meta["completion_tokens"] / meta["spec_verify_ct"] - meta["spec_accept_length"]) < 1e-6

    def test_streaming_matches_non_streaming(self, engine):
        whole = generate(engine.url).json()
        events = sse_events(generate(engine.url, stream=True))
        assert events[-1] == "[DONE]" and len(events) >= 2
        last = events[-2]
        ids = last["output_ids"]
        if len(ids) != last["meta_info"]["completion_tokens"]:  # delta streaming: concatenate
            ids = [t for e in events[:-1] for t in e["output_ids"]]
        assert ids == whole["output_ids"] and last["meta_info"]["finish_reason"] is not None

    def test_flush_cache_resets_the_accept_counters(self, engine):
        generate(engine.url, max_new_tokens=32)
        assert httpx.post(f"{engine.url}/flush_cache", timeout=60).status_code == 200
        state = httpx.get(f"{engine.url}/server_info", timeout=60).json()["internal_states"][0]
        assert state.get("avg_spec_accept_length") in (None, 0, 0.0, 1.0)  # absent after a flush

    def test_openai_routes(self, engine):
        models = httpx.get(f"{engine.url}/v1/models", timeout=60).json()
        model = models["data"][0]["id"]
        completion = httpx.post(f"{engine.url}/v1/completions", timeout=300, json={
            "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()
        assert completion["choices"][0]["text"] and completion["usage"]["completion_tokens"] == 8

    def test_openai_answers_carry_the_requests_spec_details_when_asked(self, engine):
        # SGLang's `return_spec_tokens_details` (what the production ingress asks for, to measure live accept
        # length): the answer's `sglext.spec_tokens_details`; a stream sends it in a chunk without choices after the
        # finish chunk. Counted as /generate counts the same request: completion tokens over verify steps.
        model = httpx.get(f"{engine.url}/v1/models", timeout=60).json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                "return_spec_tokens_details": True}
        answer = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=300).json()
        details = answer["sglext"]["spec_tokens_details"]
        assert 0 < details["spec_verify_ct"] <= answer["usage"]["completion_tokens"] == 24
        assert abs(24 / details["spec_verify_ct"] - details["spec_accept_length"]) < 1e-6
        plain = httpx.post(f"{engine.url}/v1/completions", json={**body, "return_spec_tokens_details": False},
                           timeout=300).json()
        assert "sglext" not in plain or not (plain["sglext"] or {}).get("spec_tokens_details")
        events = sse_events(httpx.post(f"{engine.url}/v1/completions", timeout=300, json={
            **body, "stream": True, "stream_options": {"include_usage": True}}))
        assert events[-1] == "[DONE]"
        extension = [e for e in events[:-1] if e.get("sglext")]
        assert len(extension) == 1 and extension[0]["choices"] == []
        streamed = extension[0]["sglext"]["spec_tokens_details"]
        usage = [e["usage"] for e in events[:-1] if e.get("usage")][-1]
        assert 0 < streamed["spec_verify_ct"] <= usage["completion_tokens"] == 24
        finish = max(i for i, e in enumerate(events[:-1]) if any(c.get("finish_reason") for c in e["choices"]))
        assert finish < events.index(extension[0])
