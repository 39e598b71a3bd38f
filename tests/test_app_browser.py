"""The page in a real headless Chromium (Debian's ``chromium``, driven by Playwright): open it, start a tiny run with
the Start button (after its memory plan), see the eval sample previews appear, the run finish and its fidelity
audits' plot, and save a screenshot (also kept as ``docs/screenshot.png`` for the README). CI installs ``chromium``; without it this test is skipped."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import wait_on_states_only
from tests.test_app import REPO, serve_app

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# the form fields set before Start (elem ids of the knobs), for a run of a few seconds per iteration at the
# default (embedded shapes) model's native 32 px, so the screenshot shows what a user sees
FAST_FIELDS = {"knob-train-iterations": "2", "knob-sampling-num-steps": "8", "knob-grpo-num-generations": "4",
               "knob-sampling-resolution": "32", "knob-backward-audit-every": "1"}


@pytest.mark.skipif(not CHROMIUM.is_file(), reason="needs Debian's chromium at /usr/bin/chromium "
                                                   "(apt-get install chromium); CI installs it")
def test_start_a_run_in_the_browser_and_see_samples(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    runs = tmp_path / "runs"
    runs.mkdir()
    with serve_app(runs) as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            wait_on_states_only(page)
            page.goto(url)
            expect(page.locator("#run-status")).to_contain_text("No run yet")
            advanced = page.locator("#advanced .label-wrap").first
            advanced.click()  # the audit's field is there
            for elem_id, value in FAST_FIELDS.items():
                field = page.locator(f"#{elem_id} input")
                field.fill(value)
                field.blur()
            advanced.click()
            page.locator("#plan-btn").click()  # the memory plan of the form, beside Start
            expect(page.locator("#memory-plan")).to_contain_text("planned peak")
            expect(page.locator("#memory-plan")).to_contain_text("LoRA")
            expect(page.locator("#memory-plan")).to_contain_text("host: fits the text-embedding cache")
            page.locator("#start-btn").click()
            expect(page.locator("#form-message")).to_contain_text("Started")
            expect(page.locator("#base-samples img").first).to_be_visible()
            expect(page.locator("#run-status")).to_contain_text("Finished")
            expect(page.locator("#latest-samples img").first).to_be_visible()
            expect(page.locator("#progress progress")).to_have_attribute("value", "2")
            expect(page.locator("#start-btn")).to_be_enabled()  # the job's processes have exited
            expect(page.locator("#fidelity-plot")).to_be_visible()  # audited at both iterations: a point each
            page.wait_for_timeout(3000)  # let the plots draw
            shot = tmp_path / "screenshot.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert shot.stat().st_size > 10_000
    docs = REPO / "docs"
    docs.mkdir(exist_ok=True)
    shutil.copyfile(shot, docs / "screenshot.png")
