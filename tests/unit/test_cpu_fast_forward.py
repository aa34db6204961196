"""The hand-written Llama-family forward (llama.py) against HF's own modules on tiny random models (no download):
same greedy tokens, logits within float noise, the preallocated cache growing past its first allocation, weights
loaded straight from a safetensors dir equal to the HF module's, and the models it must refuse."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from serve.engines.cpu.decode import Decoder, Request, StopRules
from serve.engines.cpu.llama import LlamaForward, unsupported_reason
from serve.engines.cpu.runner import ModelRunner, tree_visibility
from serve.engines.cpu.verify import Sampling

VOCAB = 97
PROMPT = [5, 17, 42, 8, 77, 3, 19, 60, 11, 2]
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


def _tiny(kind: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model: PreTrainedModel
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**COMMON, head_dim=8, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 5000.0}))
    else:  # Qwen2: q/k/v biases, untied head
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON, tie_word_embeddings=False))
        with torch.no_grad():  # HF initialises biases to zero, which would not exercise them
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model.eval()


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _reference(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(model(input_ids=torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def _decode(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    req = Request(rid="t", prompt_ids=prompt, sampling=Sampling(temperature=0.0), rules=StopRules(max_new_tokens=n),
                  seed=0)
    decoder = Decoder(runner, None, None)
    for _ in range(n + 1):  # every step emits a token: more steps than tokens = a stuck decoder
        if req.finished:
            break
        decoder.step(req)
    assert req.finished, "the decoder made no progress"
    return req.output_ids


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fast_forward_logits_match_hf_full_forward(kind):
    model = _tiny(kind)
    runner = ModelRunner(model)
    assert runner.backend == "fast-llama"
    cache = runner.new_cache()
    last = runner.logits(runner.prefill(cache, PROMPT))
    parents = [-1, 0, 0, 2]  # a tree: root, two children, a grandchild under the second child
    tokens = [7, 8, 9, 10]
    base = runner.cache_len(cache)
    tree = runner.logits(runner.forward(cache, tokens, [base, base + 1, base + 1, base + 2],
                                        tree_visibility(base, parents)))
    with torch.inference_mode():
        full = model(input_ids=torch.tensor([PROMPT])).logits[0]
        path = model(input_ids=torch.tensor([PROMPT + [7, 9, 10]])).logits[0]
    torch.testing.assert_close(last[0], full[-1], atol=1e-5, rtol=1e-5)
    for row, col in ((0, base), (2, base + 1), (3, base + 2)):  # the nodes on the path root -> 9 -> 10
        torch.testing.assert_close(tree[row], path[col], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_decode_matches_hf_across_a_cache_regrow(kind):
    # 250 prompt tokens + 20 new ones: past the first allocation of 256 columns, so the cache regrows mid-decode
    model = _tiny(kind, seed=1)
    prompt = torch.randint(0, VOCAB, (250,), generator=torch.Generator().manual_seed(3)).tolist()
    assert _decode(ModelRunner(model), prompt, 20) == _reference(model, prompt, 20)


def test_hf_module_keeps_working_on_the_fused_weights():
    model = _tiny("llama")
    with torch.inference_mode():
        before = model(input_ids=torch.tensor([PROMPT])).logits
    runner = ModelRunner(model)
    assert runner.fast is not None
    attn = model.model.layers[0].self_attn
    # the HF parameters are views into the fused tensors now: one copy of the weights
    assert attn.q_proj.weight.untyped_storage().data_ptr() == runner.fast.layers[0].qkv.untyped_storage().data_ptr()
    with torch.inference_mode():
        after = model(input_ids=torch.tensor([PROMPT])).logits
    assert torch.equal(before, after)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_from_dir_equals_from_hf_without_hf_modules(kind, tmp_path):
    model = _tiny(kind)
    model.save_pretrained(tmp_path)
    from_dir = ModelRunner.from_dir(tmp_path, "float32")
    assert isinstance(from_dir.model, LlamaForward) and from_dir.backend == "fast-llama"
    from_hf = ModelRunner(model)
    for runner in (from_dir, from_hf):
        assert runner.vocab_size == VOCAB and runner.config.max_position_embeddings == 1024
    cache_a, cache_b = from_dir.new_cache(), from_hf.new_cache()
    a = from_dir.logits(from_dir.prefill(cache_a, PROMPT))
    b = from_hf.logits(from_hf.prefill(cache_b, PROMPT))
    assert torch.equal(a, b)  # the same fused values, the same ops
    assert from_dir.model.generation_config.eos_token_id == model.generation_config.eos_token_id


def test_from_dir_falls_back_to_hf_modules_for_other_architectures(tmp_path):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    Gemma3ForCausalLM(Gemma3TextConfig(**COMMON, head_dim=8, sliding_window=4)).save_pretrained(tmp_path)
    runner = ModelRunner.from_dir(tmp_path, "float32")
    assert runner.backend == "hf" and runner.fast is None
    assert len(_decode(runner, PROMPT, 4)) == 4


@pytest.mark.parametrize("change,needle", [
    ({"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}, "architecture"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_type"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "sliding"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding"),
])
def test_unsupported_configs_name_the_reason(change, needle):
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
              "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}
    assert unsupported_reason(config) is None
    reason = unsupported_reason({**config, **change})
    assert reason is not None and needle in reason
