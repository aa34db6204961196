"""The CPU engine's external corpus over HTTP, on the real SmolLM2-135M: the start-up corpus (its path as the id),
SGLang 0.5.23's runtime routes (add/remove/list with their bodies and messages; the list route is the only place
corpora are reported, as in SGLang), `/flush_cache` keeping corpora, and the corpus drafting (a prompt whose greedy continuation the corpus holds is
accepted in longer blocks than the cold trie's). One server process for the module."""

from __future__ import annotations

import json

import httpx
import pytest

pytestmark = pytest.mark.integration

PROMPT = "Write the numbers from one to twenty in words, separated by commas:"
NEW = 32


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "startup.jsonl"
    path.write_text(json.dumps("Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.") + "\n")
    return path


@pytest.fixture(scope="module")
def server(smol_dir, cpu_server, corpus_file, tmp_path_factory):
    args = ["--model-path", "smollm2-135m", "--threads", "1", "--context-length", "512",
            "--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "8",
            "--speculative-ngram-external-corpus-path", str(corpus_file),
            "--speculative-ngram-external-sam-budget", "4",
            "--speculative-ngram-external-corpus-max-tokens", "400", "--verify-probe-seconds", "0"]
    with cpu_server(args, tmp_path_factory.mktemp("corpus-server")) as srv:
        yield srv


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.url, timeout=300) as c:
        yield c


def _corpora(client) -> dict[str, int]:
    resp = client.get("/list_external_corpora")
    assert resp.status_code == 200, resp.text
    assert resp.json()["success"] is True
    return resp.json()["corpus_token_counts"]


def _accept_length(client) -> tuple[str, float]:
    client.post("/flush_cache").raise_for_status()
    resp = client.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": NEW,
                                                                              "temperature": 0}})
    assert resp.status_code == 200, resp.text
    meta = resp.json()["meta_info"]
    return resp.json()["text"], meta["completion_tokens"] / meta["spec_verify_ct"]


def test_startup_corpus_is_listed_under_its_path_where_sglang_lists_it(client, corpus_file):
    resp = client.get("/list_external_corpora")
    # SGLang 0.5.23's body exactly (http_server.py: success, corpus_token_counts, message; "" from one rank)
    assert resp.status_code == 200 and set(resp.json()) == {"success", "corpus_token_counts", "message"}
    counts = resp.json()["corpus_token_counts"]
    assert resp.json()["message"] == "" and list(counts) == [str(corpus_file)] and counts[str(corpus_file)] > 5
    # Keys SGLang does not have are not invented: a client reading them would read nothing on SGLang.
    info = client.get("/server_info").json()
    assert "external_corpora" not in info["internal_states"][0]
    assert "load_external_corpus" not in info["startup_time"]


def test_add_list_remove_with_sglang_bodies(client):
    resp = client.post("/add_external_corpus", json={"corpus_id": "docs", "documents": ["alpha beta", "gamma"]})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["success"] is True and body["corpus_id"] == "docs"
    assert body["message"] == f"Loaded corpus 'docs' with {body['loaded_token_count']} tokens."
    assert _corpora(client)["docs"] == body["loaded_token_count"]

    dup = client.post("/add_external_corpus", json={"corpus_id": "docs", "documents": ["x"]})
    assert dup.status_code == 400 and "already exists" in dup.json()["message"]

    gone = client.post("/remove_external_corpus", json={"corpus_id": "docs"})
    assert gone.status_code == 200 and gone.json() == {"success": True, "message": "Removed corpus 'docs'."}
    assert "docs" not in _corpora(client)


@pytest.mark.parametrize("body, status, needle", [
    ({"corpus_id": "a"}, 400, "Either file_path or documents must be provided."),
    ({"corpus_id": "a", "file_path": "/nonexistent.jsonl"}, 400, "External ngram corpus path does not exist"),
    ({"corpus_id": "a", "documnets": ["x"]}, 400, "unexpected keyword argument 'documnets'"),
])
def test_bad_adds_get_sglang_messages(client, body, status, needle):
    resp = client.post("/add_external_corpus", json=body)
    assert resp.status_code == status and needle in resp.json()["message"], resp.text
    assert resp.json()["success"] is False


def test_documents_past_the_limit_are_truncated_and_said_so(client, corpus_file):
    docs = ["one two three four five six seven eight nine ten"] * 200
    # Truncation cuts at the per-corpus limit, but the limit also bounds all corpora together (SGLang: the
    # remaining budget refuses the cut corpus), so the start-up corpus is taken out first and reloaded after.
    with_startup = client.post("/add_external_corpus", json={"corpus_id": "big", "documents": docs})
    assert with_startup.status_code == 400 and "remaining token budget" in with_startup.json()["message"]
    client.post("/remove_external_corpus", json={"corpus_id": str(corpus_file)}).raise_for_status()
    resp = client.post("/add_external_corpus", json={"corpus_id": "big", "documents": docs})
    try:
        assert resp.status_code == 200, resp.text
        assert "(truncated: exceeded 400 token limit)" in resp.json()["message"]
        assert resp.json()["loaded_token_count"] <= 400
    finally:
        client.post("/remove_external_corpus", json={"corpus_id": "big"})
        back = client.post("/add_external_corpus", json={"corpus_id": str(corpus_file),
                                                         "file_path": str(corpus_file)})
        assert back.status_code == 200, back.text


def test_remove_needs_an_id(client):
    resp = client.post("/remove_external_corpus", json={})
    assert resp.status_code == 400 and resp.json() == {"success": False, "message": "corpus_id is required."}


def test_corpus_holding_the_answer_drafts_longer_blocks_and_survives_flush(client):
    text, cold = _accept_length(client)  # the start-up corpus does not hold this answer
    resp = client.post("/add_external_corpus", json={"corpus_id": "answer", "documents": [PROMPT + text]})
    assert resp.status_code == 200, resp.text
    try:
        client.post("/flush_cache").raise_for_status()
        assert "answer" in _corpora(client)  # flush resets the trie, not the corpora
        warm_text, warm = _accept_length(client)
        assert warm_text == text  # drafting never changes greedy output
        assert warm > cold, (cold, warm)
    finally:
        client.post("/remove_external_corpus", json={"corpus_id": "answer"})
