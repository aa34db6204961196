"""CPU engine command line: SGLang flag names, SGLang's resolution of auto values, and clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from serve.engines.cpu.command_line import ConfigError, parse_config
from serve.spec import NgramSpec, NoSpec, StandaloneSpec

BASE = ["--model-path", "smollm2-135m"]


def test_no_algorithm_is_plain_decoding_with_defaults():
    cfg = parse_config(BASE)
    assert isinstance(cfg.spec, NoSpec) and cfg.algorithm is None
    args = cfg.server_args()
    assert args["speculative_algorithm"] is None and args["speculative_num_draft_tokens"] is None
    assert (args["host"], args["dtype"], args["max_running_requests"]) == ("127.0.0.1", "float32", 48)


def test_ngram_mirrors_sglang_resolution():
    cfg = parse_config(BASE + ["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "16",
                               "--speculative-ngram-max-bfs-breadth", "4", "--speculative-ngram-min-bfs-breadth", "2"])
    assert cfg.spec == NgramSpec(num_draft_tokens=16, max_bfs_breadth=4, min_bfs_breadth=2)
    args = cfg.server_args()
    assert args["speculative_algorithm"] == "NGRAM"  # case-insensitive input, SGLang spelling out
    assert (args["speculative_num_steps"], args["speculative_eagle_topk"]) == (4, 4)  # draft // breadth, breadth
    assert args["max_running_requests"] == 48


def test_ngram_defaults_and_ignored_topk_warn():
    cfg = parse_config(BASE + ["--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "3"])
    assert isinstance(cfg.spec, NgramSpec) and cfg.spec.num_draft_tokens == 12
    assert cfg.speculative_eagle_topk == 10 and cfg.speculative_num_steps == 1
    assert any("eagle-topk" in w for w in cfg.warnings) and any("12" in w for w in cfg.warnings)


def test_standalone_auto_params_are_sglangs():
    cfg = parse_config(BASE + ["--speculative-algorithm", "standalone", "--speculative-draft-model", "smollm2-135m"])
    assert cfg.spec == StandaloneSpec(draft_model="smollm2-135m", num_steps=3, topk=1, num_draft_tokens=4)
    assert cfg.server_args()["speculative_draft_model_path"] == "smollm2-135m"


def test_explicit_max_running_requests_wins():
    assert parse_config(BASE + ["--max-running-requests", "2"]).max_running_requests == 2


@pytest.mark.parametrize("argv,needle", [
    (["--speculative-algorithm", "eagle"], "not offered by the CPU engine"),
    (["--speculative-algorithm", "nextn"], "not offered by the CPU engine"),
    (["--speculative-algorithm", "foo"], "Unknown speculative algorithm name: foo"),
    (["--speculative-algorithm", "standalone"], "--speculative-draft-model-path"),
    (["--speculative-algorithm", "standalone", "--speculative-draft-model-path", "d", "--speculative-num-steps", "2"],
     "all set or all unset"),
    (["--speculative-algorithm", "standalone", "--speculative-draft-model-path", "d", "--speculative-num-steps", "3",
      "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "8"], "num_draft_tokens == num_steps + 1"),
    (["--speculative-algorithm", "ngram", "--speculative-ngram-capacity", "10", "--speculative-ngram-max-trie-depth",
      "18"], "--speculative-ngram-capacity"),
    (["--speculative-algorithm", "ngram", "--speculative-num-draft-tokens", "0"], "--speculative-num-draft-tokens"),
    (["--max-running-requests", "0"], "--max-running-requests"),
])
def test_bad_combinations_name_the_flag(argv, needle):
    with pytest.raises(ConfigError, match=None) as err:
        parse_config(BASE + argv)
    assert needle in str(err.value)


@pytest.mark.parametrize("argv", [["--no-such-flag"], ["--speculative-ngram-match-type", "bfs"],
                                  ["--dtype", "float16"], ["--speculative-num-draft"]])
def test_argparse_rejects_unknown_flags_bad_choices_and_abbreviations(argv, capsys):
    with pytest.raises(SystemExit) as err:
        parse_config(BASE + argv)
    assert err.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_config_and_model_table_import_without_torch():
    code = ("import sys, serve.engines.cpu.command_line, serve.engines.cpu.models as m; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules; print(len(m.KNOWN_MODELS))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "4"
