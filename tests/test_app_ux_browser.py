"""What a first-time user does on the page, in a real headless Chromium (as :mod:`tests.test_app_browser`): one
served app and one short training run, shared by the tests below in file order.

Before the run: a wrong model id and a field's bad value are refused before anything launches, in the field's
label; the set-up exports as YAML and as a command line that ``--dry-run`` resolves to the same config. During it:
the status says what is happening from the start (loading the model, the base eval's n/N), and a reloaded page
shows the active run's settings. After it: a captioned eval grid per eval, on disk and in the timeline, a read-only
progress bar, the log at its end, the adapter downloaded, a prompt of one's own generated with it (an input image
is refused: the run's model is not an editing one), Publish's checks in the order a user can fix them,
the machine's GPU or CPU, and a run deleted. Copies of the run given judges (as a trainer with ``eval.judges`` writes
them) show the judges' curves, also after switching between runs with other judges, the reward-hacking alarm, the
first-iteration check, and offer their best adapter to download and try; two of them compare side by side. It saves ``docs/screenshot-finished.png``
for the README."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jagg_core.rundir import LORA_FILE, RunDirectory
from tests.fake_hub_server import FakeHub
from conftest import HACKING_ALARM_LINE, add_judges, wait_on_states_only
from tests.test_app import REPO, serve_app
from tests.test_app_browser import CHROMIUM, CHROMIUM_ARGS

pytestmark = pytest.mark.skipif(not CHROMIUM.is_file(), reason="needs Debian's chromium at /usr/bin/chromium "
                                                               "(apt-get install chromium); CI installs it")

RUN_NAME = "ux-run"
EVAL_PROMPTS = ["a red circle on a blue background, top left", "a green square on a yellow background, center",
                "a blue triangle on a white background, bottom right"]
# a run of a few seconds per iteration (elem ids of the knobs)
FIELDS = {"knob-train-iterations": "3", "knob-sampling-num-steps": "6", "knob-grpo-num-generations": "4",
          "knob-sampling-resolution": "32", "knob-prompts-eval-count": "16", "knob-train-sample-every": "1"}


@pytest.fixture(scope="module")
def studio(tmp_path_factory):
    """(page, runs dir) of a served app whose Hub is a fake one, with no token, in one browser page."""
    from playwright.sync_api import sync_playwright

    runs = tmp_path_factory.mktemp("ux") / "runs"
    runs.mkdir()
    with FakeHub() as hub, serve_app(runs, HF_ENDPOINT=hub.url, HF_HOME=str(runs.parent / "hf-home"),
                                     HF_TOKEN="") as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900}, accept_downloads=True)
            wait_on_states_only(page)
            page.goto(url)
            yield page, runs
        finally:
            browser.close()


def _fill(page, elem_id: str, value: str) -> None:
    field = page.locator(f"#{elem_id} :is(input, textarea)").first
    field.fill(value)
    field.blur()


def _select_run(page, run: str) -> None:
    """Pick ``run`` in the run dropdown. A run directory made while the page is open is listed at the page's next
    refresh tick, so the pick is tried again until the dropdown holds it (a busy machine delays the tick)."""
    field = page.locator("#run-select input")
    for _ in range(120):
        field.fill(run)
        field.press("Enter")
        field.blur()
        if field.input_value() == run:
            return
        page.wait_for_timeout(500)
    raise AssertionError(f"the run dropdown never listed {run}")


def _open(page, accordion: str) -> None:
    page.locator(f"#{accordion} .label-wrap").first.click()


def _fill_form(page) -> None:
    _open(page, "advanced")  # some of the fields
    _fill(page, "run-name", RUN_NAME)
    for elem_id, value in FIELDS.items():
        _fill(page, elem_id, value)


def test_a_wrong_model_and_a_bad_value_are_refused_before_launch_in_the_fields_words(studio):
    from playwright.sync_api import expect

    page, runs = studio
    expect(page.locator("#run-status")).to_contain_text("No run yet")
    expect(page.locator("#reward-about")).to_contain_text("shapes: the shapes world's prompt checked in the pixels")
    _fill_form(page)
    _fill(page, "model", "nobody/no-such-model")
    page.locator("#start-btn").click()
    message = page.locator("#form-message")
    expect(message).to_contain_text("Not started")
    expect(message).to_contain_text("nobody/no-such-model")
    assert not [p for p in runs.iterdir() if p.is_dir()], "a refused start must leave no run behind"

    _fill(page, "model", "jagg-shapes")
    _fill(page, "knob-prompts-eval-count", "100000")
    page.locator("#start-btn").click()
    expect(message).to_contain_text("'Eval prompts' is 100000")
    expect(message).not_to_contain_text("prompts.eval_count")
    _fill(page, "knob-prompts-eval-count", FIELDS["knob-prompts-eval-count"])


def test_the_setup_exports_as_yaml_and_a_command_that_resolve_to_the_same_config(studio):
    from playwright.sync_api import expect

    page, runs = studio
    _open(page, "export")
    page.locator("#export-btn").click()
    command = page.locator("#export-cli textarea")
    expect(command).to_have_value(re.compile("^python -m jagg_core.run --preset shapes"))
    with page.expect_download() as download:
        page.locator("#export-yaml a").first.click()
    yaml_file = runs.parent / "exported.yaml"  # the started run's config.yaml is compared with it below
    download.value.save_as(yaml_file)

    def dry_run(*args: str) -> str:
        result = subprocess.run([sys.executable, "-m", "jagg_core.run", *args, "--dry-run"], cwd=REPO,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
        return result.stdout

    from_yaml = dry_run("--config", str(yaml_file))
    assert from_yaml == dry_run(*shlex.split(command.input_value())[3:])
    assert f"name: {RUN_NAME}" in from_yaml and "iterations: 3" in from_yaml


def test_the_status_says_what_happens_from_the_start_and_a_reload_shows_the_active_runs_settings(studio):
    from playwright.sync_api import expect

    page, runs = studio
    _fill(page, "eval-text", "\n".join(EVAL_PROMPTS))
    page.locator("#start-btn").click()
    expect(page.locator("#form-message")).to_contain_text("Started")
    status = page.locator("#run-status")
    expect(status).to_contain_text(re.compile(r"launching the training process|loading the model|base eval \d+/3"))
    page.reload()
    expect(page.locator("#run-name textarea")).to_have_value(RUN_NAME)
    expect(page.locator("#knob-train-iterations input")).to_have_value("3")
    expect(page.locator("#knob-sampling-resolution input")).to_have_value("32")
    expect(page.locator("#eval-text textarea")).to_have_value("\n".join(EVAL_PROMPTS) + "\n")
    expect(page.locator("#log textarea")).to_have_value(re.compile(r"base eval 3/3"))
    expect(page.locator("#log textarea")).to_have_value(re.compile(r"loading the model jagg-shapes"))
    expect(status).to_contain_text("Finished")
    run_dir = next(p for p in runs.iterdir() if p.name.startswith(RUN_NAME))
    started = yaml.safe_load(RunDirectory(run_dir).config_file.read_text())
    assert started["prompts"]["eval_source"] == str(run_dir / "eval_prompts.txt")  # typed after the export
    started["prompts"]["eval_source"] = None
    assert started == yaml.safe_load((runs.parent / "exported.yaml").read_text())
    assert re.search(r"loss [+-]\d\.\d{3}e[+-]\d\d", RunDirectory(run_dir).log_file.read_text())


def test_every_eval_has_a_captioned_grid_on_disk_and_in_the_timeline(studio):
    from playwright.sync_api import expect

    page, runs = studio
    run = RunDirectory(next(p for p in runs.iterdir() if p.name.startswith(RUN_NAME)))
    assert run.sample_iterations() == [0, 1, 2, 3]
    assert all(run.grid_file(i).stat().st_size > 1000 for i in run.sample_iterations())
    assert run.samples(0).prompts == EVAL_PROMPTS  # the eval prompts typed in the form
    expect(page.locator("#eval-grids img")).to_have_count(4)
    expect(page.locator("#eval-grids")).to_contain_text("base model")


def test_a_finished_run_reads_at_its_end_with_a_read_only_progress_bar(studio):
    from playwright.sync_api import expect

    page, _ = studio
    page.reload()
    expect(page.locator("#progress progress")).to_have_attribute("value", "3")
    assert page.locator("#progress input").count() == 0
    expect(page.locator("#fidelity-plot")).to_be_hidden()  # 3 iterations, the first audit at 10: no empty plot
    log = page.locator("#log textarea")
    expect(log).to_have_value(re.compile("finished: adapter at"))
    page.wait_for_function("() => { const t = document.querySelector('#log textarea');"
                           " return t.scrollHeight > t.clientHeight && t.scrollTop + t.clientHeight >= t.scrollHeight - 2; }")


def test_the_download_button_serves_the_adapter(studio, tmp_path):
    from playwright.sync_api import expect

    page, runs = studio
    run = RunDirectory(next(p for p in runs.iterdir() if p.name.startswith(RUN_NAME)))
    expect(page.locator("#download-btn")).to_be_enabled()
    with page.expect_download() as download:
        page.locator("#download-btn").click()
    saved = tmp_path / "adapter.safetensors"
    download.value.save_as(saved)
    assert saved.read_bytes() == run.lora_file.read_bytes()


def test_a_prompt_of_ones_own_is_generated_with_the_adapter_and_an_input_image_is_for_editing_runs(studio):
    from playwright.sync_api import expect

    page, runs = studio
    _fill(page, "try-prompt", "a yellow triangle on a blue background, bottom right")
    for box in ("try-input", "try-input-2", "try-input-3"):  # an input image is for editing runs: none for this one
        expect(page.locator(f"#{box}")).to_be_hidden()
    page.locator("#generate-btn").click()
    expect(page.locator("#try-message")).to_contain_text("the base model (left) and the adapter")
    expect(page.locator("#try-image img")).to_be_visible()
    _fill(page, "evaluate-images", "1")  # the adapter against the base model on its held-out prompts, 1 noise each
    page.locator("#evaluate-btn").click()
    result = page.locator("#evaluate-result")
    expect(result).to_contain_text("latest adapter")
    expect(result.locator("table")).to_contain_text("reward shapes")
    expect(result.locator("table")).to_contain_text("judge shapes_fidelity")
    expect(page.locator("#evaluate-image img")).to_be_visible()
    page.locator("#card-btn").click()  # the model card a push would upload, with the evaluation just made
    card = page.locator("#card-view")
    expect(card).to_contain_text("Hub metadata:")
    expect(card.locator("code").filter(has_text="pipe.load_lora_weights(")).to_be_visible()
    expect(card.locator("h2").filter(has_text="Evaluation")).to_be_visible()
    curve = card.locator('img[alt="Reward per iteration"]')  # the card's images, as the push uploads them
    expect(curve).to_be_visible()
    assert curve.evaluate("image => image.complete && image.naturalWidth") > 0
    page.wait_for_timeout(2000)  # let the plots draw
    page.screenshot(path=str(REPO / "docs" / "screenshot-finished.png"), full_page=True)  # the README's second


def test_publish_checks_the_adapter_then_the_repo_id_then_the_token(studio):
    from playwright.sync_api import expect

    page, runs = studio
    finished = next(p for p in runs.iterdir() if p.name.startswith(RUN_NAME))
    empty = runs / "no-adapter-20250101-000000"  # a run stopped before its first checkpoint
    empty.mkdir()
    RunDirectory(empty).write_config(RunDirectory(finished).config_file.read_text())
    result = page.locator("#push-result")

    def push(run: str, repo_id: str, expected: str) -> None:
        _select_run(page, run)
        _fill(page, "push-repo", repo_id)
        page.locator("#push-btn").click()
        expect(result).to_contain_text(expected)

    push(empty.name, "not a repo id!", "has no adapter yet")
    push(finished.name, "not a repo id!", "'not a repo id!' is not a valid Hub repo id")
    push(finished.name, "alice/ux-lora", "no Hugging Face token")


def test_the_page_shows_the_machine_and_deletes_a_run(studio):
    from playwright.sync_api import expect

    page, runs = studio
    expect(page.locator("#hardware")).to_contain_text(re.compile(r"No CUDA GPU|GPU 0:"))
    empty = runs / "no-adapter-20250101-000000"
    _select_run(page, empty.name)
    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#delete-btn").click()
    expect(page.locator("#run-message")).to_contain_text(f"Deleted {empty.name}")
    assert not empty.exists() and any(p.name.startswith(RUN_NAME) for p in runs.iterdir())


def _judged_copy(finished: RunDirectory, name: str, judges: dict[str, tuple[float, ...]], best: Path) -> RunDirectory:
    """A copy of the finished run with ``judges`` (a mean per eval), ``best`` as its best adapter (iteration 2), the
    alarm at its last eval and a first-iteration check with a failed line."""
    copy = finished.path.parent / name
    shutil.copytree(finished.path, copy)
    evals = finished.sample_iterations()
    add_judges(copy, {judge: dict(zip(evals, means)) for judge, means in judges.items()}, best_iteration=2,
               adapter=best, alarm_iteration=evals[-1])
    return RunDirectory(copy)


def test_a_judged_run_shows_its_judges_the_alarm_the_first_iteration_check_and_its_best_adapter(studio, tmp_path):
    from playwright.sync_api import expect

    page, runs = studio
    finished = RunDirectory(next(p for p in runs.iterdir() if p.name.startswith(RUN_NAME)))
    earlier = finished.checkpoint_dir(finished.checkpoint_iterations()[-2]) / LORA_FILE  # the best: not the latest
    assert earlier.read_bytes() != finished.lora_file.read_bytes()
    one = _judged_copy(finished, "judged-one-20250101-000000", {"shapes_fidelity": (0.6, 0.7, 0.9, 0.8)}, earlier)
    two = _judged_copy(finished, "judged-two-20250101-000000",
                       {"aesthetic": (5.0, 5.2, 5.3, 5.1), "clip_score": (0.30, 0.31, 0.32, 0.33)}, earlier)
    plot = page.locator("#judge-plot")
    lines = plot.locator('path[aria-roledescription="line mark"]')
    for run, judges in ((one, ["shapes_fidelity"]), (two, ["aesthetic", "clip_score"]), (one, ["shapes_fidelity"])):
        _select_run(page, run.path.name)
        for series in ["eval reward", *(f"judge {judge}" for judge in judges)]:
            expect(plot).to_contain_text(series)
        expect(lines).to_have_count(1 + len(judges))  # every series drawn, also after a run with other judges

    expect(page.locator("#run-status")).to_contain_text(HACKING_ALARM_LINE)
    doctor = page.locator("#doctor")
    expect(doctor).to_contain_text("First-iteration check (iteration 1): 1 of 3 failed")
    expect(doctor).to_contain_text("✓ rewards vary within groups: std 0.12 within groups")
    expect(doctor).to_contain_text("✗ the gradient moves the velocity: the velocity moved 0.0")
    expect(doctor).to_contain_text("Fix: raise 'Learning rate'")

    page.locator("#push-checkpoint input").click()
    page.locator("ul[role=listbox] li", has_text="best (iteration 2, judge shapes_fidelity 0.900)").click()
    expect(page.locator("#download-btn")).to_contain_text("Download best adapter")
    with page.expect_download() as download:
        page.locator("#download-btn").click()
    saved = tmp_path / "best.safetensors"
    download.value.save_as(saved)
    assert saved.read_bytes() == earlier.read_bytes()
    _fill(page, "try-prompt", "a red circle on a blue background, top left")
    page.locator("#generate-btn").click()
    expect(page.locator("#try-message")).to_contain_text(f"{one.path.name}, best: the base model (left)")
    page.locator("#evaluate-against input").click()  # Evaluate against another run: its adapters to choose from
    page.locator("ul[role=listbox] li", has_text=two.path.name).click()
    page.locator("#evaluate-against-adapter input").click()
    page.locator("ul[role=listbox] li", has_text="best (iteration 2").click()
    expect(page.locator("#evaluate-against-adapter input")).to_have_value(re.compile(r"^best \(iteration 2"))


def test_two_runs_compare_side_by_side_and_the_queue_block_says_none_waits(studio):
    from playwright.sync_api import expect

    page, _ = studio
    expect(page.locator("#queue-list")).to_contain_text("No run is queued")
    _open(page, "compare")
    expect(page.locator("#compare-hint")).to_contain_text("Choose two or more runs")
    for name in ("judged-one-20250101-000000", "judged-two-20250101-000000"):
        page.locator("#compare-runs input").click()
        page.locator("ul[role=listbox] li", has_text=name).click()
    page.locator("#compare-runs input").blur()
    expect(page.locator("#compare-table")).to_contain_text("judged-two-20250101-000000")
    expect(page.locator('#compare-plot path[aria-roledescription="line mark"]')).to_have_count(2)
    expect(page.locator("#compare-grids img")).to_have_count(2)
