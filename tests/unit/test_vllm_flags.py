"""engine.kind vllm without vLLM: the spec variant, the command line and environment, the SGLang <-> OpenAI mapping,
`/metrics` parsing, the kind's registration through the Engine interface, the bundled space and example study."""

import json

import pytest

from pipeline.config.trial import TrialConfig, validate_trial
from serve.engines import algorithms_of, engine_for
from serve.engines.base import ConfigRejected, ReplicaConfig
from serve.engines.vllm import flags, install, protocol
from serve.engines.vllm.check import flags_of
from serve.spec import NgramSpec, NoSpec, VllmNgramSpec, draft_token_count, parse_spec, validate_spec

PYTHON = "/venv/bin/python"


@pytest.fixture
def vllm(monkeypatch):
    """The kind's Engine, with the model store's folder and the venv's interpreter stubbed (nothing converted)."""
    monkeypatch.setattr("serve.engines.vllm.adapter.model_folder", lambda model: f"/models/{model}")
    monkeypatch.setattr(install, "venv_python", lambda: None)
    monkeypatch.setenv(install.VENV_ENV, "/venv")
    return engine_for("vllm")


def test_the_spec_parses_validates_and_counts_its_draft_tokens():
    spec = parse_spec({"algorithm": "vllm_ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                       "prompt_lookup_max": 3})
    assert isinstance(spec, VllmNgramSpec) and draft_token_count(spec) == 4 and validate_spec(spec) == []
    (problem,) = validate_spec(VllmNgramSpec(prompt_lookup_min=4, prompt_lookup_max=2))
    assert problem.field == "spec.prompt_lookup_min" and "prompt_lookup_min=4, prompt_lookup_max=2" in str(problem)
    with pytest.raises(ValueError, match="extra"):
        parse_spec({"algorithm": "vllm_ngram", "k": 3})


def test_the_kind_is_registered_through_the_engine_interface():
    engine = engine_for("vllm")
    assert engine.kind == "vllm" and algorithms_of("vllm") == {"none", "vllm_ngram", "vllm_suffix"}
    assert validate_trial(TrialConfig(spec=VllmNgramSpec()), "vllm") == []
    assert validate_trial(TrialConfig(spec=NoSpec()), "vllm") == []
    (problem,) = validate_trial(TrialConfig(spec=NgramSpec()), "vllm")  # SGLang's NGRAM is not vLLM's ngram
    assert "vLLM implements only" in problem.rule
    assert "vllm_ngram" not in algorithms_of("sglang") | algorithms_of("llama_cpp") | algorithms_of("cpu")


def test_the_speculative_config_is_vllms_json_and_the_baseline_has_none():
    assert flags.speculative_config(NoSpec()) is None
    assert flags.speculative_config(VllmNgramSpec(num_speculative_tokens=5, prompt_lookup_min=1,
                                                  prompt_lookup_max=4)) == {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    with pytest.raises(ValueError, match="not a vLLM method"):
        flags.speculative_config(NgramSpec())


def test_the_server_argv_is_vllms_module_with_eager_mode_and_per_request_counters():
    argv = flags.server_argv(PYTHON, "/m", "smollm2-135m", "float32", VllmNgramSpec(), 4, ["--max-model-len", "2048"])
    assert argv[:3] == [PYTHON, "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == "/m" and argv[argv.index("--served-model-name") + 1] == "smollm2-135m"
    assert "--enforce-eager" in argv and argv[argv.index("--max-num-seqs") + 1] == "4"
    assert json.loads(argv[argv.index("--speculative-config") + 1])["method"] == "ngram"
    assert argv[argv.index("--per-request-spec-decode-metrics") + 1] == "detailed"
    assert argv[-2:] == ["--max-model-len", "2048"] and flags_of(argv) == argv[3:]
    baseline = flags.server_argv(PYTHON, "/m", "m", "auto", NoSpec(), None, [])
    assert "--speculative-config" not in baseline and "--per-request-spec-decode-metrics" not in baseline
    assert "--max-num-seqs" not in baseline  # vLLM's own default


@pytest.mark.parametrize("flag", ["--max-num-seqs", "--speculative-config={}", "--dtype", "--port"])
def test_extra_flags_may_not_set_what_the_tuner_renders(vllm, flag):
    with pytest.raises(ValueError, match="engine.extra_flags"):
        flags.server_argv(PYTHON, "/m", "m", "float32", NoSpec(), None, [flag, "1"])
    with pytest.raises(ConfigRejected, match=flag.split("=")[0]):
        vllm.argv(ReplicaConfig(engine="vllm", model="m", extra_flags=[flag, "1"]), "127.0.0.1", 9)


def test_the_threads_are_bound_to_the_replicas_cpus_and_nothing_is_fetched():
    assert flags.cpu_bind([0, 1]) == "0-1" and flags.cpu_bind([3, 0, 2, 5, 6]) == "0,2-3,5-6"
    env = flags.engine_env([0, 1, 2, 3], threads=2)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert flags.engine_env([0, 1], None)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_the_shim_wraps_vllms_command_and_the_studys_env_wins(vllm):
    config = ReplicaConfig(engine="vllm", model="smollm2-135m", spec=VllmNgramSpec(), cpus=(0, 1),
                           env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    argv = vllm.argv(config, "127.0.0.1", 9000)
    assert argv[1:3] == ["-m", "serve.engines.vllm"] and argv[argv.index("--model-name") + 1] == "smollm2-135m"
    server = argv[argv.index("--") + 1:]
    assert server[0] == "/venv/bin/python" and server[server.index("--model") + 1] == "/models/smollm2-135m"
    env = vllm.start_env(config)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_the_deploy_folder_gets_the_bare_vllm_command(vllm):
    config = ReplicaConfig(engine="vllm", model="smollm2-135m", spec=VllmNgramSpec(num_speculative_tokens=2),
                           cpus=(0, 1), env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    (text,) = vllm.native_deploy_files(config, "0.0.0.0", 8000).values()
    assert "exec /venv/bin/python -m vllm.entrypoints.openai.api_server --model /models/smollm2-135m" in text
    assert "--port 8000" in text and '"num_speculative_tokens":2' in text
    assert "export VLLM_CPU_OMP_THREADS_BIND=0-1" in text and "VLLM_CPU_KVCACHE_SPACE must be set" in text
    assert "export VLLM_CPU_KVCACHE_SPACE" not in text  # engine.env values are never written


def test_without_the_venv_the_install_problem_names_the_command(monkeypatch, tmp_path):
    monkeypatch.setenv(install.VENV_ENV, str(tmp_path / "none"))
    engine = engine_for("vllm")
    assert engine.installed("cpu") is None
    problem = engine.install_problem("cpu", None)
    assert problem and "bash infra/install-vllm-cpu.sh" in problem and str(tmp_path / "none") in problem
    with pytest.raises(install.VllmMissing, match="install-vllm-cpu.sh"):
        install.require_python()
    (tmp_path / "v" / "bin").mkdir(parents=True)
    (tmp_path / "v" / "bin" / "python").touch()
    monkeypatch.setenv(install.VENV_ENV, str(tmp_path / "v"))
    assert install.venv_python() is None  # no stamp: a partial install
    (tmp_path / "v" / install.STAMP_FILE).write_text(install.VERSION + "\n")
    assert install.venv_python() == tmp_path / "v" / "bin" / "python"


def test_a_generate_body_becomes_a_completion_with_token_ids():
    body = protocol.completion_body({"input_ids": [1, 2, 3], "stream": True, "sampling_params": {
        "max_new_tokens": 8, "temperature": 0, "stop": "\n"}}, "m")
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 8 and body["return_token_ids"] is True
    assert body["stream_options"] == {"include_usage": True} and body["stop"] == ["\n"] and body["top_k"] == -1
    assert protocol.completion_body({"text": "hi"}, "m")["prompt"] == "hi"
    bads: list[object] = [{}, {"input_ids": []}, {"text": "x", "sampling_params": {"max_new_tokens": 0}}, []]
    for bad in bads:
        with pytest.raises(protocol.BadRequest):
            protocol.completion_body(bad, "m")


def test_per_request_counters_map_to_sglangs_names():
    metrics = {"speculative_decoding": {"num_draft_tokens": 12, "num_accepted_draft_tokens": 9,
                                        "num_spec_steps": 4}}
    usage = {"prompt_tokens": 30, "completion_tokens": 24, "prompt_tokens_details": {"cached_tokens": 16}}
    meta = protocol.meta_info({"finish_reason": "length"}, usage, metrics, True, 0.5)
    assert meta["spec_verify_ct"] == 24 - 1 - 9 and meta["spec_accept_length"] == 24 / 14
    assert (meta["spec_num_proposed_drafts"], meta["spec_num_correct_drafts"]) == (12, 9)
    assert meta["finish_reason"] == {"type": "length", "length": 24} and meta["cached_tokens"] == 16
    assert "spec_verify_ct" not in protocol.meta_info({"finish_reason": "stop"}, usage, metrics, False, 0.5)
    assert "spec_verify_ct" not in protocol.meta_info({"finish_reason": "stop"}, usage, None, True, 0.5)
    stop = protocol.meta_info({"finish_reason": "stop", "stop_reason": None}, usage, metrics, True, 0.5)
    assert stop["finish_reason"] == {"type": "stop", "matched": None}


def test_metrics_are_summed_over_label_sets_and_taken_since_a_base():
    page = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 6.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 18.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 15.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 6.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 4.0',
        'vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9',
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0'])
    found = protocol.spec_metrics(page)
    assert found == {"vllm:spec_decode_num_drafts_total": 6.0, "vllm:spec_decode_num_draft_tokens_total": 18.0,
                     "vllm:spec_decode_num_accepted_tokens_total": 15.0,
                     "vllm:spec_decode_num_accepted_tokens_per_pos_total[0]": 6.0,
                     "vllm:spec_decode_num_accepted_tokens_per_pos_total[2]": 4.0}
    assert protocol.metrics_since(found, {"vllm:spec_decode_num_drafts_total": 2.0})[
        "vllm:spec_decode_num_drafts_total"] == 4.0


def test_the_bundled_space_fits_the_kind_and_is_named_first():
    from pipeline.search.space import load_space
    from pipeline.study.dry_checks import fitting_spaces

    spaces = fitting_spaces("vllm")
    assert spaces[0] == "vllm-ngram.yaml"
    from pipeline.config import SEARCH_SPACES_DIR

    space = load_space(SEARCH_SPACES_DIR / "vllm-ngram.yaml")
    assert list(space.algorithms) == ["none", "vllm_ngram"]
