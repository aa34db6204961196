"""The report a finished small study wrote (`finished_study`: baseline + 2 NGRAM trials on the CPU engine, search
only), opened in a real (headless Debian) Chromium at a laptop's width: it shows the study's details as recorded
(the model, the engine and the version it reported, the node's hardware, the project's commit, the workload's prompt
and output lengths, the levels), the runs the decision rests on (a search-only study: every trial's run, each with
the figure MLflow holds for it, in the order they ran) and a latency plot drawn from the runs' requests, with nothing
wider than the window. The full-page screenshot goes to `$SPECDEC_TEST_ARTIFACTS/test_report_browser/`."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.records.tracking import KIND_TAG, Tracker
from tests.integration.report_page import read_report
from tests.integration.ui_helpers import browser_api

browser_api()  # skips the module without Chromium or playwright

pytestmark = pytest.mark.integration


def test_the_report_shows_the_study_details_the_runs_it_rests_on_and_their_latency(finished_study):
    study, out, code = finished_study
    assert code == 0
    shown = read_report(Path(out) / "report" / "report.html", "finished-study-report.png")
    details = shown.details
    assert details["model"] == study.model.target
    assert details["engine"].startswith("cpu ") and "version unknown" not in details["engine"], details
    assert "CPUs" in details["hardware (the baseline engine's node)"], details
    assert details["project commit"] not in ("", "unknown"), details
    assert details["concurrency levels"].startswith(str(list(study.concurrency)))
    low, _, high = details["prompt tokens (min / median / max)"].split(" / ")
    assert 0 < float(low) <= float(high), details
    assert f"max_new_tokens {study.workload.max_new_tokens}" in details["output tokens (min / median / max)"]
    tracker = Tracker(f"sqlite:///{Path(out) / 'mlflow.db'}", study.tracking.experiment or study.name)
    trials = sorted((r for r in tracker.all_runs() if r.data.tags.get(KIND_TAG) == "trial"),
                    key=lambda r: r.info.start_time or 0)
    assert [row[2] for row in shown.run_rows] == [r.info.run_name for r in trials]  # every run, in the order run
    assert [row[1] for row in shown.run_rows] == [str(k) for k in range(1, len(trials) + 1)]
    for row, run in zip(shown.run_rows, trials):
        tput = run.data.metrics.get("tput_tok_s")
        assert row[5] == ("-" if tput is None else f"{tput:.1f}"), (row, run.data.metrics)
    assert "The search's runs" in shown.body_text
    assert shown.figures.get("fig-latency_c1", 0) > 0 and shown.figures.get("fig-timeline_c1", 0) > 0, shown.figures
    assert all(width > 0 for width in shown.figures.values()), shown.figures  # no empty image
    assert shown.first_section == "headline"
    assert shown.scroll_width <= shown.client_width  # nothing wider than the window
