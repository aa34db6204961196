"""A simulate-first study of a STANDALONE space end to end on the CPU engine (local Ray, Serve replicas, MLflow and
Optuna on SQLite; SmolLM2-135M drafting for itself, the model store's one small pair): the baseline answers its
warm-up split, the draft model alone is replayed over the baseline's measured answers (a child process with the
engine's own drafting code), every point of the space is predicted and only the best predicted one is launched
(more only if its prediction missed). Asserted: what the pipeline does, not which way a measurement falls -- the
draft replay ran and its time is on the study run, the launch count agrees with the logged errors, the prediction is
on the trial run, and the launched config's verify steps and tokens equal the replay's request by request
(concurrency 1: exact, not a tolerance)."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

from pipeline.config import load_study
from pipeline.search.draft_replay import run_draft_replay
from pipeline.search.simulate_first import SPACE_PREDICTIONS
from pipeline.search.space import BASELINE_ATTR, load_space, resolve
from pipeline.simulate.predict import PREDICTION_ATTR
from pipeline.simulate.simulator import Simulator
from pipeline.simulate.workload import answers_of
from pipeline.study.driver import run_study, workload_requests
from tests.integration.test_simulate_study import JUDGED, MAX_TRIALS, requests_of_run, runs_of, widening_of

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]

DRAFT = "smollm2-135m"
SPACE = ("algorithms: [none, standalone]\ncommon:\n  warmup_requests: {type: fixed, value: 1}\nbranches:\n"
         "  standalone:\n    num_steps: {type: int, low: 1, high: 3}\n    topk: {type: categorical, choices: [1, 2]}\n"
         "    num_draft_tokens: {type: int, low: num_steps + 1, high: num_steps * topk + 1}\n")


@pytest.fixture(scope="module")
def standalone_study(tmp_path_factory):
    out: Path = tmp_path_factory.mktemp("simulate-standalone")
    space = out / "space.yaml"
    space.write_text(SPACE)
    study = load_study(None, {"name": "it-simulate-standalone", "output_dir": str(out), "search_space": str(space),
                              "seed": 0, "model.drafts": {"standalone": DRAFT}, "workload.warmup_prompts": 3,
                              "workload.measure_prompts": 2, "workload.max_new_tokens": 12,
                              "promotion.finalists": 0, "engine.start_timeout_s": 300,
                              "budget.max_trials": MAX_TRIALS, **JUDGED})
    assert study.search.strategy == "auto"
    code = run_study(study, load_space(space))
    return study, load_space(space), out, code


def test_the_draft_replay_predicts_and_only_the_best_is_launched(standalone_study):
    study, space, out, code = standalone_study
    assert code == 0
    tracker, runs = runs_of(study, out)
    parent = next(r for r in runs if r.data.tags.get("specdec.kind") == "study")
    client = tracker.client()
    summary = json.loads(Path(client.download_artifacts(parent.info.run_id, "simulate/predictions.json",
                                                        str(out))).read_text())
    # 12 STANDALONE points: steps 1-3 at topk 1 (draft = steps + 1) and at topk 2 (draft steps + 1 .. 2 steps + 1)
    assert summary["fallback"] is None and summary["explored"].startswith("simulated 12 config(s) (every point)")
    assert f"draft replay of {DRAFT}" in summary["explored"]
    replayed = json.loads(Path(client.download_artifacts(parent.info.run_id, "simulate/draft_replay.json",
                                                         str(out))).read_text())
    assert (replayed["draft_model"], replayed["topks"], replayed["max_steps"], replayed["requests"]) == (
        DRAFT, [1, 2], 3, 2)
    assert 0 < parent.data.metrics["simulate_draft_replay_s"] <= parent.data.metrics["simulate_draft_replay_total_s"]
    # every point's prediction is on the study run too, best first
    lines = Path(client.download_artifacts(parent.info.run_id, SPACE_PREDICTIONS, str(out))).read_text().splitlines()
    every = [json.loads(line) for line in lines]
    assert [e["rank"] for e in every] == list(range(len(every)))
    assert sum(e["params"]["algorithm"] == "standalone" for e in every) == 12
    assert all(e["predicted"]["tput_tok_s"] > 0 for e in every)
    assert summary["cost_model"]["draft"] is not None  # the draft's measured step enters the step cost
    trials = optuna.load_study(study_name=study.name, storage=f"sqlite:///{out / 'optuna.db'}").get_trials()
    assert len(trials) == 2 + summary["widened"] <= study.budget.max_trials
    assert trials[0].user_attrs.get(BASELINE_ATTR) and PREDICTION_ATTR not in trials[0].user_attrs
    assert summary["widened"] == min(widening_of(summary, study.search.simulate.error_threshold),
                                     study.budget.max_trials - 2)
    launched = [r for r in runs if r.data.tags.get("specdec.kind") == "trial"
                and r.data.params["spec.algorithm"] == "standalone"]
    assert len(launched) == len(trials) - 1
    metrics = launched[0].data.metrics
    assert launched[0].data.tags["outcome"] == "COMPLETE", launched[0].data.tags.get("reason")
    assert metrics["prediction_error"] == pytest.approx(
        abs(metrics["predicted_tput_tok_s"] - metrics["tput_tok_s"]) / metrics["tput_tok_s"])
    assert trials[1].user_attrs[PREDICTION_ATTR]["tput_tok_s"] == pytest.approx(metrics["predicted_tput_tok_s"])


def test_the_launched_config_accepts_exactly_what_the_draft_replay_gave(standalone_study):
    study, space, out, _ = standalone_study
    tracker, runs = runs_of(study, out)
    trials = [r for r in runs if r.data.tags.get("specdec.kind") == "trial"]
    baseline = next(r for r in trials if r.data.params["spec.algorithm"] == "none")
    records = requests_of_run(tracker, baseline.info.run_id)
    warmup, measure = workload_requests(study, prompt_ids=True)
    answers = answers_of(records)
    measured_answers = [answers[m.index] for m in measure]
    tables = run_draft_replay(study, DRAFT, measured_answers, 3, (1, 2)).tables
    simulator = Simulator(answers, warmup, measure, seed=study.seed, drafts={DRAFT: tables})
    for launched in (r for r in trials if r.data.params["spec.algorithm"] == "standalone"):
        config = resolve(space, json.loads(launched.data.tags["optuna.params"]), study).config
        replayed = simulator.replay(config).phase("measure")
        measured = [r for r in requests_of_run(tracker, launched.info.run_id) if r.phase == "measure"]
        assert [(r.spec_verify_ct, r.completion_tokens) for r in measured] == [
            (r.spec_verify_ct, r.completion_tokens) for r in replayed]
        assert launched.data.metrics["predicted_accept_len"] == pytest.approx(launched.data.metrics["accept_len"])
