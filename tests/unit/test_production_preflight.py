"""`python -m serve.production` refuses what cannot work before it starts Ray (issue #63 item 9): a SQLite path
that does not exist (MLflow would create an empty mlflow.db there), a tracking server or Ray address where nothing
answers (263 s of MLflow's retries before), a config file that is not there. One line naming the value, exit 2.
The registry names (model, alias, version) against a real registry: tests/integration/test_production_preflight.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from serve.ports import free_port
from serve.production.preflight import ray_address_problem, sqlite_path, tracking_problem

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "serve.production", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=120)


def test_sqlite_paths():
    assert sqlite_path("sqlite:////abs/mlflow.db") == Path("/abs/mlflow.db")
    assert sqlite_path("sqlite:///runs/x/mlflow.db") == Path("runs/x/mlflow.db")
    assert sqlite_path("sqlite://") is None and sqlite_path("http://h:5000") is None


def test_a_missing_sqlite_file_is_refused_and_not_created(tmp_path):
    missing = tmp_path / "runs" / "defualt" / "mlflow.db"
    missing.parent.mkdir(parents=True)
    done = run_cli("--registered-model", "specdec-default", "--tracking-uri", f"sqlite:///{missing}", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and str(missing) in lines[0] and "no MLflow database" in lines[0], done.stdout
    assert not missing.exists() and list(tmp_path.rglob("*.db")) == []
    assert "Traceback" not in done.stderr, done.stderr


def test_a_dead_tracking_server_is_one_line_not_minutes_of_retries(tmp_path):
    port = free_port()  # nothing listens there
    done = run_cli("--registered-model", "m", "--tracking-uri", f"http://127.0.0.1:{port}", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and f"http://127.0.0.1:{port}" in lines[0] and "no tracking server" in lines[0], done


def test_the_checks_name_the_value_and_the_fix(tmp_path):
    port = free_port()
    assert "start the MLflow server" in (tracking_problem(f"http://127.0.0.1:{port}", timeout_s=5) or "")
    assert "ray start --head" in (ray_address_problem(f"127.0.0.1:{port}", timeout_s=5) or "")
    assert "expected host:port" in (ray_address_problem("nohost") or "")
    assert ray_address_problem("auto") is None
    done = run_cli("--config-file", str(tmp_path / "serving.json"), cwd=tmp_path)
    assert done.returncode == 2 and "--config-file" in done.stdout and "no such file" in done.stdout, done
