"""The closed loop's first half, for real: the production endpoint (Ray Serve, CPU engine, `openai` client) captures
sampled traffic to Parquet; the parts merge into a workload file; the same capture becomes a corpus; a study replays
the capture with the corpus dimension (none / the capture as a corpus) and reports corpus vs none. Small on purpose:
5 captured requests, 3 trials of 2 measured prompts each."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from pipeline.config import load_study
from pipeline.trial.corpus import main as corpus_main
from pipeline.records.tracking import Tracker
from pipeline.records.registry import register_config, set_production
from pipeline.search.space import load_space
from pipeline.study.driver import connect_ray, run_study
from pipeline.workloads import read_prompts
from serve.closed_loop.capture import CaptureSettings, merge_parts
from serve.engines.base import ReplicaConfig
from serve.production.settings import ProductionSettings
from serve.production.app import deploy
from serve.serving import Provenance, ServingConfig

from tests.conftest import TINY_STUDY

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
MODEL = "smollm2-135m"
NGRAM = {"algorithm": "ngram", "num_draft_tokens": 4, "max_bfs_breadth": 2, "min_bfs_breadth": 1, "match_type": "BFS",
         "max_trie_depth": 8, "capacity": 100000}
QUESTIONS = ["List three colours.", "Count from one to five.", "Name two fruits.", "Say hello in French."]


def _rows(directory: Path) -> int:
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(p).metadata.num_rows for p in directory.glob("part-*.parquet"))


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """(merged capture file, what the client received, in send order)."""
    tmp = tmp_path_factory.mktemp("capture")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    tracker = Tracker(uri, "capture-test", artifact_dir=tmp / "artifacts")
    run = tracker.client().create_run(tracker.experiment_id(), run_name="study-capture")
    replica = ReplicaConfig(model=MODEL, spec=NGRAM, max_running_requests=4, start_timeout_s=420.0)
    config = ServingConfig(replica=replica, provenance=Provenance(
        study="capture", decision="promote", source="final-0", workload="templated",
        workload_digest="0123456789abcdef", medians={"tput_tok_s": 1.0}))
    register_config(tracker, run.info.run_id, "specdec-capture", config, move_production=True)
    set_production(tracker, "specdec-capture", "1")
    base_url = connect_ray("capture-test")
    parts = tmp / "parts"
    settings = ProductionSettings(registered_model="specdec-capture", tracking_uri=uri, app_name="capture",
                                  max_tokens_limit=64,
                                  capture=CaptureSettings(dir=str(parts), sample_rate=1, flush_rows=1))
    deploy(settings)
    try:
        api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused-on-localhost", max_retries=0, timeout=120)
        answers = []
        for i, question in enumerate(QUESTIONS):
            messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": question}]
            if i % 2:
                answers.append("".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True) if c.choices))
            else:
                content = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                      temperature=0).choices[0].message.content
                assert content is not None
                answers.append(content)
        answers.append(api.completions.create(model=MODEL, prompt="def add(a, b):\n    return", max_tokens=8,
                                              temperature=0).choices[0].text)
        deadline = time.monotonic() + 60  # parts are written off the request path
        while _rows(parts) < 5 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        from ray import serve

        serve.delete(settings.app_name)
    out = tmp / "captured.parquet"
    assert merge_parts(parts, out) == 5
    return out, answers


def test_capture_holds_what_production_answered(captured):
    path, answers = captured
    prompts, _ = read_prompts(path)
    by_text = {p.messages[-1][1] if p.messages else p.text: p for p in prompts}  # parts may land out of order
    for question, answer in zip(QUESTIONS, answers):
        row = by_text[question]
        assert row.messages == (("user", question),) and row.output == answer and row.max_new_tokens == 12
    assert by_text["def add(a, b):\n    return"].output == answers[-1]


def test_a_study_replays_the_capture_with_the_capture_as_a_corpus(captured, tmp_path):
    path, _ = captured
    corpus = tmp_path / "capture-corpus.jsonl"
    assert corpus_main([str(path), str(corpus)]) == 0
    space = tmp_path / "space.yaml"
    space.write_text(
        "algorithms: [none, ngram]\ncommon:\n  warmup_requests: {type: fixed, value: 0}\nbranches:\n  ngram:\n"
        "    num_draft_tokens: {type: fixed, value: 6}\n    max_bfs_breadth: {type: fixed, value: 2}\n"
        "    capacity: {type: fixed, value: 100000}\n"
        f"    external_corpus: {{type: categorical, choices: [null, {corpus}]}}\n"
        f"    external_sam_budget: {{type: fixed, value: 2, when: {{external_corpus: [{corpus}]}}}}\n")
    study = load_study(None, {**TINY_STUDY, "name": "it-capture", "output_dir": str(tmp_path / "out"),
                              "search_space": str(space), "workload.source": str(path), "budget.max_trials": 3,
                              "workload.warmup_prompts": 1, "seed": 0})  # seed 0 samples both corpus choices
    assert run_study(study, load_space(space)) == 0
    tracker = Tracker(f"sqlite:///{tmp_path / 'out' / 'mlflow.db'}", study.name)
    runs = [r for r in tracker.client().search_runs([tracker.experiment_id()], max_results=100)
            if r.data.tags.get("specdec.kind") == "trial"]
    assert len(runs) == 3 and {r.data.tags["outcome"] for r in runs} == {"COMPLETE"}
    corpora = {r.data.params.get("spec.external_corpus") for r in runs if r.data.params.get("spec.algorithm") == "ngram"}
    assert corpora == {None, str(corpus)}, corpora  # MLflow keeps no param for None
    assert list((tmp_path / "out").rglob("corpus_vs_accept.png"))
