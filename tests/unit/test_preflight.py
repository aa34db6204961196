"""A careless operator gets one line and exit 2, before Ray starts and before anything is written (issue #31 items 11
and 12): `pipeline.tune` (dry run and real run alike), `pipeline.promote --show` and `pipeline.compare`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.preflight import MAX_PROMPT_CHARS
from pipeline.tune import main as tune


def _refused(capsys, argv: list[str], needle: str, run=tune) -> str:
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    return err


def _nothing_in(folder: Path) -> bool:
    return not folder.exists() or not any(folder.iterdir())


@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "run"])
def test_an_output_that_is_a_file_is_refused(tmp_path, capsys, dry):
    taken = tmp_path / "results.txt"
    taken.write_text("keep me\n")
    _refused(capsys, ["--output", str(taken), *(["--dry-run"] if dry else [])], "is a file, not a folder")
    assert taken.read_text() == "keep me\n"


@pytest.mark.parametrize("uri, needle", [
    ("file:///tmp/mlruns", "MLflow's file store"),
    ("./mlruns", "MLflow's file store"),
    ("sqlite:////etc/hostname/studies/mlflow.db", "is a file, so"),  # no folder can be created under a file
])
def test_a_tracking_uri_the_study_cannot_use_is_refused_and_nothing_is_written(tmp_path, capsys, uri, needle):
    out = tmp_path / "study"
    _refused(capsys, ["--output", str(out), "--tracking-uri", uri], needle)  # a real run: refused before Ray
    assert _nothing_in(out), list(out.iterdir())  # no identity.json, optuna.db, study.yaml to block the retry


def test_a_storage_url_the_study_cannot_use_is_refused(tmp_path, capsys):
    _refused(capsys, ["--output", str(tmp_path / "s"), "--storage", "sqlite:////etc/hostname/optuna.db", "--dry-run"],
             "storage.url")


@pytest.mark.parametrize("dry", [True, False], ids=["dry-run", "run"])
def test_a_model_path_that_does_not_exist_is_refused(tmp_path, capsys, dry):
    missing = tmp_path / "models" / "nope.gguf"
    _refused(capsys, ["--output", str(tmp_path / "s"), "--model", str(missing), *(["--dry-run"] if dry else [])],
             "does not exist on this machine")
    assert _nothing_in(tmp_path / "s")


def _workload(tmp_path: Path, text: str | None) -> Path:
    path = tmp_path / "prompts.jsonl"
    if text is not None:
        path.write_text(text)
    return path


@pytest.mark.parametrize("text, needle", [
    (None, "does not exist"),
    ("", "contains no prompts"),
    ("this is not json\n", "not valid JSON"),
    (json.dumps({"prompt": "x" * (MAX_PROMPT_CHARS + 1)}) + "\n", "characters, more than"),
], ids=["missing", "empty", "garbage", "oversized-prompt"])
def test_a_workload_that_cannot_run_is_refused_in_a_dry_run(tmp_path, capsys, text, needle):
    _refused(capsys, ["--dry-run", "--output", str(tmp_path / "s"), "--workload", str(_workload(tmp_path, text))],
             needle)


def test_promote_show_on_a_folder_without_a_study_creates_nothing(tmp_path, capsys):
    from pipeline.promote import main as promote

    folder = tmp_path / "no-such-study"
    _refused(capsys, ["--show", "--output", str(folder)], "nothing was created", run=promote)
    assert not folder.exists()


def test_compare_of_a_study_name_the_store_does_not_hold_fails_and_creates_nothing(tmp_path, capsys):
    from mlflow.tracking import MlflowClient

    from pipeline.compare import main as compare

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).create_experiment("real-study")
    capsys.readouterr()  # MLflow's own lines about creating the database
    _refused(capsys, ["--name", "nosuchstudy", "--tracking-uri", uri], "no study named 'nosuchstudy'", run=compare)
    names = [e.name for e in MlflowClient(tracking_uri=uri).search_experiments()]
    assert "nosuchstudy" not in names


def test_a_writable_default_study_passes(tmp_path, capsys):
    cwd = os.getcwd()
    os.chdir(tmp_path)  # the default output, ./runs/default, does not exist yet: it can be created
    try:
        assert tune(["--dry-run", "--samples", "1"]) == 0
    finally:
        os.chdir(cwd)
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
