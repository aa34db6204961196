"""A short study on llama.cpp's llama-server end to end: local Ray, Ray Serve replicas of the llama.cpp engine kind
(shim + real llama-server, smallest model in Q4_1), MLflow and Optuna on SQLite. Baseline + two speculative configs on
a tiny greedy workload; every speculative trial's outputs are checked against the study's own baseline (the trial
records NOT_EQUIVALENT otherwise), and the winner is promoted. The study is `python -m pipeline.tune --engine
llama_cpp` as a user runs it from a shell (tests/cli_run.py: a clean environment, a new HOME), to its decision.
Skipped without llama-server (install command named)."""

from __future__ import annotations

import json

import pytest

from pipeline.config import load_study
from pipeline.records.tracking import Tracker
from serve.production.app import load_serving_config
from tests.cli_run import check_decided, tune
from tests.conftest import TINY_STUDY
from tests.integration.llama_cpp_helpers import require_llama_server

pytestmark = [pytest.mark.integration, pytest.mark.engines]
SPACE = ("algorithms: [none, llama_ngram_simple, llama_ngram_mod]\n"
         "common:\n  warmup_requests: {type: fixed, value: 1}\n"
         "branches:\n"
         "  llama_ngram_simple:\n    size_n: {type: fixed, value: 2}\n    size_m: {type: int, low: 4, high: 8}\n"
         "  llama_ngram_mod:\n    n_match: {type: fixed, value: 4}\n    n_min: {type: fixed, value: 1}\n"
         "    n_max: {type: fixed, value: 8}\n")


def test_llama_cpp_study_end_to_end(tmp_path):
    require_llama_server()
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    settings = {**TINY_STUDY, "engine.threads": 1, "workload.source": "code-edit",
                # the one llama.cpp study whose finalist is re-measured and decided on
                "promotion.finalists": 1}
    done = tune("llama_cpp", tmp_path, "--search-space", str(space), "--trials", "3",
                *[arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")])
    (tmp_path / "tune.log").write_text(done.stdout + done.stderr)  # kept with the test's folder for a failure's reader
    check_decided(done, first_line="[trial 1/3]")
    out = tmp_path / "out"
    study = load_study(out / "study.yaml", {})
    tracker = Tracker(f"sqlite:///{out / 'mlflow.db'}", study.name)
    client = tracker.client()
    runs = [r for r in client.search_runs([tracker.experiment_id()], max_results=100)
            if r.data.tags.get("specdec.kind") == "trial"]
    assert len(runs) == 3
    algorithms = set()
    for run in runs:
        tags = run.data.tags
        assert tags["outcome"] == "COMPLETE", (tags["outcome"], tags.get("reason"))
        algorithm = run.data.params["spec.algorithm"]
        algorithms.add(algorithm)
        assert run.data.metrics["tput_tok_s"] > 0
        info = json.loads(open(client.download_artifacts(run.info.run_id, "server_info.json", str(out))).read())
        assert info["llama_server_argv"][0].endswith("llama-server")
        assert json.loads(tags["engine_diffs"]) == {}  # what ran is what was asked
        if algorithm != "none":
            # checked against the baseline's greedy outputs: identical, prompt by prompt
            assert run.data.metrics["equiv_identical_share"] == 1.0
            assert run.data.metrics["accept_len"] >= 1.0
    assert algorithms == {"none", "llama_ngram_simple", "llama_ngram_mod"}
    config = load_serving_config(f"sqlite:///{out / 'mlflow.db'}", f"models:/specdec-{study.name}@production")
    assert config.replica.engine == "llama_cpp"  # production starts the same engine kind (serve/production.py)
    assert config.replica.spec.algorithm in algorithms
