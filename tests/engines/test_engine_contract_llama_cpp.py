"""The engine contract against llama.cpp's llama-server (smallest model, Q4_1, `--spec-type ngram-simple`), started as
the replica starts it: the shim (serve/engines/llama_cpp/server.py) in front of the real llama-server.

What holds and what is mapped (the rest of EngineContract holds as it is):
- `/server_info`: llama-server has no SGLang ServerArgs; `speculative_algorithm` is our algorithm name and there is no
  NGRAM tree (no topk/breadth keys, no topk rewrite): `test_server_info_has_the_resolved_speculative_config` is
  replaced by the llama.cpp form below.
- `/generate` meta_info spec counters are derived from llama-server's `timings.draft_n`/`draft_n_accepted`
  (serve/engines/llama_cpp/protocol.py says how); their consistency is checked against llama-server's own `/metrics`.
- OpenAI answers: llama-server takes SGLang's `return_spec_tokens_details` and returns no `sglext` (its timings are
  not per-request spec counters of SGLang's kind): the production ingress does not ask it, and live accept length is
  not measured on llama.cpp (`test_openai_answers_carry_the_requests_spec_details_when_asked` in its llama.cpp form).
- `/flush_cache` restarts llama-server (KV, prompt cache, drafter state, counters and lookup files all fresh).
Skipped without llama-server, with the install command in the reason.
"""

import os
import time
from pathlib import Path

import httpx
import pytest

from serve.engines.base import ReplicaConfig
from serve.replica.deployment import EngineProcess
from serve.replica.placement import log_tail
from serve.spec import LlamaNgramSimpleSpec
from tests.engine_contract import EngineContract, generate
from tests.integration.llama_cpp_helpers import require_llama_server

pytestmark = [pytest.mark.integration, pytest.mark.engines]
SPEC = LlamaNgramSimpleSpec(size_n=2, size_m=6)


@pytest.fixture(scope="module")
def llama_engine(tmp_path_factory):
    require_llama_server()
    process = EngineProcess(ReplicaConfig(engine="llama_cpp", model="smollm2-135m", spec=SPEC, threads=1,
                                          max_running_requests=2, start_timeout_s=300,
                                          log_dir=str(tmp_path_factory.mktemp("llama-engine"))))
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


class TestLlamaCppEngineContract(EngineContract):
    @pytest.fixture(scope="class")
    def engine(self, llama_engine):
        return llama_engine

    def test_server_info_has_the_resolved_speculative_config(self, engine):
        info = httpx.get(f"{engine.url}/server_info", timeout=60).json()
        assert info["speculative_algorithm"] == "llama_ngram_simple" and info["engine"] == "llama_cpp"
        assert info["max_running_requests"] == 2  # read back from llama-server's /props
        argv = info["llama_server_argv"]
        assert argv[argv.index("--spec-type") + 1] == "ngram-simple"
        assert argv[argv.index("--spec-ngram-simple-size-m") + 1] == "6"
        assert isinstance(info["internal_states"], list) and info["internal_states"]

    def test_openai_answers_carry_the_requests_spec_details_when_asked(self, engine):
        model = httpx.get(f"{engine.url}/v1/models", timeout=60).json()["data"][0]["id"]
        answer = httpx.post(f"{engine.url}/v1/completions", timeout=300, json={
            "model": model, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0,
            "return_spec_tokens_details": True})
        assert answer.status_code == 200 and "sglext" not in answer.json()


def test_counters_agree_with_llama_servers_own_metrics(llama_engine):
    url = llama_engine.url
    assert httpx.post(f"{url}/flush_cache", timeout=120).status_code == 200
    metas = [generate(url, max_new_tokens=32).json()["meta_info"] for _ in range(2)]
    info = httpx.get(f"{url}/server_info", timeout=60).json()
    accepted = sum(m["spec_num_correct_drafts"] for m in metas)
    proposed = sum(m["spec_num_proposed_drafts"] for m in metas)
    assert proposed > 0 and 0 < accepted <= proposed  # a code prompt repeating itself: drafts are found and accepted
    metrics = info["llama_metrics"]
    assert metrics["llamacpp:spec_decode_num_draft_tokens_total"] == proposed, metrics
    assert metrics["llamacpp:spec_decode_num_accepted_tokens_total"] == accepted, metrics
    # llama-server counts only the steps that verified a draft; SGLang's spec_verify_ct counts every decode step
    assert metrics["llamacpp:spec_decode_num_drafts_total"] <= sum(m["spec_verify_ct"] for m in metas)
    avg = info["internal_states"][0]["avg_spec_accept_length"]
    total = sum(m["completion_tokens"] for m in metas) / sum(m["spec_verify_ct"] for m in metas)
    assert abs(avg - total) < 1e-9


def test_flush_restarts_llama_server_and_refuses_while_busy(llama_engine):
    url = llama_engine.url
    before = httpx.post(f"{url}/flush_cache", timeout=120).json()["llama_server_starts"]
    after = httpx.post(f"{url}/flush_cache", timeout=120).json()["llama_server_starts"]
    assert after == before + 1
    assert httpx.get(f"{url}/slots", timeout=30).status_code == 200  # forwarded as it is


def test_log_has_the_llama_server_command_and_its_output(llama_engine):
    text = log_tail(llama_engine.log_path, 2_000_000)
    assert "[llama-cpp shim] starting: " in text and "--spec-type ngram-simple" in text
    assert "llama" in text.split("[llama-cpp shim] starting: ", 1)[1]  # llama-server's own lines follow


def test_teardown_ends_llama_server_too(tmp_path):
    require_llama_server()
    process = EngineProcess(ReplicaConfig(engine="llama_cpp", model="smollm2-135m", threads=1, start_timeout_s=300,
                                          log_dir=str(tmp_path)))
    try:
        process.wait_ready()
        child = [line for line in log_tail(process.log_path).splitlines() if "ready: llama-server at" in line]
        assert child, log_tail(process.log_path)
        group = os.getpgid(process.process.pid)
    finally:
        process.stop()
    deadline = time.monotonic() + 30
    while live_members(group) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_members(group) == []  # neither the shim nor llama-server outlives the replica's stop


def live_members(group: int) -> list[str]:
    """Commands of the non-zombie processes of a process group (read from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            out.append(stat.parent.name)
    return out


def test_ngram_cache_starts_with_a_fresh_dynamic_lookup_file_and_drafts(tmp_path):
    """llama-server aborts when the dynamic lookup file is missing: the shim gives it an empty one per start."""
    require_llama_server()
    from serve.spec import LlamaNgramCacheSpec

    process = EngineProcess(ReplicaConfig(engine="llama_cpp", model="smollm2-135m", spec=LlamaNgramCacheSpec(),
                                          threads=1, start_timeout_s=300, log_dir=str(tmp_path)))
    try:
        process.wait_ready()
        argv = httpx.get(f"{process.url}/server_info", timeout=60).json()["llama_server_argv"]
        assert argv[argv.index("--spec-type") + 1] == "ngram-cache" and "--lookup-cache-dynamic" in argv
        meta = generate(process.url, max_new_tokens=16).json()["meta_info"]
        assert meta["completion_tokens"] == 16 and "spec_verify_ct" in meta
    finally:
        process.stop()


def test_ngram_simple_drafts_and_accepts_what_the_replay_says_request_by_request(llama_engine):
    """The acceptance replay of llama-server's ngram-simple (pipeline/simulate/lookup.py) against llama-server itself:
    each request's proposed and accepted draft tokens (`timings.draft_n`, `draft_n_accepted`) equal the replay's of
    the tokens it answered. ngram-simple keeps no state, so the request's own prompt and output ids fix its drafts."""
    from pipeline.simulate.replay import Answer, ClosedLoop, Phase, replay
    from pipeline.workloads import load_workload

    url = llama_engine.url
    work = load_workload("templated", seed=0, n_warmup=0, n_measure=4, max_new_tokens=32)
    answers, metas = [], []
    for prompt in work.measure:  # one at a time: concurrency 1
        ids = httpx.post(f"{url}/tokenize", json={"content": prompt.text}, timeout=60).json()["tokens"]
        answer = httpx.post(f"{url}/generate", timeout=300, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 32, "temperature": 0}}).json()
        answers.append(Answer(tuple(ids), tuple(answer["output_ids"])))
        metas.append(answer["meta_info"])
    replayed = replay(SPEC, [Phase("measure", tuple(answers), ClosedLoop(1))]).requests
    got = [(m["spec_num_proposed_drafts"], m["spec_num_correct_drafts"]) for m in metas]
    assert got == [(sum(s.tree for s in r.steps), r.spec_num_correct_drafts) for r in replayed]
    assert sum(accepted for _, accepted in got) > 0  # templated answers repeat: drafts were found and accepted
