"""The MLflow UI, in a real (headless Debian) Chromium, shows a finished study the way a user needs it.

`mlflow ui` serves a snapshot of the study's SQLite store; Playwright opens the link the study printed in a new browser
(no stored UI state: MLflow's one-time assistant panel opens, its GenAI/"Model training" switch has no remembered
choice) and checks, as the page first shows it (no clicking, no picking columns, no unfolding), that it is the runs
table under "Model training", not the GenAI overview, and that every trial run is listed with the comparison columns
(throughput, vs baseline, accept length, TTFT, outcome) and its stored `tput_tok_s`; then selects two trials, follows
the app's own "Compare" button and checks the compare view shows both runs and their `tput_tok_s`.

A bare experiment URL is not the path checked: MLflow 3.17's UI ignores the experiment's kind tag and opens a new
browser on the GenAI overview for every experiment (see `pipeline.records.tracking.WORKFLOW_PARAM`), so the printed link is
where a user starts.
Screenshots go to `$SPECDEC_TEST_ARTIFACTS/test_mlflow_ui/` (default `<repo>/test-artifacts/test_mlflow_ui/`).

Placed by cost in the end-to-end tier (an `mlflow ui` server and Chromium, 30-90 s on a shared 2-core box); the
default run keeps the cheap check of the same contract, the link's workflow and the shared view's comparison columns
in the store (tests/unit/test_record_ui.py).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.servers import ServerProcess
from tests.integration.ui_helpers import (
    CHROMIUM,
    CHROMIUM_ARGS,
    PAGE_TIMEOUT_MS,
    STEP_TIMEOUT_MS,
    StudyRuns,
    artifact_dir,
    browser_api,
    compare_metric_row,
    compare_run_names,
    metric_col_id,
    mlflow_ui,
    open_trials_view,
    read_study_runs,
    select_rows,
    shown_precision,
    snapshot_sqlite,
    table_cell,
)

sync_api = browser_api()

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]

METRIC = "tput_tok_s"
SHOWN_METRICS = [METRIC, "vs_baseline", "accept_len", "ttft_p50_ms"]
ARTIFACT_SUBDIR = "test_mlflow_ui"
ROW_PX = 32  # ag-grid row height in the runs table: the viewport is made tall enough that no row is virtualized away


@pytest.fixture(scope="module")
def study_ui(finished_study, tmp_path_factory) -> Iterator[tuple[ServerProcess, StudyRuns]]:
    """`mlflow ui` on a copy of the finished study's store, and the study's runs as recorded there."""
    study, out = finished_study[:2]  # (StudyConfig, output folder, exit code)
    work = tmp_path_factory.mktemp("mlflow-ui")
    db = snapshot_sqlite(Path(out) / "mlflow.db", work / "mlflow.db")
    runs = read_study_runs(f"sqlite:///{db}", study.tracking.experiment or study.name)
    measured = [t for t in runs.trials if METRIC in t.metrics]
    if len(measured) < 2:
        pytest.fail(f"the finished study must have >= 2 trial runs with metric {METRIC}; "
                    f"found {[(t.name, sorted(t.metrics)) for t in runs.trials]}")
    with mlflow_ui(db, work) as server:
        yield server, runs


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser, study_ui, request) -> Iterator[Any]:
    """A fresh browser context (no UI state from localStorage). If the test fails: a screenshot of where it stood and
    the server's log go to the artifact folder, and the log's tail is printed."""
    server, runs = study_ui
    context = browser.new_context(viewport={"width": 2200, "height": max(1200, 400 + ROW_PX * runs.run_count)})
    context.set_default_timeout(STEP_TIMEOUT_MS)
    page = context.new_page()
    failed_before = request.session.testsfailed
    try:
        yield page
    finally:
        if request.session.testsfailed > failed_before:
            shots = artifact_dir(ARTIFACT_SUBDIR)
            with contextlib.suppress(sync_api.Error):
                page.screenshot(path=shots / f"FAILED-{request.node.name}.png", full_page=True)
            shutil.copy(server.log_path, shots / "mlflow-ui.log")
            print(f"--- mlflow ui log (tail) ---\n{server.log()[-4000:]}")
        context.close()


def test_study_runs_table_and_compare_view(page, study_ui) -> None:
    """One user path (a page load costs 10-50 s on a shared 2-core box): the runs table, then Compare from it."""
    server, runs = study_ui
    expect = sync_api.expect
    shots = artifact_dir(ARTIFACT_SUBDIR)

    # The printed link, in a new browser: the runs table under "Model training" (the app kept the workflow the link
    # names; the GenAI overview and its "Detect Issues" popover are not shown), every trial run listed by name, with
    # the comparison columns and its stored throughput, as the page first shows it.
    open_trials_view(page, server.url, runs)
    assert "workflowType=machine_learning" in page.url, page.url
    expect(page.get_by_text("Detect Issues")).to_have_count(0)
    for key in SHOWN_METRICS:
        header = page.locator(f'.ag-header-cell[col-id="{metric_col_id(key)}"]')
        expect(header).to_contain_text(key, timeout=STEP_TIMEOUT_MS)
        expect(header).to_be_in_viewport(timeout=STEP_TIMEOUT_MS)
    expect(page.locator('.ag-header-cell[col-id="tags.`outcome`"]')).to_be_in_viewport(timeout=STEP_TIMEOUT_MS)
    for trial in runs.trials:
        link = page.locator(f'a[href$="/runs/{trial.run_id}"]')
        expect(link).to_have_text(trial.name, timeout=STEP_TIMEOUT_MS)
        expect(link).to_be_in_viewport(timeout=STEP_TIMEOUT_MS)
        cell = table_cell(page, trial.run_id, metric_col_id(METRIC))
        expect(cell).to_be_in_viewport(timeout=STEP_TIMEOUT_MS)
        shown = cell.inner_text().strip()
        if METRIC in trial.metrics:
            # The table shows the full float; compare as numbers, not as formatting.
            assert float(shown) == pytest.approx(trial.metrics[METRIC], rel=1e-12), (trial.name, shown)
        else:
            assert shown == "-", (trial.name, shown)
    page.screenshot(path=shots / "runs-table.png", full_page=True)

    # Compare, from the table's own button, the slowest and the fastest trial: the most different values, so a
    # mix-up of the run columns cannot go unnoticed.
    measured = sorted((t for t in runs.trials if METRIC in t.metrics), key=lambda t: t.metrics[METRIC])
    pair = [measured[0], measured[-1]]
    select_rows(page, [t.run_id for t in pair])
    page.get_by_role("button", name="Compare", exact=True).click()
    page.wait_for_url(re.compile(r"/#/compare-runs\?"))
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(page.url).fragment.partition("?")[2])
    assert sorted(json.loads(query["runs"][0])) == sorted(t.run_id for t in pair)
    assert json.loads(query["experiments"][0]) == [runs.experiment_id]
    expect(page.get_by_text("Comparing 2 Runs from 1 Experiment")).to_be_visible(timeout=PAGE_TIMEOUT_MS)

    names = compare_run_names(page)
    assert sorted(names) == sorted(t.name for t in pair)
    page.screenshot(path=shots / "compare-runs.png", full_page=True)

    shown = compare_metric_row(page, METRIC)
    assert len(shown) == 2, shown
    by_name = {t.name: t for t in pair}
    for name, text in zip(names, shown):
        stored = by_name[name].metrics[METRIC]
        assert abs(float(text) - stored) <= shown_precision(text) * (1 + 1e-9), (name, text, stored)
    page.screenshot(path=shots / "compare-runs-metrics.png", full_page=True)
