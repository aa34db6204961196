"""What the tuner relies on from a real SGLang server, beyond the engine contract every engine keeps
(tests/engine_contract.py). One suite for SGLang on CPU (tests/engines/test_sglang_contract_cpu.py, in CI) and on
a GPU (tests/gpu/test_engine_contract_sglang.py). The `engine` fixture: an object with `.url` and `.log_path` for an
SGLang started by the adapter with NGRAM, draft 4, breadth 2, no study cap on running requests; `engine_config`: the
ReplicaConfig it was started from.
"""

from __future__ import annotations

import threading

import httpx

from serve.engines import engine_for
from serve.engines.spec_flags import effective_diff, effective_settings
from tests.engine_contract import PROMPT, EngineContract, generate

CORPUS = ["def add(a, b):\n    return a + b\n", "def sub(a, b):\n    return a - b\n"]


def prefill_lines(log_path) -> int:
    return sum(1 for line in open(log_path, errors="replace") if "Prefill batch" in line)


class SglangContract(EngineContract):
    def test_server_info_reports_what_the_adapter_reads_back(self, engine, engine_config):
        info = httpx.get(f"{engine.url}/server_info", timeout=60).json()
        effective = effective_settings(info)
        # Defects 2.2 and 2.5: the pinned attention backend and the running-request cap are what SGLang runs, for
        # the baseline's value of the cap too (48, SGLang's speculative default, rendered explicitly).
        pinned = engine_for(engine_config.engine).pinned_settings(engine_config)
        assert {k: effective[k] for k in pinned} == pinned
        assert effective["effective_max_running_requests_per_dp"] == pinned["max_running_requests"]
        assert effective_diff(engine_config.spec, engine_config.max_running_requests, info, pinned) == {}
        assert info["speculative_num_draft_tokens"] == 4 and info["speculative_eagle_topk"] == 2
        assert isinstance(info["startup_time"], dict)

    def test_meta_info_counters_are_consistent(self, engine):
        meta = generate(engine.url, max_new_tokens=24).json()["meta_info"]
        assert 0 < meta["spec_verify_ct"] <= meta["completion_tokens"]
        assert meta["spec_num_correct_drafts"] <= meta["spec_num_proposed_drafts"]
        assert sum(meta["spec_correct_drafts_histogram"]) == meta["spec_verify_ct"]

    def test_health_runs_no_generation(self, engine):
        # Defect 2.7: with SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false, /health adds no prefill to the batches.
        before = prefill_lines(engine.log_path)
        for _ in range(3):
            assert httpx.get(f"{engine.url}/health", timeout=60).status_code == 200
        assert prefill_lines(engine.log_path) == before

    def test_flush_is_refused_while_a_request_runs(self, engine):
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 160, "temperature": 0}, "stream": True}
        running, done = threading.Event(), threading.Event()
        answers: list[int] = []

        def stream() -> None:
            with httpx.stream("POST", f"{engine.url}/generate", json=body, timeout=300) as response:
                for _ in response.iter_lines():  # the first line: the request is running
                    running.set()
            done.set()

        thread = threading.Thread(target=stream)
        thread.start()
        assert running.wait(timeout=300)
        answers.append(httpx.post(f"{engine.url}/flush_cache", timeout=60).status_code)
        thread.join(timeout=300)
        assert done.is_set() and answers == [400]
        # SGLang sends a stream's last line before its scheduler frees the request, so a flush right after may still
        # be refused; it is allowed to wait for idle, as the trial's own flush does (pipeline/trial/engine_pass.py).
        assert httpx.post(f"{engine.url}/flush_cache", params={"timeout": 30}, timeout=90).status_code == 200

    def test_external_corpus_routes_and_corpora_survive_a_flush(self, engine):
        added = httpx.post(f"{engine.url}/add_external_corpus", timeout=120,
                           json={"corpus_id": "contract", "documents": CORPUS})
        assert added.status_code == 200 and added.json()["success"], added.text
        assert added.json()["loaded_token_count"] > 0
        listed = httpx.get(f"{engine.url}/list_external_corpora", timeout=60).json()
        assert set(listed) == {"success", "corpus_token_counts", "message"}
        assert listed["corpus_token_counts"]["contract"] == added.json()["loaded_token_count"]
        assert httpx.post(f"{engine.url}/flush_cache", timeout=60).status_code == 200
        kept = httpx.get(f"{engine.url}/list_external_corpora", timeout=60).json()["corpus_token_counts"]
        assert "contract" in kept
        removed = httpx.post(f"{engine.url}/remove_external_corpus", timeout=60, json={"corpus_id": "contract"})
        assert removed.status_code == 200 and removed.json()["success"], removed.text
        assert httpx.get(f"{engine.url}/list_external_corpora", timeout=60).json()["corpus_token_counts"] == {}
