"""Shared fixtures. `finished_study` runs one small real study (local Ray, CPU engine with the smallest model, MLflow
and Optuna on SQLite) once per test session; tests that only read its results share it.

Every run ends with the skipped tests grouped by reason (`pytest_terminal_summary`): a skip's reason says what is
missing and the command that installs it, so a run on a new machine says which groups did not run and how to run them.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason a skipped report carries (pytest keeps it as (path, line, "Skipped: reason"))."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ").strip()


@pytest.hookimpl(trylast=True)  # after the slowest-tests list: the groups close the run's output
def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if r.skipped]
    if not skipped:
        return
    groups: dict[str, list[str]] = defaultdict(list)
    for report in skipped:
        groups[skip_reason(report)].append(report.nodeid.split("::")[0])
    terminalreporter.write_sep("=", f"{len(skipped)} skipped, in {len(groups)} group(s): why, and how to run them")
    for reason, files in sorted(groups.items(), key=lambda item: (-len(item[1]), item[0])):
        terminalreporter.write_line(f"{len(files):5d}  {reason}")
        terminalreporter.write_line(f"       ({', '.join(sorted(set(files)))})")

# Search only (promotion.finalists 0): the promotion's re-runs (2 x promotion.runs fresh replicas) cost twice the
# search of a 3-trial study, and the tests using it check the search, the records and the resume, not the
# promotion rule. Tests of the promotion path ask for finalists explicitly (test_open_loop_study,
# test_llama_cpp_study, test_levels_study, test_distributed).
TINY_STUDY = {"workload.warmup_prompts": 2, "workload.measure_prompts": 2, "workload.max_new_tokens": 12,
              "promotion.finalists": 0, "engine.start_timeout_s": 300,
              "search.strategy": "tpe"}  # these studies test the search over launches (simulate-first: test_simulate*)
TINY_SPACE = ("algorithms: [none, ngram]\ncommon:\n  warmup_requests: {type: fixed, value: 1}\n"
              "branches:\n  ngram:\n    num_draft_tokens: {type: int, low: 2, high: 4}\n"
              "    max_bfs_breadth: {type: int, low: 1, high: 2}\n"
              "    capacity: {type: fixed, value: 100000}\n")


# What `pipeline.tune.quiet_libraries` sets for a command-line run. A test that calls `main` in-process must not leave
# them behind: RAY_AUTH_MODE=token left in a worker's environment makes the next local Ray's GCS demand a token its
# driver (which read the mode once, at its first ray.init) never sends.
CLI_ENVIRONMENT = ("RAY_AUTH_MODE", "RAY_AIR_NEW_OUTPUT", "TUNE_DISABLE_AUTO_CALLBACK_LOGGERS",
                   "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR")


@pytest.fixture(autouse=True)
def cli_environment_restored():
    saved = {key: os.environ.get(key) for key in CLI_ENVIRONMENT}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def finished_study(tmp_path_factory):
    """(StudyConfig, output folder, exit code) of a 3-trial search-only study (no re-runs) that ran to its
    keep-baseline decision, the baseline registered as production."""
    from pipeline.config import load_study
    from pipeline.search.space import load_space
    from pipeline.study.driver import run_study

    out: Path = tmp_path_factory.mktemp("finished-study")
    space = out / "space.yaml"
    space.write_text(TINY_SPACE)
    study = load_study(None, {**TINY_STUDY, "name": "it-happy", "output_dir": str(out), "search_space": str(space),
                              "budget.max_trials": 3})
    code = run_study(study, load_space(space))
    return study, out, code


@pytest.fixture
def one_thread():
    """torch on 1 thread for the test (tiny matmuls: OpenMP sync costs more than it saves on a shared CPU)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
