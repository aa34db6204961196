"""Every entry point as a console script (`specdec-tune`, ...) with `--version` and a usage line naming the way it was
started, and `MLFLOW_TRACKING_URI` as the default tracking URI (--tracking-uri > study file > environment > the
sqlite default)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from pipeline.cli_common import program
from pipeline.config import resolve_study
from pipeline.loop.__main__ import _parser as loop_parser
from pipeline.loop.retune import _parser as retune_parser

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SCRIPTS = {"specdec-tune": "pipeline.tune", "specdec-promote": "pipeline.promote",
           "specdec-compare": "pipeline.compare", "specdec-loop": "pipeline.loop", "specdec-retune": "pipeline.retune",
           "specdec-serve": "serve.production"}


def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_console_script_prints_the_version_and_its_own_name_in_the_usage_line(script: str) -> None:
    path = BIN / script
    assert path.exists(), f"{path} is missing: pip install -e . --no-deps installs the console scripts"
    shown = run([str(path), "--version"])
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == f"{script} {version('specdec-tuner')}"
    helped = run([str(path), "--help"])
    assert helped.returncode == 0 and helped.stdout.startswith(f"usage: {script} "), helped.stdout[:300]


def test_python_m_names_the_module_in_the_usage_line() -> None:
    helped = run([sys.executable, "-m", "pipeline.tune", "--help"])
    assert helped.stdout.startswith("usage: python -m pipeline.tune "), helped.stdout[:300]
    assert "--quiet" in helped.stdout and "--verbose" in helped.stdout
    assert program("specdec-compare", "pipeline.compare", "/opt/venv/bin/specdec-compare") == "specdec-compare"
    assert program("specdec-compare", "pipeline.compare", "/src/pipeline/compare.py") == "python -m pipeline.compare"


def test_the_tracking_uri_is_the_command_line_s_then_the_study_file_s_then_the_environment_s(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    assert resolve_study(None, {}, has_gpu=lambda: False)[0].tracking.uri == "http://mlflow.internal:5000"
    cli = resolve_study(None, {"tracking.uri": "sqlite:///cli.db"}, has_gpu=lambda: False)[0]
    assert cli.tracking.uri == "sqlite:///cli.db"
    study_file = tmp_path / "study.yaml"
    study_file.write_text("tracking:\n  uri: sqlite:///file.db\n")
    assert resolve_study(study_file, {}, has_gpu=lambda: False)[0].tracking.uri == "sqlite:///file.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", " ")  # blank: as if unset, the sqlite default under the output folder
    assert resolve_study(None, {}, has_gpu=lambda: False)[0].tracking.uri is None


def test_the_loop_and_retune_take_their_tracking_uri_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    assert loop_parser().parse_args(["--endpoint", "http://e"]).tracking_uri == "http://mlflow.internal:5000"
    assert retune_parser().parse_args([]).tracking_uri == "http://mlflow.internal:5000"
    assert retune_parser().parse_args(["--tracking-uri", "sqlite:///x.db"]).tracking_uri == "sqlite:///x.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    with pytest.raises(SystemExit):  # neither given: still required, and argparse says so
        retune_parser().parse_args([])


def test_the_serve_command_keeps_version_n_for_a_registered_version() -> None:
    from serve.production.cli import PRINT_VERSION, _parser as serve_parser

    assert serve_parser().parse_args(["--version", "7"]).version == "7"
    assert serve_parser().parse_args(["--version"]).version is PRINT_VERSION
