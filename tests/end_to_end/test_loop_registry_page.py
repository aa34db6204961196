"""The registry in the MLflow UI shows what each version is, in a real (headless Debian) Chromium: a version's page
has the spec and the measured figure in its description and its alias, and the registered model's versions table
lists production and candidate side by side with their spec tags and aliases. One `mlflow ui` on a store made here
(two versions, as a study and a re-tune register them); about 30 s on a shared 2-core box."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest

from pipeline.records.registry import CANDIDATE, register_config
from pipeline.records.tracking import Tracker
from serve.engines.base import ReplicaConfig
from serve.serving import Provenance, ServingConfig
from tests.integration.ui_helpers import CHROMIUM, CHROMIUM_ARGS, PAGE_TIMEOUT_MS, STEP_TIMEOUT_MS, artifact_dir, \
    browser_api, mlflow_ui

sync_api = browser_api()

pytestmark = [pytest.mark.integration, pytest.mark.end_to_end]
NAME = "specdec-page"


def serving(draft_tokens: int, source: str, tput: float) -> ServingConfig:
    return ServingConfig(replica=ReplicaConfig(model="smollm2-135m", spec={"algorithm": "ngram",
                                                                          "num_draft_tokens": draft_tokens}),
                         provenance=Provenance(study="page", decision="promote", source=source, workload="templated",
                                               workload_digest="0123456789abcdef", medians={"tput_tok_s": tput}))


def test_the_version_pages_show_the_spec_the_figures_and_the_aliases(tmp_path: Path) -> None:
    db = tmp_path / "mlflow.db"
    tracker = Tracker(f"sqlite:///{db}", "page", artifact_dir=tmp_path / "artifacts")
    run_id = tracker.start_study("page", "name: page\n", resume=False)
    register_config(tracker, run_id, NAME, serving(4, "final-0", 12.5), move_production=True)
    register_config(tracker, run_id, NAME, serving(6, "final-1", 14.25), move_production=False, alias=CANDIDATE)
    expect = sync_api.expect
    shots = artifact_dir("test_loop_registry_page")
    with mlflow_ui(db, tmp_path) as server, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 2000})
        page.set_default_timeout(STEP_TIMEOUT_MS)
        try:
            page.goto(f"{server.url}/#/models/{NAME}/versions/2")
            row = page.locator("tr", has=page.locator("td", has_text=re.compile(r"^\s*spec\.num_draft_tokens\s*$")))
            row.first.wait_for(timeout=PAGE_TIMEOUT_MS)
            expect(row.first).to_contain_text("6")
            expect(page.locator("tr", has=page.locator("td", has_text=re.compile(r"^\s*tput_tok_s\s*$"))).first
                   ).to_contain_text("14.25")
            expect(page.get_by_text(re.compile(r"^\s*@?\s*candidate\s*$")).first).to_be_visible()
            page.screenshot(path=shots / "version-2.png", full_page=True)

            page.goto(f"{server.url}/#/models/{NAME}")
            for version, alias, drafts in (("2", CANDIDATE, "6"), ("1", "production", "4")):
                line = page.get_by_test_id("model-version-table").get_by_role("row").filter(
                    has=page.get_by_role("link", name=f"Version {version}", exact=True))
                line.first.wait_for(timeout=PAGE_TIMEOUT_MS)
                expect(line.first).to_contain_text(alias)
                expect(line.first).to_contain_text(f"spec.num_draft_tokens: {drafts}")
            page.screenshot(path=shots / "versions.png", full_page=True)
        except Exception:
            with contextlib.suppress(sync_api.Error):
                page.screenshot(path=shots / "FAILED.png", full_page=True)
            raise
        finally:
            browser.close()
