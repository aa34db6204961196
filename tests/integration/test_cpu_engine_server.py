"""The CPU engine's HTTP surface with NGRAM on the real SmolLM2-135M: /generate (plain and SSE), meta_info counters,
/server_info (resolved SGLang fields, avg_spec_accept_length, verify-cost curve), /flush_cache, 4xx handling, and
start-up failures on bad flags. One server process for the whole module; the test-only slow-start switch on a
second one."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime

import httpx
import pytest

from serve.engines.cpu.decode import Decoder, Request, StopRules
from serve.engines.cpu.runner import ModelRunner
from serve.engines.cpu.server import FLUSH_FAILED
from serve.engines.cpu.verify import Sampling
pytestmark = pytest.mark.integration

TEST_THREADS = 1  # as conftest.TEST_THREADS: the in-process reference decodes on the same thread count

ARGS = ["--model-path", "smollm2-135m", "--threads", str(TEST_THREADS), "--context-length", "512",
        "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "8",
        "--speculative-ngram-max-bfs-breadth", "4", "--speculative-ngram-match-type", "PROB",
        "--verify-probe-seconds", "0.5"]
PROMPT = "List the days of the week, one per line:\nMonday\nTuesday\n"
NEW = 24


@pytest.fixture(scope="module")
def server(smol_dir, cpu_server, tmp_path_factory):
    with cpu_server(ARGS, tmp_path_factory.mktemp("ngram-server")) as srv:
        yield srv


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        c.post("/flush_cache").raise_for_status()
        yield c


def _generate(client, text=PROMPT, new=NEW, **params):
    resp = client.post("/generate", json={"text": text, "sampling_params": {
        "max_new_tokens": new, "temperature": 0, **params}})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_server_info_reports_sglang_resolution(client):
    info = client.get("/server_info").json()
    assert info["speculative_algorithm"] == "NGRAM"
    assert info["speculative_num_draft_tokens"] == 8
    assert info["speculative_eagle_topk"] == 4  # SGLang: topk := max_bfs_breadth
    assert info["speculative_num_steps"] == 2  # SGLang: draft // topk
    assert info["speculative_ngram_match_type"] == "PROB"
    assert info["max_running_requests"] == 48  # SGLang's default for speculative algorithms
    assert info["dtype"] == "float32" and info["context_length"] == 512
    curve = info["verify_cost"]
    assert curve["sizes"] == [1, 2, 3, 4, 6, 8, 12, 16] and curve["relative"][0] == 1.0 and len(curve["ms"]) == 8
    state = info["internal_states"][0]
    assert "avg_spec_accept_length" not in state and state["spec_verify_ct"] == 0  # just flushed (SGLang: absent)


def test_greedy_output_equals_plain_decoding(client, smol):
    model, tokenizer = smol
    got = _generate(client)
    req = Request(rid="ref", prompt_ids=tokenizer.encode(PROMPT), sampling=Sampling(temperature=0.0),
                  rules=StopRules(max_new_tokens=NEW, eos_ids=frozenset({tokenizer.eos_token_id})), seed=0)
    decoder = Decoder(ModelRunner(model), tokenizer, None)
    for _ in range(NEW + 1):  # every step emits a token: more steps than tokens = a stuck decoder
        if req.finished:
            break
        decoder.step(req)
    assert req.finished, "the decoder made no progress"
    assert got["output_ids"] == req.output_ids
    assert got["text"] == tokenizer.decode(req.output_ids, skip_special_tokens=True)
    assert got["meta_info"]["finish_reason"] == req.finish_reason


def test_counters_agree_per_request_and_server_wide(client):
    metas = [_generate(client)["meta_info"] for _ in range(3)]  # the 2nd and 3rd find the 1st in the trie
    for m in metas:
        assert m["completion_tokens"] == NEW and m["prompt_tokens"] > 0 and m["e2e_latency"] > 0
        assert m["spec_accept_length"] == pytest.approx(m["completion_tokens"] / m["spec_verify_ct"])
        # the last step's accepted drafts count even where max_new_tokens cut them off (as in SGLang)
        assert 0 <= 1 + m["spec_verify_ct"] + m["spec_num_correct_drafts"] - m["completion_tokens"] < 7
        assert m["spec_num_proposed_drafts"] == 7 * m["spec_verify_ct"]
    assert metas[2]["spec_accept_length"] > metas[0]["spec_accept_length"]  # warm trie
    state = client.get("/server_info").json()["internal_states"][0]
    verify = sum(m["spec_verify_ct"] for m in metas)
    correct = sum(m["spec_num_correct_drafts"] for m in metas)
    assert state["spec_verify_ct"] == verify and state["spec_num_correct_drafts"] == correct
    assert state["spec_emitted_tokens"] == sum(m["completion_tokens"] - 1 for m in metas) <= correct + verify
    # SGLang's avg_spec_accept_length folds in every 40 decode batches (one request at a time: one verify step each)
    assert ("avg_spec_accept_length" in state) == (verify >= 40)
    assert state["num_finished_requests"] == 3 and state["completion_tokens"] == 3 * NEW


def test_flush_clears_trie_and_counters(client):
    first = _generate(client)["meta_info"]
    warm = _generate(client)["meta_info"]
    before = client.get("/server_info").json()["internal_states"][0]
    assert before["ngram_trie_nodes"] > 0 and warm["spec_num_correct_drafts"] > first["spec_num_correct_drafts"]
    resp = client.post("/flush_cache")
    assert resp.status_code == 200
    after = client.get("/server_info").json()["internal_states"][0]
    assert after["ngram_trie_nodes"] == 0 and after["spec_verify_ct"] == 0 and after["num_finished_requests"] == 0
    cold = _generate(client)["meta_info"]
    assert cold["spec_num_correct_drafts"] == first["spec_num_correct_drafts"]  # as cold as the very first run


def test_flush_is_refused_while_a_request_runs(client, server):
    with httpx.stream("POST", server.url + "/generate", timeout=300, json={
            "text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": 40, "temperature": 0}}) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data:"))  # the request is running now
        assert json.loads(first[5:])["meta_info"]["finish_reason"] is None
        busy = httpx.post(server.url + "/flush_cache", timeout=30)
        rest = [line for line in lines if line.startswith("data:")]
    assert (busy.status_code, busy.text) == (400, FLUSH_FAILED)  # SGLang's answer when not idle
    assert rest[-1] == "data: [DONE]"
    assert client.post("/flush_cache").status_code == 200  # idle again


def test_streaming_generate_matches_non_streaming(client, server):
    plain = _generate(client)
    chunks = []
    with httpx.stream("POST", server.url + "/generate", timeout=300, json={
            "text": PROMPT, "stream": True, "sampling_params": {"max_new_tokens": NEW, "temperature": 0}}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data:"):
                chunks.append(line[5:].strip())
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    assert len(events) >= 2
    lengths = [len(e["output_ids"]) for e in events]
    assert lengths == sorted(lengths)  # cumulative, as SGLang streams /generate
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    last = events[-1]
    assert last["output_ids"] == plain["output_ids"] and last["text"] == plain["text"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": NEW}
    assert "e2e_latency" in last["meta_info"]


@pytest.mark.parametrize("body,needle", [
    (b"{not json", "not valid JSON"),
    (json.dumps({"sampling_params": {"max_new_tokens": 4}}).encode(), "`text` or `input_ids`"),
    (json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 0}}).encode(), "max_new_tokens"),
    (json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 600}}).encode(), "context_length=512"),
    (json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 4, "temprature": 0}}).encode(), "temprature"),
    (json.dumps({"input_ids": [1, 10**9]}).encode(), "input_ids"),
])
def test_bad_requests_get_400_and_server_keeps_serving(client, body, needle):
    resp = client.post("/generate", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    assert needle in resp.json()["error"]["message"]
    assert _generate(client, new=2)["meta_info"]["completion_tokens"] == 2


@pytest.mark.parametrize("extra,needle", [
    (["--no-such-flag"], "--no-such-flag"),
    (["--speculative-algorithm", "EAGLE3"], "--speculative-algorithm"),
    (["--speculative-algorithm", "ngram", "--speculative-ngram-match-type", "bfs"], "--speculative-ngram-match-type"),
    (["--speculative-algorithm", "ngram", "--speculative-ngram-min-bfs-breadth", "5",
      "--speculative-ngram-max-bfs-breadth", "2"], "--speculative-ngram-min-bfs-breadth"),
    (["--speculative-algorithm", "standalone", "--speculative-draft-model-path", "smollm2-135m",
      "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "8"],
     "--speculative-num-draft-tokens"),
])
def test_bad_flags_exit_nonzero_naming_the_flag(extra, needle):
    proc = subprocess.run([sys.executable, "-m", "serve.engines.cpu", "--model-path", "smollm2-135m", *extra],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert needle in proc.stderr


def test_slow_start_delays_the_engine_before_it_loads_the_model(cpu_server, tmp_path):
    # A study sees this as LAUNCH_FAILED once the delay passes engine.start_timeout_s ("never got ready",
    # docs/design.md); here the switch itself is checked on the real engine, without spending a start timeout.
    args = ["--model-path", "smollm2-135m", "--threads", str(TEST_THREADS), "--verify-probe-seconds", "0",
            "--test-fault", "slow-start=3"]
    with cpu_server(args, tmp_path) as server:
        info = httpx.get(f"{server.url}/server_info", timeout=30).json()
        log = server.log()

    def stamp(text: str) -> datetime:
        line = next(line for line in log.splitlines() if text in line)
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")

    # The sleep comes before the model load, so /health could not answer during it.
    assert (stamp("engine ready in") - stamp("TEST FAULT slow-start: sleeping 3.0 s")).total_seconds() >= 3.0
    assert info["speculative_algorithm"] is None and "test_faults" not in info
