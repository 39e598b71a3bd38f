"""The app: the form <-> config mapping, job control, and the served page driven by ``gradio_client``.

The served tests launch ``python app.py`` on a free port with ``JAGG_RUNS_DIR`` in a temporary folder and the Hub
client pointed at the in-process fake Hub, then start, refuse, stop, resume and push tiny runs through the page's
API endpoints, as a user's clicks would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from contextlib import contextmanager
from pathlib import Path

import gradio as gr
import pytest
import yaml

from app import live
from app.form import KNOBS, PROMPTS_TEXT, Form, build_config, preset_form, preset_options, weight_rows
from app.jobs import LOCK_NAME, JobControl, Placement, _group_alive
from jagg_core import metrics
from jagg_core.config import RunConfig, list_presets, load_config
from jagg_core.errors import UserError
from jagg_core.rundir import LORA_FILE, TRANSFORMER_2_LORA_FILE, RunDirectory
from tests.fake_hub_server import FakeHub

from conftest import HACKING_ALARM_LINE, add_judges

REPO = Path(__file__).resolve().parent.parent
TOKEN = "hf_appWriteToken1234567890"
# a tiny run that takes a few seconds per iteration on a shared CPU (the /start parameters are config keys)
FAST = {"sampling_num_steps": 4, "grpo_num_generations": 2, "grpo_prompts_per_iteration": 1,
        "prompts_eval_count": 2, "backward_window": 2, "sampling_resolution": 16, "prompt_file": None}
# Waits end on state (the awaited state, or the process doing the work gone); this cap only keeps a hung CI job
# from waiting forever, far beyond what a loaded machine needs.
SAFETY_CAP_S = 1800


# --- a served app ------------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def serve_app(runs_dir: Path, **env):
    """Run ``python app.py`` on a free port with its runs under ``runs_dir``; yield its URL. Any training job still
    running at the end is stopped."""
    port = _free_port()
    log = (runs_dir.parent / f"app-{port}.log").open("wb")
    environment = {**os.environ, "JAGG_RUNS_DIR": str(runs_dir), "GRADIO_SERVER_PORT": str(port),
                   "GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_DISABLE_TELEMETRY": "1", **env}
    server = subprocess.Popen([sys.executable, "app.py"], cwd=REPO, env=environment, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        cap = time.monotonic() + SAFETY_CAP_S
        while True:  # until the app answers, or its process has ended
            assert server.poll() is None, Path(log.name).read_text()[-3000:]
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                assert time.monotonic() < cap, f"the app did not answer within the {SAFETY_CAP_S} s safety cap"
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
        log.close()
        JobControl(runs_dir).stop(grace_s=10)


def wait_for(client, runs: Path, run: str, condition, what: str) -> dict:
    """Poll /status of ``run`` until ``condition(status)``, however long the job takes while it runs. Fail with the
    last status and the run's log tail once the job can no longer get there: its state is failed or interrupted,
    or the app no longer has it as its active job (its process ended) and a last look still misses the condition.
    Only :data:`SAFETY_CAP_S` ends the wait otherwise."""
    cap = time.monotonic() + SAFETY_CAP_S
    while True:
        status = client.predict(run, api_name="/status")
        if condition(status):
            return status
        ended = status["state"] in ("failed", "interrupted")
        if not ended and (not status["active"] or status["active_run"] != run):
            status = client.predict(run, api_name="/status")  # the job just ended: its final state is written
            if condition(status):
                return status
            ended = True
        if ended or time.monotonic() > cap:
            why = "the job ended first" if ended else f"still waiting after the {SAFETY_CAP_S} s safety cap"
            pytest.fail(f"waiting for {what}: {why}; last status {status}\n{live.log_tail(runs / run)}")
        time.sleep(0.5)


@pytest.fixture(scope="module")
def fake_hub():
    with FakeHub() as hub:
        hub.add_token(TOKEN, "alice")
        yield hub


@pytest.fixture(scope="module")
def served(tmp_path_factory, fake_hub):
    """(client, runs dir) of an app whose Hub is the fake one, with no token of its own."""
    from gradio_client import Client

    runs = tmp_path_factory.mktemp("app") / "runs"
    runs.mkdir()
    hf_home = runs.parent / "hf-home"
    env = {"HF_ENDPOINT": fake_hub.url, "HF_HOME": str(hf_home), "HF_TOKEN": ""}
    with serve_app(runs, **env) as url:
        yield Client(url, verbose=False), runs


# --- served: refusals ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, reason", [
    ({"grpo_num_generations": 1}, "bad value 1 for 'Group size': Input should be greater than or equal to 2"),
    ({"sampling_resolution": 30}, "resolution must be a multiple of 16, got 30"),
    ({"rewards": []}, "choose at least one reward"),
    ({"model": "./no/such/folder"}, "the model folder './no/such/folder' does not exist"),
    ({"prompt_mode": PROMPTS_TEXT, "prompt_text": "a cat\na dog"}, "'Eval prompts' is 2 but"),
    ({"model": "nobody/no-such-model"}, "cannot load model 'nobody/no-such-model'"),
    ({"train_learning_rate": None}, "'Learning rate' needs a value"),
    ({"model": "tiny-flux-kontext"}, "has no input image; give 'Prompt set' an image folder"),
])
def test_invalid_input_is_refused_with_the_reason_and_nothing_starts(served, fields, reason):
    client, runs = served
    message, _ = client.predict(**{**FAST, **fields}, api_name="/start")
    assert message.startswith("**Not started:**") and reason in message
    assert not any(runs.iterdir()), "a refused start must leave nothing behind"
    assert client.predict(api_name="/status")["active"] is False


def test_loading_a_preset_fills_the_form(served):
    client, _ = served
    values = dict(zip(["description", "name", "model", "rewards", "weights", "prompt_mode", "prompt_set",
                       *(k.key for k in KNOBS)], client.predict("sd35-medium-pickscore", api_name="/load_preset")))
    config = load_config(preset="sd35-medium-pickscore")
    assert (values["name"], values["model"], values["rewards"]) == (config.name, config.model.name, ["pickscore"])
    assert values["weights"]["data"] == [["pickscore", 1.0]] and values["prompt_set"] == config.prompts.source
    assert (values["train.iterations"], values["lora.rank"], values["train.mixed_precision"]) == (1000, 32, "bf16")


# --- served: a run's whole life -------------------------------------------------------------------------------------

def test_run_lifecycle_start_queue_stop_resume_finish_push(served, fake_hub):
    """Start a tiny run; a second start is queued (and taken out of the queue); a fresh JobControl (an app restart)
    finds the job; Stop keeps the last checkpoint; Resume continues it to the end; the push panel publishes it to the
    (fake) Hub."""
    client, runs = served
    total = 10
    message, run_update = client.predict(**FAST, train_iterations=total, train_checkpoint_every=1,
                                         train_sample_every=5, api_name="/start")
    assert message.startswith("Started"), message
    run = run_update["value"]
    run_dir = runs / run
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["iterations"] == total

    queued, queued_update = client.predict(**FAST, api_name="/start")
    waiting = queued_update["value"]
    assert queued == f"Queued `{waiting}` at position 1: it starts when `{run}` ends.", queued
    assert sorted(p.name for p in runs.iterdir() if p.is_dir()) == sorted([run, waiting])
    removed, words, _ = client.predict(waiting, api_name="/queue_remove")  # before Stop frees the machine for it
    assert removed == f"Took `{waiting}` out of the queue; Resume starts it." and words.startswith("No run is queued")
    job = JobControl(runs).active()  # what the app finds after a restart: the lock file names the live job
    assert job is not None and job.run_dir == run_dir and _group_alive(job.pgid)

    wait_for(client, runs, run, lambda s: s["state"] == "running" and s["checkpoints"], "a first checkpoint")
    stopped = client.predict(api_name="/stop")
    assert stopped.startswith(f"Stopped `{run}`")
    status = client.predict(run, api_name="/status")
    assert status["state"] == "stopped" and not status["active"] and status["checkpoints"], status
    assert 1 <= status["iteration"] < total
    assert not (runs / LOCK_NAME).exists() and not _group_alive(job.pgid)

    message, _ = client.predict(run, api_name="/resume")
    assert message == f"Resumed `{run}`."
    status = wait_for(client, runs, run, lambda s: s["state"] == "finished", "the resumed run to finish")
    assert status["iteration"] == status["total"] == total
    iterations = [row["iteration"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]
    assert iterations == list(range(total + 1))
    assert "resumed from iter_" in (run_dir / "train.log").read_text()
    assert (run_dir / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert RunDirectory(run_dir).sample_iterations() == [0, 5, total]
    prog = live.progress(run_dir)
    assert (prog.state, prog.iteration, prog.total) == ("finished", total, total)
    assert {"rollout", "train", "eval"} <= set(prog.phase_s) and all(v > 0 for v in prog.phase_s.values())
    assert re.search(r"An iteration costs rollout [\d.]+ s, train [\d.]+ s, (audit [\d.]+ s, )?eval [\d.]+ s "
                     r"\(each eval\)",
                     live.timing_words(prog))

    preview = client.predict(run, "iter_000010", "alice/app-lora", api_name="/card")  # what the push uploads
    assert preview.startswith("**Hub metadata:** `text-to-image` · tags `lora`, `diffusers`, `grpo`, `jagg`")
    assert "This is checkpoint iter_000010." in preview and 'pipe.load_lora_weights("alice/app-lora")' in preview
    assert "![Reward per iteration](data:image/jpeg;base64," in preview  # the card's images, in the preview too
    no_token = client.predict(run, "latest adapter", "alice/app-lora", "private", "", api_name="/push")
    assert no_token.startswith("**Not pushed:** no Hugging Face token")
    pushed = client.predict(run, "iter_000010", "alice/app-lora", "public", TOKEN, api_name="/push")
    assert pushed == f"**Pushed:** [{fake_hub.url}/alice/app-lora]({fake_hub.url}/alice/app-lora)"
    repo = fake_hub.repos["alice/app-lora"]
    assert not repo.private and "pytorch_lora_weights.safetensors" in repo.files
    assert live.card_preview(repo.files) == preview  # the preview showed this card, with these images


# --- the form ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", list(list_presets()))
def test_a_preset_form_builds_the_preset_config(preset, tmp_path):
    assert build_config(preset_form(preset), tmp_path).model_dump() == load_config(preset=preset).model_dump()


def test_form_values_become_config_values(tmp_path):
    form = preset_form("tiny-sd3")
    form.rewards = ["jpeg_compressibility", "jpeg_incompressibility"]
    form.weights = weight_rows(form.rewards, [["jpeg_compressibility", 0.25]])
    assert form.weights == [["jpeg_compressibility", 0.25], ["jpeg_incompressibility", 1.0]]
    form.prompt_mode, form.prompt_text = PROMPTS_TEXT, "\n".join(f"prompt {i}" for i in range(6))
    form.knobs.update({"train.optimizer": True, "backward.mode": "exact", "train.iterations": 7.0})
    config = build_config(form, tmp_path)
    assert [(r.name, r.weight) for r in config.rewards] == [("jpeg_compressibility", 0.25),
                                                           ("jpeg_incompressibility", 1.0)]
    assert config.prompts.source == str(tmp_path / "prompts.txt")
    assert (tmp_path / "prompts.txt").read_text().splitlines()[-1] == "prompt 5"
    assert (config.train.optimizer, config.backward.mode, config.train.iterations) == ("adamw8bit", "exact", 7)
    assert len({k.elem_id for k in KNOBS}) == len(KNOBS)


def test_the_judges_field_sets_the_judges_and_a_judge_the_preset_names_keeps_its_options(tmp_path):
    form = preset_form("flux-dev-hpsv2")
    assert form.knobs["eval.judges"] == ["aesthetic", "clip_score"]
    form.rewards, form.knobs["eval.judges"] = ["pickscore"], ["hpsv2", "vqa_score"]  # hpsv2: the preset's reward
    config = build_config(form, tmp_path)
    assert [(judge.name, judge.options) for judge in config.eval.judges] == [("hpsv2", {"version": "v2.1"}),
                                                                             ("vqa_score", {})]
    form.knobs["eval.judges"] = []
    assert build_config(form, tmp_path).eval.judges == []
    form.knobs["eval.judges"] = ["pickscore"]
    with pytest.raises(UserError, match="^'Judges': judge 'pickscore' is also a training reward"):
        build_config(form, tmp_path)


def test_a_reward_that_is_also_a_judge_with_other_options_keeps_each_its_own():
    data = {"rewards": [{"name": "clip_score", "options": {"model_id": "a/clip"}}, {"name": "pickscore"}],
            "eval": {"judges": [{"name": "clip_score", "options": {"model_id": "b/clip"}},
                                {"name": "hpsv2", "options": {"version": "v2.0"}}]}}
    assert preset_options(data, "rewards") == {"clip_score": {"model_id": "a/clip"}, "pickscore": {},
                                               "hpsv2": {"version": "v2.0"}}
    assert preset_options(data, "eval.judges") == {"clip_score": {"model_id": "b/clip"}, "pickscore": {},
                                                   "hpsv2": {"version": "v2.0"}}


def test_the_page_says_what_each_chosen_reward_scores():
    from app.form import reward_words
    from jagg_core.rewards.catalog import CATALOG
    assert reward_words(["pickscore", "motion", "nope"]).split("  \n") == [
        f"**pickscore**: {CATALOG['pickscore'].about}", f"**motion**: {CATALOG['motion'].about}"]
    assert reward_words([]) == reward_words(None) == ""


def test_form_refuses_a_bad_weight_and_an_unknown_reward(tmp_path):
    form = Form(preset="tiny-sd3", name="x", model="tiny-sd3", rewards=["jpeg_compressibility"],
                weights=[["jpeg_compressibility", "heavy"]], prompt_set="general")
    with pytest.raises(UserError, match="the weight of reward 'jpeg_compressibility' must be a number"):
        build_config(form, tmp_path)
    form.rewards, form.weights = ["no_such_reward"], []
    with pytest.raises(UserError, match="unknown reward 'no_such_reward'"):
        build_config(form, tmp_path)


# --- job control -------------------------------------------------------------------------------------------------

def test_a_stale_lock_is_cleared_and_the_silent_run_marked_failed(tmp_path):
    run_dir = tmp_path / "dead-20250101-000000"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("name: dead\n")
    (run_dir / "stdout.log").write_text("loading\njagg_core.run: error: unknown preset 'nope'\n")
    gone = subprocess.Popen(["true"], start_new_session=True)
    gone.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"run_dir": str(run_dir), "pid": gone.pid, "pgid": gone.pid,
                                                  "started_at": time.time(), "resumed": False}))
    jobs = JobControl(tmp_path)
    assert jobs.active() is None and not (tmp_path / LOCK_NAME).exists()
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "failed"
    assert status["message"] == "the training process ended: jagg_core.run: error: unknown preset 'nope'"
    assert jobs.runs() == [run_dir]
    assert live.status_words(run_dir, live.progress(run_dir)).startswith("**Failed.**")


def test_new_run_dirs_are_unique_and_listed_newest_first(tmp_path):
    jobs = JobControl(tmp_path)
    first, second = jobs.new_run_dir("my run!"), jobs.new_run_dir("my run!")
    assert first.name.startswith("my-run-") and second.name == first.name + "-2"
    for path in (first, second):
        (path / "config.yaml").write_text("name: x\n")
    assert jobs.runs() == [second, first]


def test_duration_words():
    assert [live.duration(s) for s in (None, 5, 75, 3725)] == ["–", "5 s", "1 min 15 s", "1 h 02 min"]


def test_the_status_names_the_trainers_phase_and_a_resumed_run_trains_from_its_first_iteration(tmp_path):
    run = RunDirectory(tmp_path / "r-20250101-000000")
    run.write_config("name: r\ntrain: {iterations: 10}\n")
    launched = time.time()
    assert live.progress(run.path, launched).state == "starting"  # the previous job's status, or none yet
    run.write_status("running", phase="loading", message="loading the model jagg-shapes")
    assert "Now: loading the model jagg-shapes" in live.status_words(run.path, live.progress(run.path, launched))
    run.write_status("running", phase="base eval", message="sampling the base model: base eval 16/64")
    assert live.progress(run.path, launched).state == "starting"
    run.write_status("running", iteration=5, phase="training", message="training iteration 6/10")  # resumed
    prog = live.progress(run.path, launched)
    assert (prog.state, prog.iteration) == ("running", 5)
    assert "**Training…**" in live.status_words(run.path, prog) and "iteration 6/10" in live.status_words(run.path, prog)


def test_a_failed_job_logs_its_one_line_error_without_the_launchers_traceback(tmp_path):
    from app.jobs import launch_command

    assert "--quiet" in launch_command(tmp_path, "no", resume=False)


def test_a_run_of_several_rewards_plots_each_rewards_signal_and_a_run_of_one_hides_the_plot(tmp_path):
    """The rewards' signal plot: a series per reward of its ``reward_spread``, shown for two rewards and hidden for
    one; a run of other rewards empties the page's plot first (it draws only its first series), then draws them."""
    from app.ui import _forget_shown, _spread_plot

    def run_of(name, spreads):
        run = RunDirectory(tmp_path / name)
        run.path.mkdir()
        run.append_metrics({metrics.ITERATION: 0, metrics.EVAL_REWARD_MEAN: 0.5})  # the base eval: no rollout
        for i, values in enumerate(spreads, start=1):
            run.append_metrics({metrics.ITERATION: i, **{metrics.reward_spread(k): v for k, v in values.items()}})
        return run.path

    two = run_of("two", [{"pickscore": 1.2, "clip_score": 0.01}, {"pickscore": 0.9, "clip_score": 0.02}])
    one = run_of("one", [{"shapes": 0.1}])
    frame = live.spread_curve(two)
    assert list(dict.fromkeys(frame["series"])) == ["pickscore", "clip_score"]
    assert {label: group["value"].tolist() for label, group in frame.groupby("series")} == {
        "pickscore": [1.2, 0.9], "clip_score": [0.01, 0.02]}
    assert frame[frame["series"] == "pickscore"]["iteration"].tolist() == [1, 2]

    seen = {}
    shown = _spread_plot(two, seen, "signature 1")
    assert shown["visible"] is True and shown["value"].equals(frame) and set(shown["color_map"]) == {"pickscore",
                                                                                                     "clip_score"}
    assert _spread_plot(two, seen, "signature 1") == gr.skip()  # the metrics did not change
    seen = _forget_shown(seen)  # the user picks the one-reward run
    assert _spread_plot(one, seen, "signature 2") == gr.update(value=None)  # emptied first
    assert _spread_plot(one, seen, "signature 2")["visible"] is False  # then drawn anew, hidden


def test_the_live_view_reads_the_judges_the_alarm_the_first_iteration_check_and_the_best_adapter(tmp_path):
    run = RunDirectory(tmp_path / "judged-20250101-000000")
    run.write_config(RunConfig().to_yaml())
    for i in range(5):
        run.append_metrics({metrics.ITERATION: i, **({metrics.EVAL_REWARD_MEAN: 0.5 + 0.05 * i} if i % 2 == 0 else {})})
    run.lora_dir.mkdir()
    run.lora_file.write_bytes(b"latest")
    (tmp_path / "best.safetensors").write_bytes(b"best")
    assert set(live.judge_curve(run.path)["series"]) == {"eval reward"}
    assert live.doctor_words(run.path) == "" and live.progress(run.path).alarm == ""
    assert live.adapter_choices(run.path) == [("latest adapter", "latest adapter")]
    assert live.chosen_adapter(run.path, "best") is None

    # a second judge that has not scored yet is a series already (the page's plot keeps its first series)
    add_judges(run.path, {"shapes_fidelity": {0: 0.6, 2: 0.9, 4: 0.7}, "aesthetic": {}}, best_iteration=2,
               adapter=tmp_path / "best.safetensors", alarm_iteration=4)
    frame = live.judge_curve(run.path)
    assert list(dict.fromkeys(frame["series"])) == ["eval reward", "judge shapes_fidelity", "judge aesthetic"]
    change = {label: group.dropna()["value"].round(6).tolist() for label, group in frame.groupby("series")}
    assert change == {"eval reward": [0.0, 0.1, 0.2], "judge shapes_fidelity": [0.0, 0.3, 0.1], "judge aesthetic": []}
    assert frame[frame["series"] == "eval reward"]["iteration"].tolist() == [0, 2, 4]

    words = live.status_words(run.path, live.progress(run.path))
    assert f"**⚠️ {HACKING_ALARM_LINE}**" in words and "judge shapes_fidelity fell" in words
    run.write_json(run.status_file, {"state": "finished"})  # a status without the alarm: the metrics' is shown
    assert live.progress(run.path).alarm == HACKING_ALARM_LINE

    doctor = live.doctor_words(run.path).splitlines()
    assert doctor[0] == "**First-iteration check** (iteration 1): 1 of 3 failed"
    assert doctor[2:] == ["- ✓ rewards vary within groups: std 0.12 within groups",
                          "- ✗ the gradient moves the velocity: the velocity moved 0.0  ",
                          "  **Fix:** raise 'Learning rate'",  # the page's field for train.learning_rate
                          "- – the JAGG audit agrees: no audit at iteration 1"]

    assert live.adapter_choices(run.path) == [("latest adapter", "latest adapter"),
                                              ("best (iteration 2, judge shapes_fidelity 0.900)", "best")]
    best, latest = live.chosen_adapter(run.path, "best"), live.chosen_adapter(run.path, "latest adapter")
    assert best.file.read_bytes() == b"best" and latest.file == run.lora_file
    assert (live.download_label(best), live.download_label(latest)) == ("Download best adapter", "Download adapter")
    assert live.download_file(best) == best.file and live.download_file(None) is None
    (run.best_dir / TRANSFORMER_2_LORA_FILE).write_bytes(b"best, low-noise expert")  # an adapter of both experts
    with zipfile.ZipFile(archive := live.download_file(live.chosen_adapter(run.path, "best"))) as bundle:
        assert archive.name == "best_adapter.zip"
        assert {name: bundle.read(name) for name in bundle.namelist()} == {
            LORA_FILE: b"best", TRANSFORMER_2_LORA_FILE: b"best, low-noise expert"}
    written = archive.stat().st_mtime_ns
    assert live.download_file(live.chosen_adapter(run.path, "best")) == archive  # up to date: not written again
    assert archive.stat().st_mtime_ns == written
    (run.best_dir / TRANSFORMER_2_LORA_FILE).write_bytes(b"newer")  # a newer adapter (whatever the clock's grain)
    os.utime(run.best_dir / TRANSFORMER_2_LORA_FILE, ns=(written + 10**9, written + 10**9))
    with zipfile.ZipFile(live.download_file(live.chosen_adapter(run.path, "best"))) as bundle:
        assert bundle.read(TRANSFORMER_2_LORA_FILE) == b"newer"
    assert [live.adapter_name(v) for v in ("latest adapter", None, "best", "iter_000002")] == [
        None, None, "best", "iter_000002"]


# --- the page's handlers, called directly (no server) ----------------------------------------------------------------
def _studio_values(name: str = "page") -> list:
    """The set-up form's values (``START_PARAMS``'s order) of the default preset, a tiny run named ``name``."""
    from app.ui import FORM_FIELDS
    from jagg_core.config import DEFAULT_PRESET

    form = preset_form(DEFAULT_PRESET)
    fields = {"preset": DEFAULT_PRESET, "name": name, "model": form.model, "rewards": form.rewards,
              "weights": form.weights, "prompt_mode": form.prompt_mode, "prompt_set": form.prompt_set,
              "prompt_file": None, "prompt_text": "", "eval_text": ""}
    return [fields[f] for f in FORM_FIELDS] + [form.knobs[k.key] for k in KNOBS]


@pytest.fixture
def studio(tmp_path, monkeypatch):
    """A Studio on ``tmp_path`` whose launches only record their arguments (no training process)."""
    from app.ui import Studio

    page = Studio(tmp_path)
    page.launched = []
    monkeypatch.setattr(page.jobs, "launch", lambda run_dir, precision, resume=False, placement=None:
                        page.launched.append((run_dir.name, resume, placement)))
    return page


def test_the_first_download_is_a_bar_on_the_page_and_start_says_what_is_left(tmp_path, studio, monkeypatch):
    from jagg_core.download import DownloadPlan, HubFile

    run = RunDirectory(tmp_path / "dl-20250101-000000")
    run.write_config("name: dl\ntrain: {iterations: 10}\n")
    launched = time.time()
    line = "downloading owner/model: 3.2 of 23.8 GB, 41 MB/s, about 8 min left"
    run.write_status("running", phase="downloading", message=line,
                     download={"done": 3_200_000_000, "total": 23_800_000_000, "rate": 41_000_000})
    prog = live.progress(run.path, launched)
    assert prog.state == "starting" and prog.download["total"] == 23_800_000_000
    assert f"Now: {line}" in live.status_words(run.path, prog)
    bar = live.progress_bar(prog.iteration, prog.total, prog.download, prog.message)
    assert 'value="3200000000" max="23800000000"' in bar and line in bar
    run.write_status("running", phase="loading", message="loading the model", download=None)
    assert live.progress(run.path, launched).download is None
    assert "0 / 10 iterations" in live.progress_bar(0, 10, None)

    plan = DownloadPlan("owner/model", "c0ffee", (HubFile("a.safetensors", 23_800_000_000, "b1", 0, False),
                                                   HubFile("model_index.json", 500, "b2", 500, True)))
    monkeypatch.setattr("app.form.check_references", lambda config, disk: plan)
    message, _ = studio.start(*_studio_values())
    assert message.startswith("Started `page-") and "the base model owner/model: 23.8 GB to download first" in message
    monkeypatch.setattr("app.form.check_references", lambda config, disk: None)
    assert "to download" not in studio.start(*_studio_values())[0]


def test_start_while_a_run_trains_queues_the_run_and_the_queue_block_reorders_and_empties_it(tmp_path, studio,
                                                                                              monkeypatch):
    import threading

    from app.jobs import Job
    from app.ui import build_app

    monkeypatch.setattr("app.form.check_references", lambda config, disk: None)
    busy = RunDirectory(tmp_path / "busy-20250101-000000")
    busy.write_config("name: busy\n")
    monkeypatch.setattr(studio.jobs, "active", lambda: Job(busy.path, 1, 1, time.time(), False))
    first, _ = studio.start(*_studio_values("first"))
    second, chosen = studio.start(*_studio_values("second"))
    assert studio.launched == []  # nothing launched: both wait
    names = studio.jobs.queue.names()
    assert first == f"Queued `{names[0]}` at position 1: it starts when `{busy.path.name}` ends."
    assert second.startswith(f"Queued `{names[1]}` at position 2: it starts when `{busy.path.name}` ends and the 1")
    assert chosen["value"] == names[1]
    assert RunDirectory(tmp_path / names[1]).read_config()["name"] == "second"  # written and checked as Start does
    assert "**Queued (position 2).**" in live.status_words(tmp_path / names[1], live.progress(tmp_path / names[1]))

    refreshed = studio.refresh(names[1], "latest adapter", {}, names[1])
    assert refreshed[-3] == f"1. `{names[0]}`\n2. `{names[1]}`" and "value" not in refreshed[-2]  # the pick stays
    assert studio.refresh(names[1], "latest adapter", {}, "gone")[-2]["value"] == names[0]

    message, words, pick = studio.queue_up(names[1])
    assert message == f"`{names[1]}` is at position 1." and words.startswith(f"1. `{names[1]}`")
    assert studio.jobs.queue.names() == [names[1], names[0]] and pick["value"] == names[1]
    studio.queue_down(names[1])
    assert studio.jobs.queue.names() == names
    assert studio.queue_up("nothing")[0] == "**Not moved:** nothing is not queued"

    monkeypatch.setenv("SPACE_ID", "owner/space")  # only the owner controls the queue there
    assert studio.queue_remove(names[0])[0].startswith("**Not removed:** only the Space's owner")
    assert studio.queue_up(names[1])[0].startswith("**Not moved:** only the Space's owner")
    monkeypatch.delenv("SPACE_ID")
    message, words, _ = studio.queue_remove(names[0])
    assert message == f"Took `{names[0]}` out of the queue; Resume starts it." and words == f"1. `{names[1]}`"
    assert live.progress(tmp_path / names[0]).state == "stopped"

    studio.delete(names[1])  # a queued run deleted leaves the queue too
    assert studio.jobs.queue.names() == [] and not (tmp_path / names[1]).exists()
    assert studio.queue_view()[0].startswith("No run is queued.")

    build_app(tmp_path)  # the page starts the queue's worker
    assert any(thread.name == "run-queue" for thread in threading.enumerate())


def test_the_events_that_share_what_the_page_shows_run_one_at_a_time(tmp_path):
    """The timer's refresh, the page's load, a picked run and a picked adapter all read and write the page's record of
    what it shows. Were two to run at once, the later to finish would put back a record the other had changed: a plot
    emptied to be drawn anew, but marked drawn, stays empty."""
    from app.ui import build_app

    demo = build_app(tmp_path)
    shared = [fn for fn in demo.fns.values() if any(isinstance(block, gr.State) for block in (*fn.inputs, *fn.outputs))]
    assert {target[1] for fn in shared for target in fn.targets} == {"tick", "load", "input", "then"}
    assert len(shared) == 5 and {(fn.concurrency_id, fn.concurrency_limit) for fn in shared} == {("live", 1)}


def test_a_refresh_answered_after_the_user_picks_another_run_does_not_put_the_old_pick_back(tmp_path, studio):
    old, new = (RunDirectory(tmp_path / name) for name in ("old-20250101-000000", "new-20250102-000000"))
    old.write_config("name: old\n")
    tick = studio.refresh(old.path.name, "latest adapter", {})  # a timer tick, sent while `old` was picked ...
    new.write_config("name: new\n")  # ... answers after a run appeared and the user picked it
    run_select = studio.refresh(old.path.name, "latest adapter", tick[-1])[0]
    assert run_select == {"__type__": "update", "choices": [new.path.name, old.path.name]}  # no value: the pick stays
    adapters = studio.refresh(old.path.name, "latest adapter", {})[19]  # Publish's adapter dropdown, kept as well
    assert "value" not in adapters and studio.refresh(old.path.name, "gone", {})[19]["value"] == "latest adapter"
    assert studio.refresh(None, "latest adapter", {})[0]["value"] == new.path.name  # a page with no pick gets one
    shutil.rmtree(new.path)
    assert studio.refresh(new.path.name, "latest adapter", {})[0]["value"] == old.path.name  # a vanished pick, too


def test_the_processes_field_places_start_resume_and_the_queue(tmp_path, studio, monkeypatch):
    from app.jobs import Job, queued_placement

    monkeypatch.setattr("app.form.check_references", lambda config, disk: None)
    monkeypatch.setattr("app.ui.process_choices", lambda: (1, 4))
    message, _ = studio.start(*_studio_values(), 2)  # no GPU here: data parallel over the CPU's cores
    name, resumed, placement = studio.launched[-1]
    assert placement == Placement(2) and message == f"Started `{name}` (2 processes, data parallel)."
    studio.start(*_studio_values(), 9)
    assert studio.launched[-1][2] == Placement(4)  # at most the machine's most
    studio.start(*_studio_values())
    assert studio.launched[-1][2] == Placement(1)  # left out: the default

    run = RunDirectory(tmp_path / name)
    run.write_run_info("shapes", "jagg-shapes", "cpu", processes=2)
    run.write_status("stopped")
    assert studio.run_processes(name)["value"] == 2  # the field takes the run's count when the run is chosen
    studio.resume(name)
    assert studio.launched[-1] == (name, True, Placement(2))  # as many as before
    message, _ = studio.resume(name, 1)
    assert studio.launched[-1] == (name, True, Placement(1)) and "it trained on 2 before" in message

    busy = RunDirectory(tmp_path / "busy-20250101-000000")
    busy.write_config("name: busy\n")
    monkeypatch.setattr(studio.jobs, "active", lambda: Job(busy.path, 1, 1, time.time(), False))
    studio.start(*_studio_values("later"), 3)
    assert queued_placement(tmp_path / studio.jobs.queue.names()[0]) == Placement(3)  # the queue launches with it
    assert queued_placement(busy.path) == Placement()


#: what ``nvidia-smi --query-gpu=name,memory.free,memory.total,utilization.gpu --format=csv,noheader,nounits`` prints
#: on a machine of two L4s, GPU 0 with 8 GiB free, GPU 1 idle
FAKE_NVIDIA_SMI = """#!/bin/sh
echo "NVIDIA L4, 8192, 23034, 3"
echo "NVIDIA L4, 22000, 23034, 0"
"""


def test_without_a_gpu_the_machine_line_names_the_cpu(monkeypatch):
    from app import system
    monkeypatch.setattr(system, "gpu_rows", lambda: [])
    monkeypatch.setattr(system, "cpu_name", lambda: "AMD EPYC 7B13 64-Core Processor")
    assert re.fullmatch(r"\*\*No CUDA GPU:\*\* runs train on the CPU \(AMD EPYC 7B13 64-Core Processor, \d+ cores, "
                        r"\d+% busy, [\d.]+ / [\d.]+ GiB memory free\)", system.hardware_words()), system.hardware_words()
    monkeypatch.setattr(system, "cpu_name", lambda: "CPU")  # Linux names none
    assert re.match(r"\*\*No CUDA GPU:\*\* runs train on the CPU \(\d+ cores, ", system.hardware_words())


def test_the_page_reads_the_gpus_from_nvidia_smi_and_plans_and_places_runs_against_their_free_memory(tmp_path, studio,
                                                                                                   monkeypatch):
    """The machine line, the default processes (the free GPUs), Plan memory's verdict and Start's placement all come
    from nvidia-smi's figures, never from torch (whose CUDA query would keep a context in the page's process)."""
    from app.system import hardware_words, process_choices

    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (tools / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr("app.form.check_references", lambda config, disk: None)
    assert hardware_words() == ("**GPU 0:** NVIDIA L4 · 8.0 / 22.5 GiB free · 3% busy  \n"
                                "**GPU 1:** NVIDIA L4 · 21.5 / 22.5 GiB free · 0% busy")
    assert process_choices() == (1, 2)
    verdict = studio.plan(*_studio_values()).splitlines()[0]
    assert re.fullmatch(r"\*\*fits: planned peak \d+\.\d GB \+ 0\.55 GB CUDA context of 8\.6 GB\*\*", verdict), verdict
    import jagg_core.memory_plan
    plans = []
    monkeypatch.setattr(jagg_core.memory_plan, "plan_memory",
                        lambda config, real=jagg_core.memory_plan.plan_memory: plans.append(real(config)) or plans[-1])
    message, _ = studio.start(*_studio_values(), 2)
    assert studio.launched[-1][2] == Placement(2) and "fits each GPU (8.6 GB free)" in message, message
    assert len(plans) == 1  # Start plans once, for its warning and for the placement


def test_try_it_and_evaluate_load_the_model_on_the_gpu_with_the_most_free_memory(tmp_path, studio, monkeypatch):
    """Not GPU 0, where a run trains first: the second L4 of the fake nvidia-smi, numbered as nvidia-smi lists them;
    a CUDA_VISIBLE_DEVICES the page was started with, or a single GPU, leaves the processes' environment alone."""
    import subprocess

    from app import system, ui

    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "nvidia-smi").write_text(FAKE_NVIDIA_SMI)
    (tools / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    launched, run = [], subprocess.run

    def refused(command, **options):  # the commands' processes; nvidia-smi's runs
        if command[0] != sys.executable:
            return run(command, **options)
        launched.append(options["env"])
        return subprocess.CompletedProcess(command, 2, "", f"{command[2]}: error: the GPU has 0.5 GB free")
    monkeypatch.setattr(ui.subprocess, "run", refused)
    (tmp_path / "a-run").mkdir()
    (tmp_path / "a-run" / "config.yaml").write_text("name: a-run\n")
    assert studio.generate("a-run", "", "a red square", 0) == (
        None, "**Not generated:** the GPU has 0.5 GB free")
    assert studio.evaluate("a-run", "", None, 2, 1)[1] == "**Not evaluated:** the GPU has 0.5 GB free"
    assert [(env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]) for env in launched] == [("1", "PCI_BUS_ID")] * 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert system.sampling_environment()["CUDA_VISIBLE_DEVICES"] == "3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(system, "gpu_rows", lambda: [["NVIDIA L4", "8192", "23034", "3"]])
    assert "CUDA_VISIBLE_DEVICES" not in system.sampling_environment()

def test_the_compare_section_overlays_tabulates_and_shows_the_grids_of_the_chosen_runs(tmp_path, studio):
    from tests.test_compare import fabricated_run

    fabricated_run(tmp_path, "nft-run", {0: 0.70, 5: 0.74, 10: 0.78}, {0: 0.9, 5: 0.9, 10: 0.85}, 6.0, "nft")
    fabricated_run(tmp_path, "grpo-run", {0: 0.70, 10: 0.80, 20: 0.82}, {0: 0.9, 10: 0.91, 20: 0.92}, 12.0,
                   colour="blue")
    hint, plot, table, _, iterations, grids = studio.compare(["nft-run"], "iterations", "held-out reward")
    assert hint == "Choose two or more runs to compare them." and table == "" and grids == []

    hint, plot, table, metric, iterations, grids = studio.compare(["nft-run", "grpo-run"], "iterations", None)
    assert hint == "" and plot["x"] == "iteration"
    frame = plot["value"]
    assert frame[frame["run"] == "nft-run"]["value"].tolist() == [0.70, 0.74, 0.78]
    assert set(frame["run"]) == {"nft-run", "grpo-run"} and set(frame["metric"]) == {"held-out reward"}
    assert "| `nft-run` | nft |" in table and "| `grpo-run` | grpo |" in table
    assert metric["choices"] == ["held-out reward", "judge fidelity"]
    assert iterations["choices"] == [0, 10] and iterations["value"] == 10
    assert [caption for _, caption in grids] == ["nft-run · iteration 10", "grpo-run · iteration 10"]

    _, plot, *_ = studio.compare(["nft-run", "grpo-run"], "training minutes", "judge fidelity")
    assert plot["x"] == "minutes"
    assert plot["value"][plot["value"]["run"] == "grpo-run"]["value"].tolist() == [0.9, 0.91, 0.92]
    assert [c for _, c in studio.compare_grids(["nft-run", "grpo-run"], 0)][0] == "nft-run · iteration 0"

    RunDirectory(tmp_path / "empty-run").write_config("name: empty\n")
    assert studio.compare(["nft-run", "empty-run"], "iterations", None)[0].startswith("**Cannot compare:** empty-run")
