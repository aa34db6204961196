"""`python -m pipeline.tune` from a shell on the CPU engine, to its decision (tests/cli_run.py): the process sets its
own Ray auth mode whatever it imported first, and a new local Ray accepts its own driver."""

from __future__ import annotations

import pytest

from tests.cli_run import check_decided, tune

pytestmark = pytest.mark.integration


def test_the_command_line_runs_a_cpu_study_to_its_decision(tmp_path):
    check_decided(tune("cpu", tmp_path, "--set", "engine.extra_flags=[--verify-probe-seconds, '0']"))
