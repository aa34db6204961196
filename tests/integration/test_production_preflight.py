"""`python -m serve.production` with a misspelled `--registered-model`, `--alias` or `--version` (issue #63 item 9):
one line naming the value and what the registry holds, exit 2, before Ray starts (it started Ray and Serve, then
died with a traceback). A real MLflow registry on SQLite with one model and its `production` alias.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from serve.production.preflight import start_problem
from serve.production.settings import ProductionSettings

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> str:
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('registry') / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    client.create_registered_model("specdec-default")
    version = client.create_model_version("specdec-default", source="file:///nowhere", run_id=None)
    client.set_registered_model_alias("specdec-default", "production", version.version)
    return uri


@pytest.mark.parametrize(("flags", "named"), [
    (["--registered-model", "specdec-defualt"], ["'specdec-defualt'", "registered models: specdec-default"]),
    (["--registered-model", "specdec-default", "--alias", "prodution"],
     ["--alias 'prodution'", "aliases: production (version 1)"]),
    (["--registered-model", "specdec-default", "--version", "7"], ["--version '7'", "no such version"]),
])
def test_a_misspelled_registry_name_is_one_line_before_ray_starts(registry, flags, named):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "serve.production", *flags, "--tracking-uri", registry], cwd=REPO,
                          env=env, text=True, capture_output=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and all(text in lines[0] for text in named), done.stdout
    assert "Traceback" not in done.stderr and "ray" not in done.stderr.lower(), done.stderr


def test_the_right_names_pass(registry):
    assert start_problem(ProductionSettings(registered_model="specdec-default", tracking_uri=registry), None) is None
