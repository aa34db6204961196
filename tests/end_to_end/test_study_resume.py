"""An interrupted study, resumed: Ctrl-C from a shell right after the baseline reported, then `--resume`, each the
command line as a user runs it (tests/cli_run.py: a clean environment, a HOME without ~/.ray). A whole study twice
over, so it runs in the end-to-end tier; it is also the CPU engine's check that `python -m pipeline.tune` sets up its
own Ray whatever it imported first (SGLang's and llama-server's: tests/engines/test_sglang_study.py and
test_llama_cpp_study.py)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest

from pipeline.config import load_study
from pipeline.search.space import BASELINE_ATTR
from tests.cli_run import check_decided, clean_env
from tests.conftest import TINY_STUDY as TINY
from tests.integration.test_study import child_runs, optuna_trials, write_space

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
REPO = Path(__file__).resolve().parents[2]


def test_interrupted_study_resumes_without_duplicates(tmp_path):
    # Two trials: the baseline, interrupted, and the one the resumed run measures (a third only measured once more).
    # Ctrl-C right after the baseline reported to Tune, before Optuna was told. Before the fix the driver read the
    # interrupt off fit()'s grid (which shows the stopped trial TERMINATED), failed the baseline in Optuna and
    # finalized; the resume then enqueued and measured a second baseline.
    # Both runs are the command line as a user runs it (tests/cli_run.py: a clean environment, a HOME without ~/.ray),
    # so this is also the CPU engine's check that the process sets up its own Ray whatever it imported first.
    space = write_space(tmp_path, "algorithms: [none, ngram]\nbranches:\n  ngram:\n"
                                  "    num_draft_tokens: {type: int, low: 2, high: 3}\n")
    args = [sys.executable, "-m", "pipeline.tune", "--engine", "cpu", "--name", "it-resume",
            "--output", str(tmp_path / "out"), "--search-space", space, "--trials", "2"]
    for key, value in TINY.items():
        args += ["--set", f"{key}={value}"]
    env = clean_env(tmp_path / "home")
    assert not Path(env["HOME"], ".ray").exists()
    driver = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    assert driver.stdout is not None
    for line in driver.stdout:  # interrupt as soon as the first trial has finished (Ctrl-C, as a user would)
        seen.append(line)
        if line.startswith("[trial 1/2]"):
            driver.send_signal(signal.SIGINT)
            break
    rest, _ = driver.communicate(timeout=300)
    first = next((line for line in seen if line.startswith("[trial 1/2]")), None)
    assert first is not None and "(the baseline)" in first, "".join(seen)[-3000:]
    # Where the Ctrl-C lands is the machine's timing: before Optuna heard of the baseline ("[0] unfinished"), or
    # after ("between trials", or the next trial already handed out). Every case stops the study, and resumes cleanly.
    assert driver.returncode == 130, rest[-3000:]
    assert re.search(r"interrupted (with trial\(s\) \[\d+\] unfinished|between trials); the state is saved", rest), \
        rest[-3000:]
    resumed_at_ms = time.time() * 1000
    resumed = subprocess.run(args + ["--resume"], cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    check_decided(resumed, first_line="")  # the resumed run reaches its decision
    assert "InvalidAuthToken" not in "".join(seen) + rest and "Failed to start GCS" not in "".join(seen) + rest
    trials = optuna_trials(tmp_path / "out", "it-resume")
    assert len(trials) == 2 and sorted(t.number for t in trials) == [0, 1]
    assert [t.number for t in trials if t.user_attrs.get(BASELINE_ATTR)] == [0]
    assert trials[0].state is optuna.trial.TrialState.COMPLETE  # the reported result counts, not re-measured:
    reported = float(re.findall(r" ([0-9.]+) tok/s", first)[0])
    assert trials[0].value == pytest.approx(reported, abs=0.01)  # the figure printed before Ctrl-C (2 decimals)
    study = load_study(None, {"name": "it-resume"})
    _, runs = child_runs(study, tmp_path / "out")
    trial_ids = [r.data.tags["trial_id"] for r in runs]  # run names are config labels, which trials may share
    assert len(trial_ids) == len(set(trial_ids)) == 2
    baseline_runs = [r for r in runs if r.data.params.get("spec.algorithm") == "none"]
    assert len(baseline_runs) == 1 and baseline_runs[0].info.end_time < resumed_at_ms  # logged before the resume
