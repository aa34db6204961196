"""Each way a trial can fail or be disturbed, produced for real in ONE study: the real CPU engine (smallest model)
behind Ray Serve, told to misbehave through its test-only `--test-fault` switch (serve/engines/cpu/faults.py), each
fault scoped to one NGRAM draft size (`@drafts=N`), and every point of the space launched in order
(`search.strategy: grid`). The baseline runs correctly (its outputs are what `wrong-tokens` is compared with).

Every failure must be recorded in MLflow (outcome, reason, the engine's own log) and the study must go on to its
decision: a failed trial is an outcome, never a crashed study. Which point fails which way is fixed by the grid and
the scopes, never by timing; the slowed config is 20x slower (~0.05-0.1x the baseline), and the disturbed window runs
beside busy processes pinned to the engine's own CPUs until the trial's next flush.

Early stopping's bound (pipeline/decide/stopping.py) is the measured figure times exp(t * s / sqrt(k)) and the run
noise, s the spread of the k requests' log throughput: on a quiet machine s is ~0.1 and the bound ~2x, but beside
another test's study (the engine waiting for a core half its runnable time) the 10x-slowed config's requests spread
0.6 (0.86-4.23 tok/s), its bound at 5 requests crossed the baseline's lower bound and the trial ran to completion.
So the slowed config is 20x slower and 8 requests are measured: at 7 requests it is stopped unless s exceeds ~1.3."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

from pipeline.config import load_study
from pipeline.measure.summary import to_records
from pipeline.records.tracking import Tracker
from pipeline.search.space import load_space
from pipeline.study.driver import run_study
from tests.integration.conftest import TEST_THREADS

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]

MEASURED = 8
# The hung request waits it out; the 20x-slowed config's requests take ~4 s alone and must stay under it on a loaded
# CI machine (with ~200-token prompts they took ~6 s, and at 20 s one did not: the trial ended TIMEOUT instead of
# being stopped early).
REQUEST_TIMEOUT_S = 30
# draft tokens -> (fault, outcome, text in the trial's reason, text the engine wrote to its log)
FAULTS = {
    2: ("exit-at-start", "LAUNCH_FAILED", "exited with code 3", "TEST FAULT exit-at-start: exiting with code 3"),
    # the first measured request is never answered: the trial waits out one request timeout and stops measuring
    3: ("hang-after=1", "TIMEOUT", f"timeout after {REQUEST_TIMEOUT_S} s",
        "TEST FAULT hang-after: generation request 2 accepted and never answered"),
    4: ("wrong-tokens", "NOT_EQUIVALENT", f"0/{MEASURED} outputs identical", "TEST FAULT armed: wrong-tokens@drafts=4"),
    # the engine dies when the second measured request arrives: a dead engine, not a verdict on its outputs
    5: ("crash-after=2", "UNHEALTHY", "measured requests failed",
        "TEST FAULT crash-after: generation request 3 arrived; exiting with code 70"),
    6: ("slow-steps=20", "PRUNED", "is below the baseline's lower bound", "TEST FAULT armed: slow-steps=20@drafts=6"),
    # busy neighbours from the first measured request until the next flush: the first window is disturbed, the
    # trial flushes and measures it again, clean
    7: ("busy-neighbours=1", "COMPLETE", "", "TEST FAULT busy-neighbours: generation request 2 arrived"),
}
SPACE = ("algorithms: [none, ngram, standalone]\ncommon:\n  warmup_requests: {type: fixed, value: 1}\nbranches:\n"
         "  ngram:\n    num_draft_tokens: {type: categorical, choices: [2, 3, 4, 5, 6, 7]}\n"
         "    min_bfs_breadth: {type: categorical, choices: [1, 2]}\n"  # 2 > max_bfs_breadth: INVALID, never deployed
         "    max_bfs_breadth: {type: fixed, value: 1}\n    capacity: {type: fixed, value: 100000}\n"
         "  standalone:\n    num_steps: {type: fixed, value: 2}\n    topk: {type: fixed, value: 1}\n"
         "    num_draft_tokens: {type: fixed, value: 3}\n")


@pytest.fixture(scope="module")
def fault_study(tmp_path_factory):
    out = tmp_path_factory.mktemp("fault-study")
    space = out / "space.yaml"
    space.write_text(SPACE)
    flags = ["--verify-probe-seconds", "0"]
    for drafts, (fault, *_) in FAULTS.items():
        flags += ["--test-fault", f"{fault}@drafts={drafts}"]
    study = load_study(None, {
        "name": "it-faults", "output_dir": str(out), "search_space": str(space), "seed": 0,
        "search.strategy": "grid", "budget.max_trials": 14, "promotion.finalists": 0,
        # one-line prompts (~10 tokens): ~200-token ones made each of the 12 launches' windows mostly prefill
        "workload.source": "free-text",
        "workload.warmup_prompts": 1, "workload.measure_prompts": MEASURED, "workload.max_new_tokens": 4,
        "engine.start_timeout_s": 300, "engine.threads": TEST_THREADS, "engine.request_timeout_s": REQUEST_TIMEOUT_S,
        "engine.extra_flags": flags, "model.drafts": {"standalone": str(out / "no-such-model")}})
    code = run_study(study, load_space(space))
    tracker = Tracker(f"sqlite:///{out / 'mlflow.db'}", study.name)
    client = tracker.client()
    runs = [r for r in client.search_runs([tracker.experiment_id()], max_results=100,
                                          order_by=["attributes.start_time ASC"])
            if r.data.tags.get("specdec.kind") == "trial"]
    return study, out, code, client, runs


def artifact_text(client, run, path: str) -> str:
    return Path(client.download_artifacts(run.info.run_id, path)).read_text(errors="replace")


def by_drafts(runs, drafts: int, min_breadth: int = 1):
    return [r for r in runs if r.data.params.get("spec.algorithm") == "ngram"
            and r.data.params.get("spec.num_draft_tokens") == str(drafts)
            and r.data.params.get("spec.min_bfs_breadth") == str(min_breadth)]


def test_the_study_goes_on_past_every_fault_to_its_decision(fault_study):
    study, out, code, client, runs = fault_study
    assert code == 0  # no faulty trial ends the study
    assert [r.data.params.get("spec.algorithm") for r in runs][0] == "none"
    assert runs[0].data.tags["outcome"] == "COMPLETE", runs[0].data.tags.get("reason")
    assert "TEST FAULT" not in artifact_text(client, runs[0], "engine.log")  # no scope matches the baseline
    trials = optuna.load_study(study_name=study.name, storage=f"sqlite:///{out / 'optuna.db'}").get_trials()
    assert len(trials) == 14 and all(t.state.is_finished() for t in trials)
    study_run = client.search_runs([runs[0].info.experiment_id], "tags.`specdec.kind` = 'study'")[0]
    assert study_run.info.status == "FINISHED" and study_run.data.tags.get("decision") == "keep_baseline"


@pytest.mark.parametrize("drafts", list(FAULTS))
def test_each_fault_is_recorded_with_its_outcome_reason_and_engine_log(fault_study, drafts):
    _, _, _, client, runs = fault_study
    fault, outcome, reason_text, log_text = FAULTS[drafts]
    (run,) = by_drafts(runs, drafts)
    tags = run.data.tags
    assert tags["outcome"] == outcome, f"{tags.get('outcome')}: {tags.get('reason')}"
    assert reason_text in tags["reason"], tags["reason"]
    engine_log = artifact_text(client, run, "engine.log")
    assert log_text in engine_log, engine_log[-3000:]
    assert "--test-fault" in engine_log  # the engine's command line opens its log


def test_a_breadth_rule_violation_is_invalid_and_never_deployed(fault_study):
    _, _, _, _, runs = fault_study
    invalid = [r for drafts in FAULTS for r in by_drafts(runs, drafts, min_breadth=2)]
    assert len(invalid) == len(FAULTS)
    for run in invalid:
        assert run.data.tags["outcome"] == "INVALID"
        assert "min_bfs_breadth <= max_bfs_breadth" in run.data.tags["reason"]
        assert "time_deploy_s" not in run.data.metrics  # never deployed


def test_a_missing_draft_model_fails_the_launch_naming_it(fault_study):
    _, _, _, _, runs = fault_study
    (run,) = [r for r in runs if r.data.params.get("spec.algorithm") == "standalone"]
    assert run.data.tags["outcome"] == "LAUNCH_FAILED" and "no-such-model" in run.data.tags["reason"]


def test_wrong_tokens_diverge_at_the_first_token(fault_study):
    _, _, _, client, runs = fault_study
    (run,) = by_drafts(runs, 4)
    report = json.loads(artifact_text(client, run, "equivalence.json"))
    assert report["identical_share"] == 0.0 and set(report["first_divergence"].values()) == {0}


def test_a_config_that_cannot_beat_the_baseline_is_pruned_in_optuna_and_mlflow(fault_study, tmp_path):
    import pyarrow.parquet as pq

    study, out, _, client, runs = fault_study
    (slow,) = by_drafts(runs, 6)
    tags, metrics = slow.data.tags, slow.data.metrics
    assert runs[0].data.tags["early_stopping"] == "not applied: the baseline is never stopped"
    assert tags["early_stopping"].startswith("on (alpha 0.001, sigma 0.05, baseline ")
    stopped_after = int(metrics["stop_requests"])
    assert 2 <= stopped_after < MEASURED
    assert f"stopped after {stopped_after} of {MEASURED} measured requests" in tags["reason"]
    assert metrics["stop_statistical_high_tok_s"] < metrics["stop_baseline_low_tok_s"]
    assert metrics["stop_baseline_low_tok_s"] < runs[0].data.metrics["tput_tok_s"]
    # recorded like any trial: the requests it measured
    path = client.download_artifacts(slow.info.run_id, "requests.parquet", str(tmp_path))
    measured = [r for r in to_records(pq.read_table(path)) if r.phase == "measure"]
    assert len(measured) == stopped_after and all(r.ok for r in measured)
    assert metrics["n_requests"] == stopped_after and metrics["tput_tok_s"] < metrics["stop_baseline_low_tok_s"]
    trials = optuna.load_study(study_name=study.name, storage=f"sqlite:///{out / 'optuna.db'}").get_trials()
    (pruned,) = [t for t in trials if t.params.get("ngram.num_draft_tokens") == 6
                 and t.params.get("ngram.min_bfs_breadth") == 1]
    assert pruned.state.name == "PRUNED" and pruned.value == pytest.approx(metrics["tput_tok_s"])


def test_a_disturbed_window_is_measured_again_and_flagged(fault_study):
    _, _, _, client, runs = fault_study
    (run,) = by_drafts(runs, 7)
    tags, metrics = run.data.tags, run.data.metrics
    windows = json.loads(artifact_text(client, run, "windows.json"))
    first, *_, recorded = windows
    assert first["disturbed"] is True and "waited for a core" in first["reasons"][0]
    # measured again once the flush stopped the neighbours (more than once only if the machine itself was busy then)
    assert len(windows) >= 2 and metrics["window_remeasured"] == len(windows) - 1
    assert recorded["wait_share"] < first["wait_share"]
    assert tags["measurement_flag"] in ("re-measured", "disturbed"), tags.get("measurement_window")
    assert metrics["window_wait_share"] == pytest.approx(recorded["wait_share"])
    assert "TEST FAULT busy-neighbours: stopped at /flush_cache" in artifact_text(client, run, "engine.log")
