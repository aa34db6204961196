"""The CPU engine's round table (serve/engines/cpu/probe.py `measure_round_cost`), measured on a tiny Llama built
here (no download): one cell per batch and width, the LM head per row count, the long-context step, cached with the
verify-cost curve, and readable by the pipeline's step-cost model. ~3 s."""

from __future__ import annotations

import pytest
import torch

from pipeline.simulate.cost import round_table
from serve.engines.cpu import probe
from serve.engines.cpu.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture()
def tiny_dir(tmp_path, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         max_position_embeddings=1024))
    model.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def test_the_round_table_is_measured_once_per_key_and_the_cost_model_reads_it(tiny_dir):
    runner = ModelRunner.from_dir(tiny_dir, "float32")
    curve = probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2, 4))
    table = curve["round_cost"]
    assert table["batches"] == list(probe.ROUND_BATCHES) and table["widths"] == [1, 2, 4]
    assert [len(row) for row in table["ms"]] == [3] * len(probe.ROUND_BATCHES)
    assert all(ms > 0 for row in table["ms"] for ms in row) and len(table["lm_head_ms"]) == len(probe.LM_HEAD_ROWS)
    assert table["long_context_tokens"] == probe.LONG_CONTEXT_TOKENS and table["long_context_ms"] > 0
    assert probe.cached_verify_cost(runner, tiny_dir, "float32", 0.0, (1, 2, 4))["round_cost"] == table  # cached
    model = round_table(curve)
    assert model is not None and model.verify_ms(3, 3, 5, 200) > 0
