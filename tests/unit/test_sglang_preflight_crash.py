"""Issue 59: a preflight that crashes is not SGLang's verdict. The replica's preflight runs SGLang's resolution with
GPU packages stubbed and no GPU; an exception that SGLang's own code did not raise to refuse the config (transformers
looking a Hub id up without a network, a stubbed package) is reported as the preflight's failure with the traceback's
last line, the launch decides, and a baseline whose preflight crashed is queued again (it was INVALID, never retried,
and the study ended with no baseline). Also the models the preflight tests did not cover: DeepSeek-V3 (FP8, sm90) from
a config.json written here, and a model given as a Hub id with no local folder. The installed SGLang itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.search.space.define import baseline_retried
from pipeline.trial.engine_pass import start_failure
from pipeline.vocabulary.outcome import Outcome
from serve.engines.base import ConfigRejected, ReplicaConfig
from serve.engines.sglang.check import run_preflight
from serve.engines.sglang.engine import SglangEngine
from serve.spec import EagleSpec
from tests.unit.test_baseline_requeue import is_baseline, report, searcher_for
from tests.unit.test_sglang_flags import needs_sglang
from tests.unit.test_sglang_verdicts import model_folder

ROOT = Path(__file__).resolve().parents[2]
HUB_ID = "specdec-tests/no-such-model"  # a Hub id no cache holds: looked up offline, it can only fail

pytestmark = needs_sglang


@pytest.fixture
def offline(monkeypatch):
    """No network for the preflight's transformers (inherited by its subprocess): the Hub id's lookup fails at once."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def deepseek_v3_fp8(folder: Path) -> Path:
    """DeepSeek-V3's config.json (671B, MLA, FP8 block-quantized weights): the V2 example's layout with V3's
    changes, written here (the checkpoint's own file, as SGLang reads it)."""
    config = json.loads((ROOT / "examples" / "models" / "deepseek-v2-236b" / "config.json").read_text())
    config.update({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5, "topk_group": 4,
        "vocab_size": 129280, "num_nextn_predict_layers": 1,
        "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "weight_block_size": [128, 128]}})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_deepseek_v3_fp8_resolves_on_sm90(tmp_path):
    model = deepseek_v3_fp8(tmp_path / "deepseek-v3")
    argvs = [["--model-path", str(model), "--tp-size", "8", "--trust-remote-code"],
             ["--model-path", str(model), "--tp-size", "8", "--trust-remote-code", "--attention-backend", "triton",
              "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8",
              "--speculative-ngram-max-bfs-breadth", "4"]]
    results = run_preflight(argvs, gpu_arch="sm90")
    assert results is not None
    for result in results:
        assert result.ok, result.error
        assert result.resolved["use_mla_backend"] is True
        assert result.resolved["architecture"] == "DeepseekV3ForCausalLM" and result.resolved["tp_size"] == 8
    assert results[1].resolved["attention_backend"] == "triton"


def test_a_hub_id_the_preflight_cannot_look_up_is_its_crash_not_sglangs_verdict(offline):
    (result,) = run_preflight([["--model-path", HUB_ID, "--tp-size", "8"]], gpu_arch="sm90") or []
    assert not result.ok and not result.rejected and not result.cached
    assert result.stage == "crash"
    # the traceback's last line: the exception, the first line of its message, where it was raised
    assert result.error is not None
    assert result.error.startswith("the preflight crashed during resolve: OSError: ") and "raised at " in result.error
    assert len(result.error.splitlines()) == 1


def test_a_baseline_whose_preflight_crashed_is_launched_and_queued_again(offline, tmp_path):
    config = ReplicaConfig(engine="sglang", device="cuda", model=HUB_ID, tp_size=8, attention_backend="triton")
    engine = SglangEngine()
    # The replica's prepare: no verdict on the config, so the node decides (here: no GPU, so the launch fails).
    with pytest.raises(RuntimeError) as raised:
        engine.prepare(config, engine.argv(config, "127.0.0.1", 30000))
    assert not isinstance(raised.value, ConfigRejected), raised.value
    failure = start_failure(str(raised.value))  # as the trial reads the replica's error
    assert failure.outcome is Outcome.LAUNCH_FAILED  # a failure of the machine, not INVALID
    assert baseline_retried(failure.outcome.value)
    searcher = searcher_for(tmp_path)
    assert is_baseline(searcher.suggest("t0"))
    searcher.on_trial_complete("t0", report(failure.outcome.value, 0.0))
    assert is_baseline(searcher.suggest("t1"))  # queued again, to run alone next


def test_sglangs_own_refusal_is_still_its_verdict(tmp_path):
    model = model_folder(tmp_path)
    # partial EAGLE settings on a small Llama: SGLang's own resolution refuses them (raised by its own code)
    config = ReplicaConfig(engine="sglang", device="cuda", model=model, spec=EagleSpec(draft_model=model, num_steps=3))
    engine = SglangEngine()
    with pytest.raises(ConfigRejected) as raised:
        engine.prepare(config, engine.argv(config, "127.0.0.1", 30000))
    assert "SGLang rejected the flags at resolve" in str(raised.value) or \
        "SGLang rejected the flags at check" in str(raised.value)
    assert start_failure(str(raised.value)).outcome is Outcome.INVALID


def test_the_dry_runs_check_calls_a_crashed_preflight_no_verdict_not_invalid(offline):
    from serve.engines.sglang.study import check_commands

    config = ReplicaConfig(engine="sglang", device="cuda", model=HUB_ID, tp_size=8, attention_backend="triton")
    (check,) = check_commands([config], "sm90")
    assert check.ok is None and check.problem is None  # no INVALID line in the dry run
    assert check.unanswered is not None and check.unanswered.startswith("crash: the preflight crashed during resolve")
