"""simulate-first on llama.cpp's llama-server end to end (local Ray, Serve replicas of the llama.cpp engine kind,
MLflow and Optuna on SQLite; SmolLM2-135M Q4_1): a space of ngram-simple, the llama.cpp type the simulator replays
(pipeline/simulate/lookup.py). The baseline answers its warm-up split, its verify-cost table is measured over
llama-server's HTTP API, every point is predicted and only the best predicted one is launched. Asserted: what the
pipeline does, not which way a measurement falls -- every point was predicted from the baseline, the launch carries
its prediction, and its verify steps and accepted drafts equal the replay's request by request (concurrency 1:
exact, not a tolerance). Skipped without llama-server (install command named)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import load_study
from pipeline.search.simulate_first import SPACE_PREDICTIONS
from pipeline.search.space import load_space, resolve
from pipeline.simulate.simulator import Simulator
from pipeline.simulate.workload import answers_of
from pipeline.study.driver import run_study, workload_requests
from tests.integration.llama_cpp_helpers import require_llama_server
from tests.integration.test_simulate_study import JUDGED, requests_of_run, runs_of

pytestmark = [pytest.mark.integration, pytest.mark.engines]
SPACE = ("algorithms: [none, llama_ngram_simple]\ncommon:\n  warmup_requests: {type: fixed, value: 1}\nbranches:\n"
         "  llama_ngram_simple:\n    size_n: {type: int, low: 1, high: 3}\n    size_m: {type: int, low: 2, high: 8}\n")


def test_a_simulate_first_study_on_llama_server_launches_the_best_predicted_config(tmp_path):
    require_llama_server()
    space_file = tmp_path / "space.yaml"
    space_file.write_text(SPACE)
    out = tmp_path / "out"
    study = load_study(None, {"name": "it-llama-simulate", "output_dir": str(out), "search_space": str(space_file),
                              "seed": 0, "engine.kind": "llama_cpp", "engine.threads": 1,
                              "workload.source": "code-edit", "workload.warmup_prompts": 2,
                              "workload.measure_prompts": 3, "workload.max_new_tokens": 24,
                              "promotion.finalists": 0, "budget.max_trials": 2, "engine.start_timeout_s": 300,
                              **JUDGED})
    space = load_space(space_file)
    assert run_study(study, space) == 0

    tracker, runs = runs_of(study, out)
    client = tracker.client()
    parent = next(r for r in runs if r.data.tags.get("specdec.kind") == "study")
    summary = json.loads(Path(client.download_artifacts(parent.info.run_id, "simulate/predictions.json",
                                                        str(out))).read_text())
    # size_n 1-3 x size_m 2-8: 21 points, every one predicted from the baseline alone
    assert summary["fallback"] is None and summary["explored"].startswith("simulated 21 config(s) (every point)")
    assert summary["cost_model"]["shape"] == "measured"  # the table measured over llama-server's HTTP API
    every = Path(client.download_artifacts(parent.info.run_id, SPACE_PREDICTIONS, str(out))).read_text().splitlines()
    assert len(every) == 21

    trials = [r for r in runs if r.data.tags.get("specdec.kind") == "trial"]
    baseline = next(r for r in trials if r.data.params["spec.algorithm"] == "none")
    (launched,) = [r for r in trials if r.data.params["spec.algorithm"] == "llama_ngram_simple"]
    assert launched.data.tags["outcome"] == "COMPLETE", launched.data.tags.get("reason")
    metrics = launched.data.metrics
    assert metrics["predicted_tput_tok_s"] > 0 and metrics["prediction_error"] == pytest.approx(
        abs(metrics["predicted_tput_tok_s"] - metrics["tput_tok_s"]) / metrics["tput_tok_s"])

    warmup, measure = workload_requests(study, prompt_ids=True)
    simulator = Simulator(answers_of(requests_of_run(tracker, baseline.info.run_id)), warmup, measure,
                          seed=study.seed)
    config = resolve(space, json.loads(launched.data.tags["optuna.params"]), study).config
    replayed = simulator.replay(config).phase("measure")
    measured = [r for r in requests_of_run(tracker, launched.info.run_id) if r.phase == "measure"]
    assert [(r.spec_verify_ct, r.spec_num_correct_drafts, r.completion_tokens) for r in measured] == [
        (r.spec_verify_ct, r.spec_num_correct_drafts, r.completion_tokens) for r in replayed]
