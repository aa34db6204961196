"""The study report (report/report.html) opened in a real (headless Debian) Chromium at a laptop's width, and what a
reader sees checked: the headline first, the per-level decision as an HTML table, the speed-up chart when the study
has several levels, every image drawn (no empty plot), nothing wider than the window (no sideways scroll). Used by
the study tests that produce a report (tests/end_to_end/test_levels_study.py); a full-page screenshot goes to
`$SPECDEC_TEST_ARTIFACTS/test_report_browser/` (default `<repo>/test-artifacts/test_report_browser/`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tests.integration.ui_helpers import CHROMIUM, CHROMIUM_ARGS, artifact_dir

if TYPE_CHECKING:
    from playwright.sync_api import ViewportSize

LAPTOP: ViewportSize = {"width": 1280, "height": 800}
ARTIFACT_SUBDIR = "test_report_browser"
TIMEOUT_MS = 60_000


@dataclass(frozen=True)
class ReportPage:
    """What the page showed: the headline's text, the level table's rows (cells), the study details (label: value),
    the rows of the runs the decision rests on (cells), the figures' ids with their images' natural widths, the
    page's scroll width vs the window's, and where the screenshot went."""

    headline: str
    level_rows: list[list[str]]
    details: dict[str, str]
    run_rows: list[list[str]]
    figures: dict[str, int]
    scroll_width: int
    client_width: int
    first_section: str
    body_text: str
    screenshot: Path


def read_report(report: Path, shot_name: str, shot_to: Path | None = None) -> ReportPage:
    """Open `report` as a user would (a file in the browser) and read what it shows; the full-page screenshot goes
    to the test artifacts as `shot_name`, or to `shot_to`."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=LAPTOP)
            page.goto(report.resolve().as_uri(), timeout=TIMEOUT_MS)
            page.wait_for_load_state("load", timeout=TIMEOUT_MS)
            headline = page.locator("#headline")
            headline.wait_for(timeout=TIMEOUT_MS)
            figures = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('figure')].map(
                f => [f.id, f.querySelector('img') ? f.querySelector('img').naturalWidth : 0]))""")
            rows = page.evaluate("""() => [...document.querySelectorAll('#level-table tbody tr')].map(
                tr => [...tr.querySelectorAll('td')].map(td => td.innerText.trim()))""")
            details = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll(
                '#details-table tr')].map(tr => [tr.querySelector('th').innerText.trim(),
                                                 tr.querySelector('td').innerText.trim()]))""")
            run_rows = page.evaluate("""() => [...document.querySelectorAll('#runs-table tbody tr')].map(
                tr => [...tr.querySelectorAll('td')].map(td => td.innerText.trim()))""")
            widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
            first = page.evaluate("document.body.children[1].id")  # after the title
            shot = shot_to or artifact_dir(ARTIFACT_SUBDIR) / shot_name
            page.screenshot(path=shot, full_page=True)
            return ReportPage(headline=headline.inner_text(), level_rows=rows, details=details, run_rows=run_rows,
                              figures=figures,
                              scroll_width=widths[0], client_width=widths[1], first_section=first,
                              body_text=page.locator("body").inner_text(), screenshot=shot)
        finally:
            browser.close()
