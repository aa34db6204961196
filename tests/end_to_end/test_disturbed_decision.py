"""One study, run as a user runs it (`python -m pipeline.tune`: real CPU engine, local Ray, MLflow and Optuna on
SQLite), whose every measured window is disturbed and whose decision is forced to PROMOTE:
- disturbed: the CPU engine's `--test-fault busy-neighbours=1` starts busy processes pinned to the engine's own CPUs
  at its first measured request (the one after the single warm-up request) until the next flush, in every fresh
  engine, and `workload.remeasure: 0` keeps that window: every run the decision rests on is flagged `disturbed`.
  Every engine runs on CPU 0 alone (`engine.cpus`), so one busy process (one per CPU the engine may use) takes its
  core from it: on a 2-core CI machine the other test worker keeps the other core (with the engine free to run
  anywhere, two busy processes took both cores through each of the 8 disturbed windows);
- promoted: the baseline engine runs 3x slower (`slow-steps=3@baseline`), so any lossless NGRAM config beats it
  (beside busy neighbours and another study on 2 cores, NGRAM measured 5.3x a 4x-slowed baseline).
What is checked: the headline, the report, the MLflow study run and the registered version say the decision is
provisional; the promoted config's speed-up is the same figure in the headline, the console's trials table, the
report's trials table and MLflow's `vs_baseline`; the engine script is executable."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.records.tracking import VS_BASELINE_SEARCH, Tracker
from tests.conftest import TINY_SPACE
from tests.integration.conftest import TEST_THREADS

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
REPO = Path(__file__).resolve().parents[2]
NAME = "it-disturbed"
RULE = "\n" + "=" * 100 + "\n"  # the line above the headline (pipeline/study/finalize.py)
STUDY = {"name": NAME, "budget": {"max_trials": 2, "early_stopping": False},
         "workload": {"source": "free-text", "warmup_prompts": 1, "measure_prompts": 3, "max_new_tokens": 6,
                      "remeasure": 0},
         "promotion": {"finalists": 1, "runs": 3, "spread_reruns": 0},
         "engine": {"start_timeout_s": 300, "threads": TEST_THREADS, "cpus": [0],
                    "extra_flags": ["--verify-probe-seconds", "0", "--test-fault", "busy-neighbours=1",
                                    "--test-fault", "slow-steps=3@baseline"]}}


@pytest.fixture(scope="module")
def disturbed_study(tmp_path_factory):
    """(output folder, the study's stdout) after `python -m pipeline.tune` ran it to its decision."""
    tmp = tmp_path_factory.mktemp("disturbed")
    space = tmp / "space.yaml"
    space.write_text(TINY_SPACE)
    study_file = tmp / "study.yaml"
    study_file.write_text(yaml.safe_dump({**STUDY, "search_space": str(space), "output_dir": str(tmp / "out")}))
    done = subprocess.run([sys.executable, "-m", "pipeline.tune", "--study", str(study_file)], cwd=REPO,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=1800)
    (tmp / "tune.log").write_text(done.stdout + done.stderr)  # kept with the test's folder for a failure's reader
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return tmp / "out", done.stdout


def study_runs(out: Path):
    tracker = Tracker(f"sqlite:///{out / 'mlflow.db'}", NAME)
    runs = tracker.client().search_runs([tracker.experiment_id()], max_results=1000)
    return tracker, runs


def test_a_decision_on_disturbed_runs_only_says_it_is_provisional_everywhere(disturbed_study):
    out, stdout = disturbed_study
    tracker, runs = study_runs(out)
    finalist_runs = [r for r in runs if r.data.tags.get("specdec.kind") == "finalist"]
    assert len(finalist_runs) == 6 and {r.data.tags["measurement_flag"] for r in finalist_runs} == {"disturbed"}
    head = stdout.split(RULE + "decision: ", 1)[1].splitlines()
    assert head[0].startswith("PROMOTE (PROVISIONAL) -- serve "), head
    assert head[1].startswith("  Caveat: provisional: all 6 re-runs this decision rests on were measured while "
                              "other work held the CPU"), head
    assert (out / "report" / "report.html").exists(), stdout[-3000:]
    report = (out / "report" / "report.html").read_text()
    assert "id='caveat'" in report and "PROVISIONAL" in report and "all 6 re-runs" in report
    (parent,) = [r for r in runs if r.data.tags.get("specdec.kind") == "study"]
    assert parent.data.tags["measurement"] == "disturbed"
    assert parent.data.metrics["disturbed_runs"] == parent.data.metrics["deciding_runs"] == 6
    assert parent.data.tags["mlflow.note.content"].startswith("**Decision (PROMOTE (PROVISIONAL)):**")
    version = tracker.client().get_model_version(f"specdec-{NAME}", parent.data.tags["registered_version"])
    assert version.tags["measurement"] == "disturbed" and version.tags["engine"].startswith("cpu ")
    assert "CPUs" in version.tags["hardware"]
    promoted = yaml.safe_load((out / "promoted.yaml").read_text())
    assert promoted["provenance"]["measurement"] == "disturbed"


def test_the_promoted_config_has_one_speed_up_in_the_headline_console_report_and_mlflow(disturbed_study):
    out, stdout = disturbed_study
    tracker, runs = study_runs(out)
    (parent,) = [r for r in runs if r.data.tags.get("specdec.kind") == "study"]
    promoted = yaml.safe_load((out / "promoted.yaml").read_text())["provenance"]["trial_run_id"]
    trial = next(r for r in runs if r.info.run_id == promoted)
    name = trial.info.run_name
    level = next(line for line in stdout.split(RULE + "decision: ", 1)[1].splitlines() if "1 in flight:" in line)
    assert f"'{name}'" in level, level
    found = re.search(r"= (\d+\.\d\d)x", level)  # `... vs the baseline's 4.1 = 3.02x (runs ...)`
    assert found is not None, level
    headline = found.group(1)

    before = stdout.split(RULE + "decision: ", 1)[0]
    table = before.rsplit("\nconfig ", 1)[1]  # the trials table, printed once the re-runs are in
    row = next(line for line in table.splitlines() if line.startswith(name + " "))
    assert f" {headline}x " in row and "re-measured (search " in row, row
    report = (out / "report" / "report.html").read_text()
    trials = report.split("<table id='trials-table'>", 1)[1].split("</table>", 1)[0]
    cells = next(r for r in trials.split("<tr>") if f"<td class='config'>{name}</td>" in r)
    assert f"<td class='num'>{headline}x</td>" in cells and "search " in cells
    metrics = tracker.client().get_run(promoted).data.metrics
    assert f"{metrics['vs_baseline']:.2f}" == headline
    assert VS_BASELINE_SEARCH in metrics  # the search's own figure, beside it
    assert float(version_speedup(tracker, parent)) == pytest.approx(float(headline), abs=0.006)
    command = out / "deploy" / "engine_command.sh"
    assert stat.S_IMODE(command.stat().st_mode) == 0o755


def version_speedup(tracker: Tracker, parent) -> str:
    version = tracker.client().get_model_version(f"specdec-{NAME}", parent.data.tags["registered_version"])
    return version.tags["measured.speedup"]
