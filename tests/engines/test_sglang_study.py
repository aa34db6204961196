"""A real study on SGLang 0.5.23's own server on this CPU, end to end: Ray Tune + Optuna, the baseline and NGRAM
trials through Ray Serve replicas that start SGLang as a replica does, greedy outputs compared with the baseline's,
MLflow on SQLite, the decision and the registry, then the production endpoint (serve.production) on real SGLang
answering the real `openai` client, plain, streamed and chat.

Sized for CI: SGLang starts take 20-50 s here, so the study has three trials and three launches in all (baseline,
one NGRAM launch shared by the two trials that differ only in warm-up length, production), short outputs, and
`promotion.finalists: 0`, which forces the decision (keep the baseline, registered as production) instead of
re-measuring finalists (six more launches). The study is `python -m pipeline.tune --engine sglang` as a user runs it
from a shell (tests/cli_run.py: a clean environment, a new HOME): with `--engine sglang` the study's validation once
imported Ray before the command line set Ray's auth mode, and the local Ray it started refused its own driver
("Failed to start GCS"), so every SGLang study from a shell died before its first trial while library-level studies
passed. Skipped without SGLang's CPU venv (bash infra/install-sglang-cpu.sh)."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from pipeline.config import load_study
from pipeline.records.tracking import Tracker
from pipeline.study.driver import connect_ray
from serve.production.settings import ProductionSettings
from serve.production.app import deploy
from tests.cli_run import check_decided, tune
from tests.conftest import TINY_STUDY
from tests.sglang_servers import needs_sglang_cpu

pytestmark = [pytest.mark.integration, pytest.mark.engines, needs_sglang_cpu]
SPACE = ("algorithms: [none, ngram]\ncommon:\n  warmup_requests: {type: categorical, choices: [1, 2]}\n"
         "branches:\n  ngram:\n    num_draft_tokens: {type: fixed, value: 4}\n"
         "    max_bfs_breadth: {type: fixed, value: 2}\n    capacity: {type: fixed, value: 100000}\n")


@pytest.fixture(scope="module")
def study_run(tmp_path_factory):
    """(the resolved study, its output folder, the finished command)."""
    tmp = tmp_path_factory.mktemp("sglang-study")
    space = tmp / "space.yaml"
    space.write_text(SPACE)
    settings = {**TINY_STUDY, "engine.device": "cpu", "engine.threads": 1, "engine.start_timeout_s": 600}
    done = tune("sglang", tmp, "--search-space", str(space), "--trials", "3",
                *[arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")])
    out = tmp / "out"
    (tmp / "tune.log").write_text(done.stdout + done.stderr)  # kept with the test's folder for a failure's reader
    return load_study(out / "study.yaml", {}), out, done


def trial_runs(study, out):
    tracker = Tracker(f"sqlite:///{out / 'mlflow.db'}", study.name)
    runs = tracker.client().search_runs([tracker.experiment_id()], max_results=100)
    return tracker, sorted((r for r in runs if r.data.tags.get("specdec.kind") == "trial"),
                           key=lambda r: r.info.start_time)


def test_the_study_measures_baseline_and_ngram_on_sglang_and_decides(study_run):
    study, out, done = study_run
    check_decided(done, first_line="[trial 1/3]")
    _, runs = trial_runs(study, out)
    assert len(runs) == 3
    tags = [r.data.tags for r in runs]
    assert [t["outcome"] for t in tags] == ["COMPLETE"] * 3, [t.get("reason") for t in tags]
    params = [json.loads(t["optuna.params"]) for t in tags]
    assert params[0]["algorithm"] == "none" and {p["algorithm"] for p in params[1:]} == {"ngram"}
    for run in runs[1:]:  # greedy NGRAM outputs compared with the baseline's, token for token
        assert run.data.metrics["equiv_identical_share"] == 1.0
    effective = [json.loads(t["engine_effective"]) for t in tags]
    # Defects 2.2 and 2.5 read back from the real /server_info: one attention backend and one running-request cap
    # for the baseline and every trial; 2.6: the study's dtype.
    assert {(e["attention_backend"], e["effective_max_running_requests_per_dp"], e["dtype"]) for e in effective} == \
        {("torch_native", 48, "float32")}
    assert [e.get("speculative_algorithm") for e in effective] == [None, "NGRAM", "NGRAM"]
    assert all(json.loads(t["engine_diffs"]) == {} for t in tags)
    tracker, _ = trial_runs(study, out)
    decided = [r.data.tags["decision"] for r in tracker.client().search_runs([tracker.experiment_id()])
               if "decision" in r.data.tags]
    assert decided == ["keep_baseline"]  # forced: promotion.finalists is 0


def test_production_serves_the_registered_config_on_sglang_to_the_openai_client(study_run):
    study, out, _ = study_run
    base_url = connect_ray("sglang-production-test")
    settings = ProductionSettings(registered_model=f"specdec-{study.name}", tracking_uri=f"sqlite:///{out / 'mlflow.db'}",
                                  app_name="sglang-production", max_tokens_limit=32)
    served = deploy(settings)
    try:
        assert served["config"]["replica"]["engine"] == "sglang"
        api = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)
        model = api.models.list().data[0].id
        prompt = "def add(a, b):\n    return"
        plain = api.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
        streamed = "".join(c.choices[0].text for c in api.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True) if c.choices)
        assert plain and plain == streamed
        messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]
        chat = api.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0)
        chat_streamed = "".join(c.choices[0].delta.content or "" for c in api.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0, stream=True) if c.choices)
        assert chat.choices[0].message.content and chat.choices[0].message.content == chat_streamed
    finally:
        from ray import serve

        serve.delete(settings.app_name)
