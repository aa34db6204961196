"""A chat workload's `warmup` corpus holds what the engine sees: the prompt rendered with the target's chat template."""

import json

import pytest

from pipeline.config import TrialConfig
from pipeline.trial.corpus import WARMUP_CORPUS, corpus_for_trial
from pipeline.measure.load import requests_of, target_tokenizer
from pipeline.workloads import Prompt
from serve.engines.cpu.models import hf_dir_for
from serve.spec import NgramSpec


def test_a_trial_renders_chat_warmup_items_with_the_target_model_template(tmp_path):
    model = hf_dir_for("smollm2-135m")
    if not (model / "config.json").exists():  # unit tests never download: the integration fixtures fetch it
        pytest.skip("smollm2-135m is not in the model cache (python -m serve.engines.cpu.models fetch smollm2-135m)")
    question = "Name a colour."
    warm = requests_of([Prompt(0, "c0", f"user: {question}", 8, messages=(("user", question),))], str(model))
    trial = TrialConfig(spec=NgramSpec(num_draft_tokens=8, external_corpus=WARMUP_CORPUS, external_sam_budget=3))
    _, written = corpus_for_trial(trial, warm, tmp_path, target=str(model))
    [document] = [json.loads(line) for line in open(written.path)]
    assert document != f"user: {question}" and question in document  # not the readable view
    tokenizer = target_tokenizer(str(model))
    assert tuple(tokenizer.encode(document, add_special_tokens=False)) == warm[0].input_ids
