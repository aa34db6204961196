"""Helpers for the MLflow UI browser test: read the study's runs from the store, run `mlflow ui` as a real process,
and drive the MLflow 3.17.2 web app (React + ag-grid) with Playwright.

The selectors below are the app's own test ids, ag-grid's `row-id` (= MLflow run id) and `col-id` (= `metrics.`<key>``)
attributes, and visible text; none depends on layout or timing. The app polls the server, so the page never goes
network-idle: every step waits for a specific element instead.
"""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import sys
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import pytest

from serve.ports import free_port
from tests.integration.servers import ServerProcess, http_server

CHROMIUM = Path("/usr/bin/chromium")
# No network on CI boxes: keep Chromium from trying to reach Google services in the background.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
REPO = Path(__file__).resolve().parents[2]


def browser_api(module_level: bool = True) -> Any:
    """playwright.sync_api, or a skip naming what is missing and how to install it (Chromium from Debian, the
    playwright package from PyPI; `.ci/run` installs both)."""
    if not CHROMIUM.exists():
        pytest.skip(f"needs Debian's chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=module_level)
    return pytest.importorskip("playwright.sync_api",
                               reason="needs the playwright Python package (pip install playwright)")
ARTIFACTS_ENV = "SPECDEC_TEST_ARTIFACTS"


def artifact_dir(test_name: str) -> Path:
    """Where screenshots go: `$SPECDEC_TEST_ARTIFACTS/<test>` if set, else `<repo>/test-artifacts/<test>`."""
    root = Path(os.environ[ARTIFACTS_ENV]) if os.environ.get(ARTIFACTS_ENV) else REPO / "test-artifacts"
    path = root / test_name
    path.mkdir(parents=True, exist_ok=True)
    return path


# --- the store -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrialRun:
    run_id: str
    name: str
    metrics: dict[str, float]


@dataclass(frozen=True)
class StudyRuns:
    experiment_id: str
    parent_id: str
    parent_name: str
    trials: list[TrialRun]
    run_count: int  # every run in the experiment: the table shows them all once the parent is unfolded


def read_study_runs(tracking_uri: str, experiment: str) -> StudyRuns:
    """The study's parent run and its trial runs (tag specdec.kind=trial), as the tuner recorded them."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise LookupError(f"no MLflow experiment named {experiment!r} in {tracking_uri}")
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    parents = [r for r in runs if r.data.tags.get("specdec.kind") == "study"]
    if len(parents) != 1:
        raise LookupError(f"expected one study run (tag specdec.kind=study) in {experiment!r}, found {len(parents)}")
    parent = parents[0]
    trials = [TrialRun(r.info.run_id, r.info.run_name, dict(r.data.metrics)) for r in runs
              if r.data.tags.get("specdec.kind") == "trial"
              and r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    return StudyRuns(exp.experiment_id, parent.info.run_id, parent.info.run_name, trials, len(runs))


def shown_precision(text: str) -> float:
    """Half a unit in the last place of a number as displayed ("3.985" -> 0.0005, "3076.6" -> 0.05, "24" -> 0.5):
    how far a correctly rounded display may be from the stored value."""
    try:
        exponent = Decimal(text).as_tuple().exponent
    except InvalidOperation:
        raise ValueError(f"displayed metric value {text!r} is not a number") from None
    return 0.5 * 10.0 ** int(exponent)


def snapshot_sqlite(src: Path, dst: Path) -> Path:
    """A consistent copy of a SQLite store (WAL included), so the server never touches the study's own file."""
    with contextlib.closing(sqlite3.connect(f"file:{src}?mode=ro", uri=True)) as source, \
            contextlib.closing(sqlite3.connect(dst)) as target:
        source.backup(target)
    return dst


# --- the server ------------------------------------------------------------------------------------------------


def mlflow_ui(db_path: Path, work_dir: Path, timeout_s: float = 240.0) -> contextlib.AbstractContextManager[ServerProcess]:
    """`mlflow ui` on a SQLite store, on a free port; waits for GET /health, kills its process group after.

    Runs in `work_dir` so the server's default ./mlartifacts cannot land in the repository."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", f"sqlite:///{db_path.resolve()}",
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true"}
    return http_server("mlflow ui", cmd, port=port, cwd=work_dir, env=env,
                       log_path=work_dir / f"mlflow-ui-{port}.log", timeout_s=timeout_s)


# --- the pages -------------------------------------------------------------------------------------------------

PAGE_TIMEOUT_MS = 90_000  # first load compiles a large JS bundle; slow on a shared 2-core box
STEP_TIMEOUT_MS = 30_000


def open_trials_view(page: Any, base_url: str, study: StudyRuns) -> None:
    """The link a study prints at its end (`pipeline.records.tracking.runs_link`), as a user opens it, until the first trial row
    is rendered. Nothing is clicked: the assistant side panel a new browser gets stays open, as the user sees it."""
    from pipeline.records.tracking import runs_link

    page.goto(runs_link(base_url, study.experiment_id))
    page.locator(f'[row-id="{study.trials[0].run_id}"]').first.wait_for(timeout=PAGE_TIMEOUT_MS)


def metric_col_id(key: str) -> str:
    return f"metrics.`{key}`"


def table_cell(page: Any, run_id: str, col_id: str) -> Any:
    return page.locator(f'.ag-center-cols-container [row-id="{run_id}"] [col-id="{col_id}"]')


def select_rows(page: Any, run_ids: list[str]) -> None:
    for run_id in run_ids:
        page.locator(f'.ag-pinned-left-cols-container [row-id="{run_id}"] input.ag-checkbox-input').check()


def compare_metric_row(page: Any, key: str) -> list[str]:
    """On the compare page, the displayed values of metric `key`, one per run column, left to right.

    The metrics table is two react-virtualized grids 300 px high, names and values, that render only the rows in
    view. Scroll the names grid until the row for `key` exists, then scroll both grids to centre it and read the
    value cells at the same vertical offset."""
    from playwright.sync_api import expect

    header = page.locator(".du-bois-light-collapse-header", has_text=re.compile(r"^\s*Metrics\s*$"))
    grids = page.locator(".du-bois-light-collapse-item", has=header).locator(".ReactVirtualized__Grid")
    names, values = grids.nth(0), grids.nth(1)
    values.wait_for(timeout=PAGE_TIMEOUT_MS)
    values.scroll_into_view_if_needed()  # the page, so that the grids are on screen
    page.wait_for_function(
        """([names, key]) => {
            if ([...names.querySelectorAll('a[title="Plot chart"]')].some(a => a.textContent.trim() === key)) {
                return true;
            }
            names.scrollTop += Math.max(names.clientHeight / 2, 1);
            return false;
        }""",
        arg=[names.element_handle(), key], timeout=STEP_TIMEOUT_MS, polling=200)
    label = names.locator('a[title="Plot chart"]').filter(has_text=re.compile(rf"^\s*{re.escape(key)}\s*$"))
    top = label.evaluate("a => a.parentElement.style.top")
    # Centre the row in both grids. The app syncs the names grid to the values grid's *previous* scroll position
    # (it reads React state inside the scroll handler), so scroll the values grid first, let its event land, then
    # put the names grid in the same place.
    page.wait_for_function(
        """([names, values, top]) => {
            const max = values.scrollHeight - values.clientHeight;
            const target = Math.round(Math.min(max, Math.max(0, parseFloat(top) - values.clientHeight / 2)));
            if (Math.abs(values.scrollTop - target) >= 1) { values.scrollTop = target; return false; }
            if (Math.abs(names.scrollTop - target) >= 1) { names.scrollTop = target; return false; }
            return true;
        }""",
        arg=[names.element_handle(), values.element_handle(), top], timeout=STEP_TIMEOUT_MS, polling=200)
    cells = values.locator(f'.ReactVirtualized__Grid__innerScrollContainer > div[style*="top: {top};"]')
    expect(label).to_be_in_viewport(timeout=STEP_TIMEOUT_MS)
    expect(cells.first).to_be_in_viewport(timeout=STEP_TIMEOUT_MS)
    return cells.evaluate_all(
        "els => els.sort((a, b) => parseFloat(a.style.left) - parseFloat(b.style.left)).map(e => e.textContent.trim())")


def compare_run_names(page: Any) -> list[str]:
    """On the compare page, the "Run Name:" row of the run details table, left to right."""
    row = page.locator("tr", has=page.locator("th", has_text=re.compile(r"^\s*Run Name:\s*$")))
    row.wait_for(timeout=PAGE_TIMEOUT_MS)
    return [text.strip() for text in row.locator("td").all_inner_texts()]
