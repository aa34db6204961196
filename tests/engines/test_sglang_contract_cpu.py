"""SGLang 0.5.23's own server on this CPU (SmolLM2-135M, fp32, NGRAM draft 4 breadth 2), started by the adapter as a
replica starts it, against the contract the tuner relies on; then our CPU engine against it, differentially; then the
watchdog freeing the whole process group. One SGLang launch for the module (20-50 s here): the tests share it, and
the watchdog test, which kills it, runs last. Skipped without SGLang's CPU venv (bash infra/install-sglang-cpu.sh)."""

import os
import signal
import time

import httpx
import psutil
import pytest

from serve.engines.sglang import cpu as sglang_cpu
from serve.engines.base import ConfigRejected, ReplicaConfig
from serve.engines.sglang.engine import run_preflight, sglang_argv
from serve.replica.deployment import EngineProcess
from serve.spec import NgramSpec
from tests.sglang_contract import CORPUS, SglangContract
from tests.sglang_servers import needs_sglang_cpu, owned_engine, unkept_verdicts

pytestmark = [pytest.mark.integration, pytest.mark.engines, needs_sglang_cpu]
NGRAM = NgramSpec(num_draft_tokens=4, max_bfs_breadth=2, capacity=200_000)
CONFIG = ReplicaConfig(engine="sglang", device="cpu", model="smollm2-135m", spec=NGRAM, threads=1,
                       start_timeout_s=600)
# Copy-heavy prompts that repeat: the trie fills from decoded text, so later requests draft (and accept) more.
PROMPTS = ["Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.",
           "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n# again:\n",
           "List the days of the week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Again:",
           "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module")
def engine_config(tmp_path_factory):
    return CONFIG.model_copy(update={"log_dir": str(tmp_path_factory.mktemp("sglang"))})


@pytest.fixture(scope="module")
def engine(engine_config):
    with owned_engine(engine_config) as owned:
        yield owned


class TestSglangCpuContract(SglangContract):
    def test_the_engine_runs_sglangs_own_server_from_its_cpu_venv(self, engine):
        # Defect 2.6 and the CPU flags: what the adapter rendered is what was launched.
        argv = engine.argv
        assert argv[:4] == [str(sglang_cpu.venv_python()), "-m", "serve.engines.sglang.cpu", "serve"]
        for flag, value in (("--device", "cpu"), ("--dtype", "float32"), ("--attention-backend", "torch_native"),
                            ("--max-running-requests", "48")):
            assert argv[argv.index(flag) + 1] == value
        assert "--disable-overlap-schedule" in argv and "--sleep-on-idle" in argv
        assert engine.prepared["sglang_version"] == "0.5.23" and engine.prepared["preflight"]["ok"]


def meta_of(url, prompt, max_new_tokens=40):
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    data = httpx.post(f"{url}/generate", json=body, timeout=600).json()
    return data["output_ids"], data["meta_info"]


SPEC_KEYS = ("spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts",
             "spec_correct_drafts_histogram")


@pytest.fixture(scope="module")
def our_engine(tmp_path_factory):
    config = ReplicaConfig(model="smollm2-135m", spec=NGRAM, threads=1, weights="fp32",
                           log_dir=str(tmp_path_factory.mktemp("cpu-engine")))
    process = EngineProcess(config)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def test_our_cpu_engine_drafts_and_accepts_exactly_as_sglang(engine, our_engine):
    """The trie parity claim end to end: same model (fp32), same NGRAM config, same prompts one at a time from a
    flushed trie: equal outputs and, per request, equal verify steps, proposed and accepted drafts and accepted drafts
    per step (the histogram; the last step of a length-capped request counts every draft its verify accepted, also
    those the limit cut off, as SGLang's does)."""
    for url in (engine.url, our_engine.url):
        assert httpx.post(f"{url}/flush_cache", timeout=60).status_code == 200
    accepted = 0
    for prompt in PROMPTS:
        (ours_ids, ours), (theirs_ids, theirs) = meta_of(our_engine.url, prompt), meta_of(engine.url, prompt)
        assert ours_ids == theirs_ids, prompt
        ours, theirs = {k: ours[k] for k in SPEC_KEYS}, {k: theirs[k] for k in SPEC_KEYS}
        assert ours == theirs, prompt
        accepted += ours["spec_num_correct_drafts"]
    assert accepted > 10  # the prompts repeat: drafts were accepted, so the comparison covers accepting steps


def test_the_routes_the_adapter_uses_answer_alike(engine, our_engine):
    def answers(url):
        meta = meta_of(url, PROMPTS[1], 8)[1]
        info = httpx.get(f"{url}/server_info", timeout=60).json()
        added = httpx.post(f"{url}/add_external_corpus", json={"corpus_id": "d", "documents": CORPUS}, timeout=60)
        listed = httpx.get(f"{url}/list_external_corpora", timeout=60).json()
        removed = httpx.post(f"{url}/remove_external_corpus", json={"corpus_id": "d"}, timeout=60)
        flushed = httpx.post(f"{url}/flush_cache", timeout=60)
        return {"meta_keys": {k for k in meta if k.startswith("spec_")} | {"prompt_tokens", "completion_tokens"},
                "spec_info": {k: info.get(k) for k in ("speculative_algorithm", "speculative_num_draft_tokens",
                                                      "speculative_eagle_topk", "speculative_ngram_max_bfs_breadth")},
                "states": isinstance(info.get("internal_states"), list),
                "added": (added.status_code, sorted(added.json()), added.json()["loaded_token_count"]),
                "listed": listed, "removed": (removed.status_code, removed.json()), "flushed": flushed.status_code}

    assert answers(our_engine.url) == answers(engine.url)


def test_preflight_refuses_a_bad_argv_with_sglangs_words_before_any_launch(tmp_path):
    bad = CONFIG.model_copy(update={"extra_flags": ["--no-such-flag-in-sglang", "1"], "log_dir": str(tmp_path)})
    with pytest.raises(ConfigRejected, match="SGLang rejected the flags at parse.*unrecognized arguments"):
        EngineProcess(bad)
    # SGLang's own resolution, in the CPU venv: a corpus budget larger than the draft tree (its message, verbatim).
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('"def add(a, b):\\n    return a + b"\\n')
    too_big = CONFIG.model_copy(update={"spec": NgramSpec(num_draft_tokens=4, external_corpus=str(corpus),
                                                          external_sam_budget=5)})
    with unkept_verdicts():  # the argv names this test's temporary corpus
        (result,) = run_preflight([sglang_argv(too_big, "127.0.0.1", 1)], python=str(sglang_cpu.venv_python())) or []
    assert result.rejected and result.stage == "resolve" and "external_sam_budget" in (result.error or "")
    assert not list(tmp_path.glob("engine-*.log"))  # refused in the replica's preflight: nothing was launched


def test_the_watchdog_frees_the_whole_process_group_when_the_owner_dies(engine):
    """Last in the module: it kills the shared engine. The owner (a replica's stand-in) dies by SIGKILL, without
    running its teardown; the watchdog sees the re-parenting and kills SGLang's group (server, scheduler,
    detokenizer)."""
    group = [p for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == engine.watchdog_pid]
    assert len(group) >= 4  # watchdog, SGLang's server, its scheduler and detokenizer
    os.kill(engine.owner.pid, signal.SIGKILL)
    engine.owner.wait(timeout=30)
    deadline = time.monotonic() + 60
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in group):
        assert time.monotonic() < deadline, [p.pid for p in group if p.is_running()]
        time.sleep(0.2)
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{engine.url}/health", timeout=5)


def _pgid(pid):
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
