"""The suite's file order under `-n 2 --dist loadfile` (tests/conftest.py): tiers in order, and within one the
longest files first by their recorded worker-seconds (tests/durations.json), so that what xdist hands out last is
short; `--record-durations` refreshes the record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import DURATIONS, recorded_durations, run_order

REPO = Path(__file__).resolve().parents[2]


def test_each_tier_runs_longest_first_and_a_file_without_a_figure_leads_its_tier():
    seconds = {"unit/a.py": 1.0, "unit/b.py": 3.0, "it/x.py": 5.0, "it/slow.py": 90.0, "it/y.py": 5.0}
    tiers = [["unit/a.py", "unit/b.py"], ["it/x.py", "it/slow.py", "it/new.py", "it/y.py"], []]
    assert run_order(tiers, seconds) == ["unit/b.py", "unit/a.py", "it/new.py", "it/slow.py", "it/x.py", "it/y.py"]


def test_the_record_names_test_files_that_exist():
    recorded = recorded_durations()
    assert len(recorded) > 100 and all((REPO / name).is_file() for name in recorded), DURATIONS
    assert recorded_durations(DURATIONS.with_name("no-such-file.json")) == {}


def test_a_run_records_its_files_and_keeps_other_existing_files_figures(tmp_path):
    out = tmp_path / "durations.json"
    out.write_text(json.dumps({"tests/unit/test_atomic.py": 999.0, "tests/unit/test_run_order.py": 7.0,
                               "tests/unit/test_gone.py": 5.0}))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           "tests/unit/test_atomic.py", "--record-durations", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:]
    recorded = json.loads(out.read_text())
    assert set(recorded) == {"tests/unit/test_atomic.py", "tests/unit/test_run_order.py"}  # the gone file dropped
    assert recorded["tests/unit/test_atomic.py"] < 999.0 and recorded["tests/unit/test_run_order.py"] == 7.0


def test_a_run_names_the_tiers_its_paths_did_not_reach(tmp_path):
    from tests.conftest import left_out_tiers

    for tier, files in (("engines", 2), ("end_to_end", 3), ("integration", 1)):
        (tmp_path / "tests" / tier).mkdir(parents=True)
        for i in range(files):
            (tmp_path / "tests" / tier / f"test_{i}.py").write_text("")
    default = ["tests/unit", "tests/model", "tests/integration", "tests/gpu"]
    assert left_out_tiers(tmp_path, default) == {"engines": 2, "end_to_end": 3}
    assert left_out_tiers(tmp_path, ["tests"]) == {}
    assert left_out_tiers(tmp_path, [*default, "tests/engines/test_0.py::test_x"]) == {"end_to_end": 3}
