"""What makes the CPU engine start fast: the verify-cost curve cached on disk per (model, dtype, threads, forward,
machine) with a forced re-measure, and the direct tokenizer load that skips AutoTokenizer's config import (same
tokenizer). Tiny models and tokenizers built here; no download."""

from __future__ import annotations

import json
import os

import pytest
import torch

from serve.engines.cpu import probe
from serve.engines.cpu.convert import load_tokenizer
from serve.engines.cpu.runner import ModelRunner

SIZES = (1, 2, 4)


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    # every probe reads as quiet: beside another test worker on 2 cores a disturbed table is measured again on the
    # next read, and these tests check the cache itself (the re-measure: tests/unit/test_simulate_probe.py)
    monkeypatch.setattr(probe, "PROBE_WAIT_LIMIT", float("inf"))
    monkeypatch.setattr(probe, "PROBE_STEAL_LIMIT", float("inf"))
    return tmp_path / "cache"


@pytest.fixture()
def tiny_dir(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         max_position_embeddings=512))
    path = tmp_path / "tiny"
    model.save_pretrained(path)
    return path


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_probe_is_measured_once_then_read_from_disk(cache_dir, tiny_dir):
    runner = ModelRunner.from_dir(tiny_dir, "float32")
    first = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, SIZES)
    assert first["source"] == "measured" and first["sizes"] == list(SIZES) and first["relative"][0] == 1.0
    files = list((cache_dir / "probe").glob("*.json"))
    assert len(files) == 1
    second = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, SIZES)
    assert second["source"] == "cache"
    assert {k: v for k, v in second.items() if k != "source"} == {k: v for k, v in first.items() if k != "source"}


def test_refresh_measures_again_and_replaces_the_entry(cache_dir, tiny_dir):
    runner = ModelRunner.from_dir(tiny_dir, "float32")
    first = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, SIZES)
    again = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, SIZES, refresh=True)
    assert again["source"] == "measured" and again["measured_at"] >= first["measured_at"]
    (entry,) = (cache_dir / "probe").glob("*.json")
    assert json.loads(entry.read_text())["measured_at"] == again["measured_at"]
    assert probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, SIZES)["measured_at"] == again["measured_at"]


def test_another_thread_count_or_rewritten_weights_is_another_entry(cache_dir, tiny_dir):
    runner = ModelRunner.from_dir(tiny_dir, "float32")
    probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, SIZES)
    torch.set_num_threads(2)  # restored by the fixture
    assert probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, SIZES)["source"] == "measured"
    torch.set_num_threads(1)
    weights = tiny_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    weights.write_bytes(weights.read_bytes())  # a re-conversion: same bytes, new mtime
    # the file system stamps with a coarse clock: a rewrite within one tick of the first write keeps its mtime
    os.utime(weights, ns=(before + 1_000_000_000, before + 1_000_000_000))
    assert probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, SIZES)["source"] == "measured"
    assert len(list((cache_dir / "probe").glob("*.json"))) == 3


def test_a_corrupt_entry_is_measured_again(cache_dir, tiny_dir):
    runner = ModelRunner.from_dir(tiny_dir, "float32")
    probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, SIZES)
    (entry,) = (cache_dir / "probe").glob("*.json")
    entry.write_text("{not json")
    assert probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, SIZES)["source"] == "measured"
    assert json.loads(entry.read_text())["curve"]["sizes"] == list(SIZES)


def _save_tokenizer(path, model_type: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "hello", "world", "the", "sky", "is", "blue"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["LlamaForCausalLM"],
                                                  "vocab_size": len(vocab)}))


def test_direct_tokenizer_load_equals_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    _save_tokenizer(tmp_path, "llama")
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    direct, auto = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(direct) is type(auto)
    text = "hello world the sky is green"
    assert direct.encode(text) == auto.encode(text) and direct.get_vocab() == auto.get_vocab()
    assert direct.eos_token_id == auto.eos_token_id and direct.all_special_ids == auto.all_special_ids
    messages = [{"role": "user", "content": "hello"}]
    assert direct.apply_chat_template(messages, tokenize=False) == auto.apply_chat_template(messages, tokenize=False)


def test_refresh_flag_reaches_the_config():
    from serve.engines.cpu.command_line import parse_config

    assert parse_config(["--model-path", "smollm2-135m"]).verify_probe_refresh is False
    assert parse_config(["--model-path", "smollm2-135m", "--verify-probe-refresh"]).verify_probe_refresh is True
