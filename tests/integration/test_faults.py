"""Each way a trial can fail, produced for real: the real CPU engine (smallest model) behind Ray Serve, told to fail
through its test-only `--test-fault` switch (serve/engines/cpu/faults.py) in the study's `engine.extra_flags`.

Every study here is tiny: a baseline and two enqueued NGRAM trials of one fixed point. The fault is scoped
`@speculative`, so the baseline runs correctly (and gives the outputs `wrong-tokens` is compared with) while both
speculative trials fail. Each failure must be recorded in MLflow (outcome, reason, the engine's own log), and the
study must go on: the second faulty trial still runs and the study ends normally with its keep-baseline decision."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

from pipeline.config import load_study
from pipeline.records.tracking import Tracker
from pipeline.search.space import load_space
from pipeline.study.driver import run_study
from tests.integration.conftest import TEST_THREADS

pytestmark = pytest.mark.integration

# warmup_requests 1: crash-after=1 / hang-after=1 then break on the first *measured* request, after one good answer.
SPACE = ("algorithms: [none, ngram]\ncommon:\n  warmup_requests: {type: fixed, value: 1}\nbranches:\n  ngram:\n"
         "    num_draft_tokens: {type: fixed, value: 3}\n    max_bfs_breadth: {type: fixed, value: 1}\n"
         "    capacity: {type: fixed, value: 100000}\n")
BASE = {"workload.warmup_prompts": 1, "workload.measure_prompts": 2, "workload.max_new_tokens": 8,
        "promotion.finalists": 1, "engine.start_timeout_s": 300, "engine.threads": TEST_THREADS,
        "budget.max_trials": 3, "seed": 0, "search.strategy": "tpe"}  # every trial a launch: the faults hit them

# (fault, outcome, text in the trial's reason, text the engine wrote to its log, extra study settings)
CASES = {
    "launch_failed": ("exit-at-start", "LAUNCH_FAILED", "exited with code 3",
                      "TEST FAULT exit-at-start: exiting with code 3", {}),
    # One measured prompt, so each faulty trial waits out one request timeout, which is wall time and nothing else:
    # 6 s is still > 10x what 8 tokens of the baseline take (~0.5 s at 1 thread, under load a few times that).
    "timeout": ("hang-after=1", "TIMEOUT", "timeout after 6 s",
                "TEST FAULT hang-after: generation request 2 accepted and never answered",
                {"engine.request_timeout_s": 6, "workload.measure_prompts": 1}),
    "not_equivalent": ("wrong-tokens", "NOT_EQUIVALENT", "0/2 outputs identical",
                       "TEST FAULT armed: wrong-tokens@speculative", {}),
    # The engine dies after answering the first measured request: a dead engine, not a verdict on its outputs.
    "unhealthy": ("crash-after=2", "UNHEALTHY", "1 of 2 measured requests failed",
                  "TEST FAULT crash-after: generation request 3 arrived; exiting with code 70", {}),
}


def trial_runs(study, out: Path):
    tracker = Tracker(f"sqlite:///{out / 'mlflow.db'}", study.name)
    client = tracker.client()
    runs = client.search_runs([tracker.experiment_id()], max_results=100, order_by=["attributes.start_time ASC"])
    return client, [r for r in runs if r.data.tags.get("specdec.kind") == "trial"]


def artifact_text(client, run, path: str) -> str:
    return Path(client.download_artifacts(run.info.run_id, path)).read_text(errors="replace")


@pytest.mark.parametrize("case", list(CASES))
def test_a_faulty_trial_is_recorded_with_its_engine_log_and_the_study_goes_on(case, tmp_path):
    fault, outcome, reason_text, log_text, extra = CASES[case]
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    study = load_study(None, {**BASE, **extra, "name": f"it-fault-{case.replace('_', '-')}",
                              "output_dir": str(tmp_path), "search_space": str(space),
                              "engine.extra_flags": ["--verify-probe-seconds", "0",
                                                     "--test-fault", f"{fault}@speculative"]})

    assert run_study(study, load_space(space)) == 0  # a faulty trial never ends the study

    client, runs = trial_runs(study, tmp_path)
    assert [r.data.params.get("spec.algorithm") for r in runs] == ["none", "ngram", "ngram"]
    baseline, *faulty = runs
    assert baseline.data.tags["outcome"] == "COMPLETE", baseline.data.tags.get("reason")
    assert "TEST FAULT" not in artifact_text(client, baseline, "engine.log")  # @speculative spared it
    for run in faulty:  # the second faulty trial ran after the first one failed
        tags = run.data.tags
        assert tags["outcome"] == outcome, f"{tags.get('outcome')}: {tags.get('reason')}"
        assert reason_text in tags["reason"], tags["reason"]
        engine_log = artifact_text(client, run, "engine.log")
        assert log_text in engine_log, engine_log[-3000:]
        assert "--test-fault" in engine_log  # the engine's command line opens its log
    if outcome == "NOT_EQUIVALENT":
        report = json.loads(artifact_text(client, faulty[0], "equivalence.json"))
        assert report["identical_share"] == 0.0 and set(report["first_divergence"].values()) == {0}

    trials = optuna.load_study(study_name=study.name, storage=f"sqlite:///{tmp_path / 'optuna.db'}").get_trials()
    assert len(trials) == 3 and all(t.state.is_finished() for t in trials)
    study_run = client.search_runs([runs[0].info.experiment_id], "tags.`specdec.kind` = 'study'")[0]
    assert study_run.info.status == "FINISHED" and study_run.data.tags.get("decision") == "keep_baseline"


def test_slow_start_delays_the_engine_before_it_loads_the_model(cpu_server, tmp_path):
    # A study sees this as LAUNCH_FAILED once the delay passes engine.start_timeout_s ("never got ready",
    # docs/design.md); here the switch itself is checked on the real engine, without spending a start timeout.
    from datetime import datetime

    import httpx

    args = ["--model-path", "smollm2-135m", "--threads", str(TEST_THREADS), "--verify-probe-seconds", "0",
            "--test-fault", "slow-start=3"]
    with cpu_server(args, tmp_path) as server:
        info = httpx.get(f"{server.url}/server_info", timeout=30).json()
        log = server.log()

    def stamp(text: str) -> datetime:
        line = next(line for line in log.splitlines() if text in line)
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")

    # The sleep comes before the model load, so /health could not answer during it.
    assert (stamp("engine ready in") - stamp("TEST FAULT slow-start: sleeping 3.0 s")).total_seconds() >= 3.0
    assert info["speculative_algorithm"] is None and "test_faults" not in info
