"""`specdec-tune --quiet` as a user runs it (tests/cli_run.py): the console holds the decision and where to look, and
nothing of the progress; `<output>/study.log` holds everything, the progress and the internals included, without a
progress bar. A whole (short) study, so it runs in the end-to-end tier; the levels themselves are unit-tested
(tests/unit/test_console_log.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.console_log import LOG_FILE
from tests.cli_run import tune

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
LINKS = ("report: ", "deploy files: ", "promoted config: ", "compare the trials", "  runs table: ")


def test_a_quiet_study_prints_its_decision_last_and_logs_the_rest(tmp_path: Path) -> None:
    result = tune("cpu", tmp_path, "--quiet")
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    out = result.stdout
    assert "decision: " in out, out[-3000:]
    for progress in ("[trial 1/2]", "starting the engine", "study 'cli-cpu'", "search: "):
        assert progress not in out, out[-3000:]
    lines = out.rstrip().splitlines()
    rule = max(i for i, line in enumerate(lines) if set(line) == {"="})  # the headline's closing rule
    after = lines[rule + 1:]
    assert after and all(line.startswith(LINKS) for line in after), after
    logged = (tmp_path / "out" / LOG_FILE).read_text()
    for kept in ("[trial 1/2]", "(the baseline)", "HEADLINE", "decision: "):
        assert kept in logged, logged[-3000:]
    assert "\r" not in logged
