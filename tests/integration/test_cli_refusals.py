"""Issue #63 items 3, 4, 5 and 9 from a shell: `python -m pipeline.tune` refuses a dead service, a bad seed, a
second driver and a resume with nothing to continue with one line on stderr, a non-zero exit, well inside a minute
(the subprocess's own deadline), and without leaving a folder that would refuse the corrected command."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.study.lock import acquire
from pipeline.study.resume import IDENTITY_FILE, PROMOTED_FILE
from tests.cli_run import QUICK, REPO, clean_env

pytestmark = pytest.mark.integration

DEADLINE_S = 60  # the bound for a refusal; the subprocess is killed (and the test fails) past it


@pytest.fixture(scope="module")
def dead() -> str:
    """host:port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def tune(tmp_path: Path, *extra: str, output: Path | None = None) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "pipeline.tune", "--name", "refused", "--output", str(output or tmp_path / "out"),
            "--workload", "templated", *QUICK, *extra]
    return subprocess.run(args, cwd=REPO, env=clean_env(tmp_path / "home"), capture_output=True, text=True,
                          timeout=DEADLINE_S)


def refused_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("flags, names", [
    (["--ray-address", "{dead}"], ["ray.address", "'{dead}'", "ray start --head"]),
    (["--tracking-uri", "http://{dead}"], ["tracking.uri", "http://{dead}", "mlflow server"]),
    (["--storage", "postgresql+psycopg2://tuner:pw@{dead}/optuna"],
     ["storage.url", "postgresql+psycopg2://tuner:***@{dead}/optuna", "start the database"]),
    (["--storage", "postgresql://tuner:pw@{dead}/optuna"], ["storage.url", "'psycopg'", "postgresql+psycopg2://"]),
], ids=["ray", "tracking", "postgres-dead", "postgres-no-driver"])
def test_a_refusal_is_one_line_before_the_output_folder_exists(tmp_path, dead, flags, names):
    result = tune(tmp_path, *(f.format(dead=dead) for f in flags))
    line = refused_line(result)
    for name in names:
        assert name.format(dead=dead) in line, line
    assert ":pw@" not in line
    assert not (tmp_path / "out").exists()  # the corrected command is not refused with "pass --resume"


@pytest.mark.parametrize("seed", ["-1", "99999999999"])
def test_a_seed_numpy_refuses_is_refused_at_validation(tmp_path, seed):
    result = tune(tmp_path, "--seed", seed)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    # a study-file problem is the config's usual form: a header, then one line per problem naming the key
    assert f"  - seed: seed={seed} is outside 0..4294967295 (numpy's seed range)" in result.stderr
    assert not (tmp_path / "out").exists()


def test_the_dry_run_checks_the_services_too(tmp_path, dead):
    line = refused_line(tune(tmp_path, "--dry-run", "--ray-address", dead))
    assert "ray.address" in line and dead in line


def test_resume_of_nothing_is_refused(tmp_path):
    line = refused_line(tune(tmp_path, "--resume"))
    assert "nothing to resume" in line and str(tmp_path / "out") in line
    assert not (tmp_path / "out").exists()


def test_resume_of_a_finished_study_is_refused(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "study.yaml").write_text("name: refused\n")
    (out / IDENTITY_FILE).write_text(json.dumps({"identity": {}, "max_trials": 2}))
    (out / PROMOTED_FILE).write_text(yaml.safe_dump({"provenance": {"decision": "keep_baseline",
                                                                    "source": "baseline"}}))
    before = sorted(p.name for p in out.iterdir())
    line = refused_line(tune(tmp_path, "--resume"))
    assert "holds a finished study" in line and "decision keep_baseline" in line
    assert sorted(p.name for p in out.iterdir()) == before


def test_a_second_driver_is_refused_naming_the_holder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "study.yaml").write_text("name: refused\n")  # a study running in this folder
    with acquire(out):  # this process is the running driver
        before = sorted(p.name for p in out.iterdir())
        line = refused_line(tune(tmp_path, "--resume"))
        assert f"PID {os.getpid()}" in line and "kill -INT" in line
        # neither Optuna's nor MLflow's store was opened
        assert sorted(p.name for p in out.iterdir()) == before
