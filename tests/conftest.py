"""Shared fixtures. `finished_study` runs one small real study (local Ray, CPU engine with the smallest model, MLflow
and Optuna on SQLite) once per test run, shared by the xdist workers; tests that only read its results share it.

Every run ends with the tiers it left out (`TIERS`: a file's tier is its folder) and the skipped tests grouped by reason (`pytest_terminal_summary`): a skip's reason says what is
missing and the command that installs it, so a run on a new machine says which groups did not run and how to run them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason a skipped report carries (pytest keeps it as (path, line, "Skipped: reason"))."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ").strip()


# The tiers, fastest first: a file's tier is its folder. The default run (pyproject's testpaths) is unit, model,
# integration and gpu; `python -m pytest -q -n 2 --dist loadfile tests` adds the engines and end-to-end tiers.
TIERS = ("unit", "model", "integration", "engines", "end_to_end", "gpu")
LEFT_OUT = {"engines": "SGLang's own server on a CPU, llama-server and vLLM (where its venv is installed): contract, "
                       "studies, production",
            "end_to_end": "the closed loop and the endpoint's side of it, levels, distributed (PostgreSQL), "
                          "2-node cluster, serve deploy, the production driver and rolls, the fault study, "
                          "open-loop, corpus and STANDALONE simulate-first studies, an interrupted study resumed, "
                          "a study beside an endpoint, a baseline queued again, re-runs that disagree, the endpoint's "
                          "engine killed and paused, the MLflow UI in a browser"}
EVERY_TIER = "python -m pytest -q -n 2 --dist loadfile tests"


def left_out_tiers(rootpath: Path, args: list[str]) -> dict[str, int]:
    """Tiers of `LEFT_OUT` none of whose files the run's `args` (paths, maybe with ::test ids) reached, with their
    test-file counts. Pure apart from listing the folders."""
    reached = [Path(rootpath, a.split("::")[0]).resolve() for a in args]
    out = {}
    for tier in LEFT_OUT:
        folder = (rootpath / "tests" / tier).resolve()
        if not any(r == folder or folder in r.parents or r in folder.parents for r in reached):
            out[tier] = len(list(folder.glob("test_*.py")))
    return out


@pytest.hookimpl(trylast=True)  # after the slowest-tests list: the groups close the run's output
def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    # the default run (no paths given: pyproject's testpaths) names the tiers it left out; a run of chosen files does not
    default_run = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    missing = left_out_tiers(config.rootpath, list(config.args)) if default_run else {}
    if missing:
        terminalreporter.write_sep("=", f"{len(missing)} tier(s) not in this run: every tier runs with {EVERY_TIER}")
        for tier, count in missing.items():
            terminalreporter.write_line(f"{count:5d} files  tests/{tier}: {LEFT_OUT[tier]}")
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

# Each test file's worker-seconds (set-up, call and teardown summed) in a run of every tier: the file order's input.
# Refreshed by a run with `--record-durations tests/durations.json` (docs/benchmarks.md, CI section).
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser) -> None:
    parser.addoption("--record-durations", metavar="PATH", default=None,
                     help="write each test file's worker-seconds in this run to PATH (JSON, merged into what PATH "
                          "holds for files that still exist): tests/durations.json orders the files")


def recorded_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def run_order(tiers: list[list[str]], seconds: dict[str, float]) -> list[str]:
    """File order: tier after tier; within a tier, longest first by `seconds` (a file without a figure first: a new
    file may be long), ties in collected order.

    `-n 2 --dist loadfile` hands each worker the next file once it has 2 or fewer tests left, so every worker holds
    one file ahead: with the longest first, what is handed out last is short, and the two workers end close together
    (a file order kept by hand left them 88 s apart). Pure."""
    unknown = float("inf")
    return [name for files in tiers for name in sorted(files, key=lambda f: -seconds.get(f, unknown))]


# Run-wide fixtures (`run_wide`: filled once per run by the first worker to ask, the other worker waiting on its lock)
# and the worker-seconds of other files to hand out after their first user before a second user may start: the fill's
# own time on each of the two workers. `finished_study` takes 50-60 s beside another file; without this, the longest-
# first order can hand two of its users out together, and the second waits out the fill idle (in the 654 s
# default-tier run test_report_browser filled it in 53.7 s of set-up while test_mlflow_ui's set-up took 23.3 s).
RUN_WIDE_FILL_S = {"finished_study": 120.0}


def after_run_wide_fills(order: list[str], users: dict[str, set[str]], seconds: dict[str, float],
                         tier_of: dict[str, int]) -> list[str]:
    """`order` with each run-wide fixture's users (`users`: fixture -> files) but its first moved back, within their
    tier, to after the files that follow the first user and sum to `RUN_WIDE_FILL_S` recorded seconds (a file without
    a figure counts 0); the order is otherwise kept. Pure."""
    order = list(order)
    for fixture, wait_s in RUN_WIDE_FILL_S.items():
        using = [name for name in order if name in users.get(fixture, set())]
        if len(using) < 2:
            continue
        first = order.index(using[0])
        tier, waited, at = tier_of[using[0]], 0.0, first
        while at + 1 < len(order) and tier_of[order[at + 1]] == tier and waited < wait_s:
            at += 1
            if order[at] not in using:
                waited += seconds.get(order[at], 0.0)
        window = order[first + 1:at + 1]
        early = [name for name in window if name in using]
        anchor = next((name for name in reversed(window) if name not in using), using[0])
        rest = [name for name in order if name not in early]
        place = rest.index(anchor) + 1
        order = rest[:place] + early + rest[place:]
    return order


def pytest_collection_modifyitems(config, items) -> None:
    """Tiers in `TIERS` order (a broken unit shows within minutes), the files of each in `run_order`, then the users
    of a run-wide fixture spaced out (`after_run_wide_fills`); the tests of a file keep their collected order (the
    sort is stable)."""
    roots = [(Path(config.rootpath, "tests", tier)).resolve() for tier in TIERS]
    tiers: list[list[str]] = [[] for _ in range(len(roots) + 1)]
    users: dict[str, set[str]] = defaultdict(set)
    for item in items:
        folder, name = item.path.resolve().parent, relative(config.rootpath, item.path)
        tier = next((i for i, root in enumerate(roots) if folder == root or root in folder.parents), len(roots))
        if name not in tiers[tier]:
            tiers[tier].append(name)
        for fixture in RUN_WIDE_FILL_S.keys() & set(getattr(item, "fixturenames", ())):
            users[fixture].add(name)
    seconds = recorded_durations()
    tier_of = {name: i for i, files in enumerate(tiers) for name in files}
    order = after_run_wide_fills(run_order(tiers, seconds), users, seconds, tier_of)
    rank = {name: i for i, name in enumerate(order)}
    items.sort(key=lambda item: rank[relative(config.rootpath, item.path)])


def relative(root: Path, path: Path) -> str:
    """A test file's name as `tests/durations.json` keys it (its path from the repository root)."""
    try:
        return Path(path).resolve().relative_to(Path(root).resolve()).as_posix()
    except ValueError:
        return str(path)


SPENT: dict[str, float] = defaultdict(float)  # this run's worker-seconds per file (`--record-durations`)


def pytest_runtest_logreport(report) -> None:
    # on the xdist controller too: workers' reports are replayed there, so the controller sees every file
    SPENT[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session) -> None:
    path = session.config.getoption("record_durations")
    if not path or hasattr(session.config, "workerinput"):  # written once, by the controller (or a run without xdist)
        return
    root = session.config.rootpath
    merged = {name: s for name, s in recorded_durations(Path(path)).items() if (root / name).exists()}
    merged.update({name: round(s, 1) for name, s in SPENT.items()})
    Path(path).write_text(json.dumps(dict(sorted(merged.items())), indent=0) + "\n")


# Search only (promotion.finalists 0): the promotion's re-runs (2 x promotion.runs fresh replicas) cost twice the
# search of a 3-trial study, and the tests using it check the search, the records and the resume, not the
# promotion rule. Tests of the promotion path ask for finalists explicitly (test_open_loop_study,
# test_llama_cpp_study, test_levels_study, test_distributed).
# workload.remeasure 0 and promotion.spread_reruns 0: two test workers share 2 cores, so most windows are disturbed
# and re-runs disagree; measuring them again would only lengthen these studies (each measured again for real:
# tests/end_to_end/test_fault_study.py, tests/end_to_end/test_run_spread.py).
TINY_STUDY: dict[str, Any] = {"workload.warmup_prompts": 2, "workload.measure_prompts": 2,
                              "workload.max_new_tokens": 12, "promotion.finalists": 0,
                              "engine.start_timeout_s": 300, "workload.remeasure": 0, "promotion.spread_reruns": 0,
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


@pytest.fixture(autouse=True)
def stop_signals_restored():
    """SIGINT's and SIGTERM's handlers as they were: a test that runs a driver's stop path in-process (which ignores
    both while it drains) left the worker ignoring SIGINT, and every process a later test started inherited that
    (`python -m serve.production`'s follow test then never saw its Ctrl-C)."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        if handler is not None and signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


APPS_LEFT = "serve-apps-left.json"  # finished_study: its trial apps Serve still ran right after it


@contextlib.contextmanager
def run_wide(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """A folder `name` shared by every xdist worker of this run, held under an exclusive lock while the caller is
    inside: the first worker to get here fills it, the others wait for it and find it filled. Without xdist, a folder
    of this session's own."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # pytest-N/popen-gwK: pytest-N is the run's
    folder = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        folder.mkdir(exist_ok=True)
        yield folder


@pytest.fixture(scope="session")
def finished_study(tmp_path_factory):
    """(StudyConfig, output folder, exit code) of a 3-trial search-only study (no re-runs) that ran to its
    keep-baseline decision, the baseline registered as production. Run once per test run: its readers (the study,
    resume and MLflow UI tests) may sit on different workers, and they only read it. The study's Serve apps still
    running right after it are written to `APPS_LEFT` there, by the process that ran it (another worker's Ray is a
    different cluster, where none would ever be found)."""
    from ray import serve

    from pipeline.config import load_study
    from pipeline.search.space import load_space
    from pipeline.study.driver import run_study
    from pipeline.trial.replicas import study_apps

    with run_wide(tmp_path_factory, "finished-study") as out:
        space = out / "space.yaml"
        space.write_text(TINY_SPACE)
        study = load_study(None, {**TINY_STUDY, "name": "it-happy", "output_dir": str(out),
                                  "search_space": str(space), "budget.max_trials": 3})
        done = out / "exit-code.txt"
        if not done.exists():
            code = run_study(study, load_space(space))
            (out / APPS_LEFT).write_text(json.dumps(sorted(study_apps(study.name, serve.status().applications))))
            done.write_text(str(code))
        return study, out, int(done.read_text())


@pytest.fixture
def one_thread():
    """torch on 1 thread for the test (tiny matmuls: OpenMP sync costs more than it saves on a shared CPU)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
