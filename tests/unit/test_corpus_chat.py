"""A chat workload's `warmup` corpus holds what the engine sees: the prompt rendered with the target's chat template.

The target is a tokenizer-only model dir built here (byte-level, a chat template of its own), loaded the way a study
loads its target (`serve.engines.tokenizer_for`): the test needs no model cache and no download."""

import json
from pathlib import Path

from pipeline.config import TrialConfig
from pipeline.measure.load import requests_of, target_tokenizer
from pipeline.trial.corpus import WARMUP_CORPUS, corpus_for_trial
from pipeline.workloads import Prompt
from serve.spec import NgramSpec

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def tokenizer_dir(path: Path) -> Path:
    """A Llama-family dir with a byte-level tokenizer (every text round-trips) and TEMPLATE."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    raw = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                  "vocab_size": len(alphabet)}))
    return path


def test_a_trial_renders_chat_warmup_items_with_the_target_model_template(tmp_path):
    model = str(tokenizer_dir(tmp_path / "target"))
    question = "Name a colour."
    warm = requests_of([Prompt(0, "c0", f"user: {question}", 8, messages=(("user", question),))], model)
    trial = TrialConfig(spec=NgramSpec(num_draft_tokens=8, external_corpus=WARMUP_CORPUS, external_sam_budget=3))
    _, written = corpus_for_trial(trial, warm, tmp_path / "trial", target=model)
    assert written is not None
    [document] = [json.loads(line) for line in open(written.path)]
    assert document == f"<|user|>\n{question}\n<|assistant|>\n"  # the target's template, not the readable view
    tokenizer = target_tokenizer(model)
    assert tuple(tokenizer.encode(document, add_special_tokens=False)) == warm[0].input_ids
