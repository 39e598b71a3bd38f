"""Nothing lost, nothing escapes: kills at the weak moments, one trainer per run, one-line errors, a page that keeps
callers inside the runs root. Kills are injected deterministically (hooks in the process), never timed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from app import live
from app.form import PROMPTS_BUILTIN, PROMPTS_UPLOAD, Form, build_config, preset_form
from app.jobs import JobControl
from jagg_core import metrics
from jagg_core.errors import UserError
from jagg_core.rundir import RunDirectory

from conftest import ROOT, run_cli
from zygote import run_python

ARGS = ["--preset", "tiny-sd3", "--set", "train.iterations=3", "--set", "sampling.num_steps=4",
        "--set", "grpo.num_generations=2", "--set", "grpo.prompts_per_iteration=1", "--set", "prompts.eval_count=2",
        "--set", "sampling.resolution=16", "--set", "train.sample_every=1", "--set", "train.checkpoint_every=1",
        "--set", "backward.window=2", "--set", "train.lr_scheduler=cosine", "--set", "train.lr_warmup_steps=1",
        "--set", "train.ema_decay=0.5"]  # the schedule and the EMA must resume exactly too
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}

#: Runs ``jagg_core.run`` with one fault: ``HOOK:N`` kills the process (SIGKILL) right after the metrics row of
#: iteration N is appended, or inside the checkpoint of iteration N before it is renamed into place; ``disk-full:N``
#: makes that checkpoint's write fail with ENOSPC; ``gpu-oom:N`` makes iteration N's rollout raise torch's CUDA
#: out-of-memory error; ``startup-kill`` and ``startup-term`` send SIGKILL / SIGTERM while the model loads, before the
#: run has a status.
#: torch's message when a CUDA allocation fails (on a 24 GB card)
OUT_OF_MEMORY = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.57 GiB of which "
                 "1.06 GiB is free. Including non-PyTorch memory, this process has 22.50 GiB memory in use.")
INJECT = f"OUT_OF_MEMORY = {OUT_OF_MEMORY!r}" + """
import os, signal, sys
from jagg_core import rundir
hook, _, at = sys.argv[1].partition(":")
at = int(at or 0)
def die(signum=signal.SIGKILL):
    os.kill(os.getpid(), signum)
if hook == "after-metrics":
    append = rundir.RunDirectory.append_metrics
    def patched(self, row):
        append(self, row)
        if row["iteration"] == at:
            die()
    rundir.RunDirectory.append_metrics = patched
elif hook == "disk-full":
    import errno
    write = rundir.RunDirectory.write_checkpoint
    def patched(self, iteration, contents, keep):
        def full(folder):
            (folder / "partial.bin").write_bytes(b"half")
            if iteration == at:
                raise OSError(errno.ENOSPC, "No space left on device")
            contents(folder)
        return write(self, iteration, full, keep)
    rundir.RunDirectory.write_checkpoint = patched
elif hook == "in-checkpoint":
    write = rundir.RunDirectory.write_checkpoint
    def patched(self, iteration, contents, keep):
        def half(folder):
            contents(folder)
            if iteration == at:
                die()
        return write(self, iteration, half, keep)
    rundir.RunDirectory.write_checkpoint = patched
elif hook == "gpu-oom":
    import torch
    import jagg_core.trainer as trainer
    rollout = trainer.Trainer.rollout
    def patched(self, iteration):
        if iteration == at:
            raise torch.OutOfMemoryError(OUT_OF_MEMORY)
        return rollout(self, iteration)
    trainer.Trainer.rollout = patched
else:
    import jagg_core.trainer as trainer
    load = trainer.load_flow_model
    def patched(*args, **kwargs):
        die(signal.SIGTERM if hook == "startup-term" else signal.SIGKILL)
        return load(*args, **kwargs)
    trainer.load_flow_model = patched
from jagg_core.run import main
sys.exit(main(sys.argv[2:]))
"""


def run(run_dir: Path, *extra: str, hook: str | None = None, base: list[str] = ARGS) -> subprocess.CompletedProcess:
    args = [*base, "--output-dir", str(run_dir), *extra]
    return run_python(["-c", INJECT, hook, *args], cwd=ROOT, env=ENV) if hook else run_cli(*args)


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(RunDirectory(run_dir).lora_file)


@pytest.fixture(scope="module")
def unkilled(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    result = run(run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.mark.parametrize("hook, damage", [
    ("after-metrics:0", None),       # the base eval row is written, no checkpoint yet
    ("after-metrics:2", None),       # iteration 2's row is written, its checkpoint not
    ("in-checkpoint:2", None),       # killed inside the checkpoint of iteration 2
    ("startup-kill", None),          # killed while loading, before any status
    ("after-metrics:3", "optimizer"),  # and then the latest checkpoint (2) is damaged: resume falls back to 1
])
def test_every_kill_then_resume_gives_each_row_once_and_the_unkilled_adapter(unkilled, tmp_path, hook, damage):
    run_dir = tmp_path / "run"
    killed = run(run_dir, hook=hook)
    assert killed.returncode == -9, killed.stderr[-3000:]
    if damage:
        latest = RunDirectory(run_dir).latest_checkpoint()
        (latest / "optimizer.pt").write_bytes(b"not a torch file")
    resumed = run(run_dir, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rundir = RunDirectory(run_dir)
    assert [row[metrics.ITERATION] for row in rundir.read_metrics()] == [0, 1, 2, 3]
    assert rundir.read_status()["state"] == "finished"
    if damage:
        assert "checkpoint iter_000002 is damaged" in resumed.stdout + resumed.stderr
        assert "resumed from iter_000001" in resumed.stdout + resumed.stderr
    expected, got = adapter(unkilled), adapter(run_dir)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name]


@pytest.mark.parametrize("algorithm", ["nft", "awm"])
def test_a_killed_forward_process_run_resumes_to_the_unkilled_adapter(algorithm, tmp_path):
    """The lagging policy (NFT's old policy, AWM's EMA regularizer) and the rows' draws resume exactly too."""
    window = ARGS.index("backward.window=2")  # a GRPO key: refused under another algorithm
    base = [*ARGS[:window - 1], *ARGS[window + 1:], "--set", f"train.algorithm={algorithm}"]
    if algorithm == "awm":  # its steps fit the 4-step schedule
        base += ["--set", "awm.train_timesteps=2"]
    straight = run(tmp_path / "straight", base=base)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = run(tmp_path / "run", hook="after-metrics:2", base=base)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run(tmp_path / "run", "--resume", base=base)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [row[metrics.ITERATION] for row in RunDirectory(tmp_path / "run").read_metrics()] == [0, 1, 2, 3]
    expected, got = adapter(tmp_path / "straight"), adapter(tmp_path / "run")
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_a_full_disk_fails_in_one_line_cleans_up_and_resumes_to_the_unkilled_adapter(unkilled, tmp_path):
    run_dir = tmp_path / "run"
    full = run(run_dir, hook="disk-full:2")
    lines = full.stderr.strip().splitlines()
    assert full.returncode == 2 and "Traceback" not in full.stderr, full.stderr[-3000:]
    assert lines[-1].startswith("jagg_core.run: error: the disk holding") and "--resume" in lines[-1]
    status = RunDirectory(run_dir).read_status()
    assert status["state"] == "failed" and "No space left on device" in status["message"]
    assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name]
    resumed = run(run_dir, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [row[metrics.ITERATION] for row in RunDirectory(run_dir).read_metrics()] == [0, 1, 2, 3]
    expected, got = adapter(unkilled), adapter(run_dir)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_out_of_gpu_memory_fails_in_one_line_naming_the_plan_that_says_what_fits_and_the_resume(tmp_path):
    run_dir = tmp_path / "run"
    failed = run(run_dir, hook="gpu-oom:2")
    assert failed.returncode == 2 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    line = failed.stderr.strip().splitlines()[-1]
    assert line.startswith("jagg_core.run: error: out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB. "
                           "GPU 0 has a total capacity of 23.57 GiB of which 1.06 GiB is free); "), line
    plan_command = f"python -m jagg_core.run --resume --output-dir {run_dir} --plan"
    assert f"`{plan_command}` shows the run's planned peak" in line and "--set KEY=VALUE" in line
    status = RunDirectory(run_dir).read_status()
    assert status["state"] == "failed" and status["message"] == line.removeprefix("jagg_core.run: error: ")
    assert RunDirectory(run_dir).checkpoint_iterations() == [1]  # iteration 1's adapter is kept to resume from
    planned = run(run_dir, "--resume", "--plan")  # the command the line names works on the failed run
    assert planned.returncode == 0 and "planned peak" in planned.stdout, planned.stderr[-3000:]


@pytest.mark.parametrize("error, cudnn_attention, says", [
    (RuntimeError("Expected mha_graph.execute(handle, variant_pack, workspace_ptr.get()).is_good() to be true, but "
                  "got false.  (Could this error message be improved?  If so, please report an enhancement request "
                  "to PyTorch.)"), True,
     "a GPU kernel failed with cuDNN attention on (Expected mha_graph.execute(handle, variant_pack, "
     "workspace_ptr.get()).is_good() to be true, but got false.); model.cudnn_attention: true made FLUX.1-dev's "
     "backward fail on an H200, and its default is false: resume with `python -m jagg_core.run --resume "
     "--output-dir runs/r --set model.cudnn_attention=false`"),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), True, "with cuDNN attention on"),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False, None),  # not the config's doing
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), True, None),
    (ValueError("CUDA error"), True, None),
])
def test_a_gpu_failure_the_config_can_fix_is_one_line_and_others_keep_their_traceback(error, cudnn_attention, says):
    from jagg_core.errors import fixable_gpu_failure
    line = fixable_gpu_failure(error, Path("runs/r"), cudnn_attention)
    assert line is None if says is None else says in line, line


def test_sigterm_during_start_up_ends_stopped_with_exit_143(tmp_path):
    result = run(tmp_path / "run", hook="startup-term")
    assert result.returncode == 143 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert RunDirectory(tmp_path / "run").read_status()["state"] == "stopped"


def test_a_run_held_by_a_live_trainer_is_refused_and_shown_running(tmp_path):
    run_dir = tmp_path / "runs" / "busy"
    held = RunDirectory(run_dir)
    held.acquire_trainer_lock()  # this test process plays the trainer started elsewhere
    held.write_config("name: busy\ntrain: {iterations: 3}\n")
    held.write_status("running", pid=os.getpid(), iteration=1, total_iterations=3)
    before = held.status_file.read_text()
    try:
        result = run(run_dir, "--resume")
        assert result.returncode == 2 and "is being trained by another process" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and held.status_file.read_text() == before
        assert live.progress(run_dir).state == "running"
        assert JobControl(run_dir.parent).trained_elsewhere() == run_dir
    finally:
        held._lock.close()
    assert live.progress(run_dir).state == "interrupted"  # the lock went with its holder


@pytest.mark.parametrize("setup, args, message", [
    (lambda d: (d / "c.yaml").write_bytes(b"\xff\xfe\x00\x01garbage"), ["--config", "{d}/c.yaml"],
     "is not a UTF-8 text file"),
    (lambda d: (d / "c.yaml").write_bytes("name: x".encode("utf-16")), ["--config", "{d}/c.yaml"],
     "is not a UTF-8 text file"),
    (None, ["--set", "train.seed=1180591620717411303424"], "for 'train.seed'"),
    (None, ["--set", "train.learning_rate=inf"], "for 'train.learning_rate': Input should be a finite number"),
    (None, ["--set", "rewards=[{name: shapes, weight: .nan}]"], "for 'rewards.0.weight'"),
    (None, ["--set", "rewards=[{name: http, options: {url: 5}}]"], "bad value 5 for options.url of reward 'http'"),
    (None, ["--set", "rewards=[{name: http, options: {url: 'http://x', timeout: abc}}]"], "options.timeout"),
    (lambda d: (d / "file").write_text("x"), ["--output-dir", "{d}/file"], "is a file"),
    (lambda d: (d / "empty").mkdir(), ["--resume", "--output-dir", "{d}/empty"], "holds no run to resume"),
    (lambda d: (d / "model").mkdir() or (d / "model" / "model_index.json").write_text("{oops"),
     ["--set", "model.name={d}/model", "--output-dir", "{d}/run"], "is not valid JSON"),
    (lambda d: (d / "model").mkdir() or (d / "model" / "model_index.json").write_text("[1, 2]"),
     ["--set", "model.name={d}/model", "--output-dir", "{d}/run"], "is not a diffusers model_index.json"),
    (lambda d: (d / "bad.safetensors").write_bytes(b"garbage"),
     ["--set", "lora.init_lora={d}/bad.safetensors", "--output-dir", "{d}/run"], "is not a readable diffusers LoRA"),
    (None, ["--set", "prompts.source=edits", "--output-dir", "{d}/run"],  # before a text-to-image run on their texts
     "prompts.source holds image-editing rows (an instruction and an input image), but the SD3/SD3.5 run "
     "generates from text alone; choose a text prompt set, or an image-editing model.name (FLUX.1 Kontext, "
     "Qwen-Image-Edit, Qwen-Image-Edit-2509/2511; or FLUX.2 [klein] or FLUX.2 [dev] or Wan 2.2 TI2V-5B with "
     "model.input_images=1), or an image-to-video one (Wan 2.1 / Wan 2.2 A14B image-to-video)"),
    (None, ["--set", "model.name=random:flux-dev@1", "--set", "model.flow_shift=3", "--output-dir", "{d}/run"],
     "model.flow_shift sets a fixed schedule shift, but 'random:flux-dev@1' shifts its schedule with the image size"),
    (None, ["--set", "model.name=tiny-flux-kontext", "--output-dir", "{d}/run"],  # before the model loads
     "the FLUX.1 Kontext model edits images, but the prompt 'a gouache painting"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, setup, args, message):
    if setup:
        setup(tmp_path)
    args = [a.replace("{d}", str(tmp_path)) for a in args]
    if "--config" not in args and "--resume" not in args:
        args = ["--preset", "tiny-sd3", *args]
    result = run_cli(*args, "--set", "train.iterations=1")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and message in lines[-1] and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert lines[-1].startswith("jagg_core.run: error: ")


# --- the page: callers stay inside the runs root ------------------------------------------------------------------

@pytest.fixture
def root(tmp_path):
    root = tmp_path / "runs"
    RunDirectory(root / "mine").write_config("name: mine\n")
    RunDirectory(tmp_path / "outside").write_config("name: outside\n")
    (root / "link").symlink_to(tmp_path / "outside")
    return root


@pytest.mark.parametrize("name", ["..", ".", "../outside", "link", "/etc", "x" * 10_000, "mine/../..", ""])
def test_run_names_resolve_inside_the_runs_root_only(root, name):
    assert JobControl(root).run_dir(name) is None
    assert JobControl(root).run_dir("mine") == root / "mine"


def test_the_runs_list_holds_only_runs_the_page_can_use(root):
    """A link in the runs root, even to a run, is not listed (every action on it would be refused)."""
    assert JobControl(root).runs() == [root / "mine"]


def test_a_run_killed_while_its_model_loads_resumes(tmp_path):
    """The resolved config is written before the model loads, so ``--resume`` works from the first second."""
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "jagg_core.run", "--preset", "tiny-sd3", "--output-dir",
                                str(run_dir), "--set", "train.iterations=1"], cwd=ROOT, env=ENV,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run = RunDirectory(run_dir)
    while process.poll() is None and not run.is_run():
        time.sleep(0.005)
    phase = run.read_status().get("phase")
    process.kill()
    process.wait()
    assert phase == "loading" and run.is_run() and not run.read_metrics()
    resumed = run_cli("--resume", "--output-dir", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert run.read_status()["state"] == "finished"


def test_long_names_make_a_short_run_folder(root):
    folder = JobControl(root).new_run_dir("x" * 10_000)
    assert folder.parent == root and len(folder.name) <= 120


def form(**changes) -> Form:
    base = preset_form("tiny-sd3")
    return Form(**{**base.__dict__, **changes})


@pytest.mark.parametrize("changes, message", [
    ({"prompt_mode": PROMPTS_BUILTIN, "prompt_set": "/etc/hostname"}, "the prompt set must be one of"),
    ({"prompt_mode": PROMPTS_BUILTIN, "prompt_set": str(ROOT / "README.md")}, "the prompt set must be one of"),
    ({"prompt_mode": PROMPTS_UPLOAD, "prompt_file": str(ROOT / "presets" / "prompts" / "general.txt")},
     "must be a file uploaded through the page"),
])
def test_server_files_cannot_be_named_as_prompts(tmp_path, changes, message):
    with pytest.raises(UserError, match=message):
        build_config(form(**changes), tmp_path)
    assert not list(tmp_path.iterdir())


def test_prompt_files_in_an_allowed_folder_are_accepted(tmp_path, monkeypatch):
    prompts = tmp_path / "allowed" / "mine.txt"
    prompts.parent.mkdir()
    prompts.write_text("\n".join(f"prompt {i}" for i in range(20)))
    monkeypatch.setenv("JAGG_PROMPT_DIRS", str(prompts.parent))
    assert build_config(form(prompt_set=str(prompts)), tmp_path).prompts.source == str(prompts)


def test_malformed_numbers_are_clean_messages(tmp_path):
    with pytest.raises(UserError, match="'Iterations' must be a number, got 'abc'"):
        build_config(form(knobs={**preset_form("tiny-sd3").knobs, "train.iterations": "abc"}), tmp_path)


# --- the page on a Space: only its owner (and listed users) control jobs ------------------------------------------

def test_access_is_open_locally_and_owner_only_on_a_space(monkeypatch):
    from app.access import refusal

    monkeypatch.delenv("SPACE_ID", raising=False)
    assert refusal(None) is None and refusal("anyone") is None
    monkeypatch.setenv("SPACE_ID", "alice/studio")
    monkeypatch.delenv("SPACE_AUTHOR_NAME", raising=False)
    assert refusal("alice") is None
    assert "you are not signed in" in refusal(None) and "signed in as bob" in refusal("bob")
    monkeypatch.setenv("JAGG_ALLOWED_USERS", "bob, carol")
    assert refusal("bob") is None and refusal("carol") is None and refusal("mallory")


def test_strangers_on_a_space_can_watch_but_not_control(tmp_path):
    import requests
    from gradio_client import Client
    from test_app import serve_app

    runs = tmp_path / "runs"
    runs.mkdir()
    space = {"SYSTEM": "spaces", "SPACE_ID": "alice/studio", "SPACE_AUTHOR_NAME": "alice",  # what a Space sets,
             "OAUTH_CLIENT_ID": "id", "OAUTH_CLIENT_SECRET": "secret", "OAUTH_SCOPES": "openid profile",
             "OPENID_PROVIDER_URL": "http://127.0.0.1:9"}  # never reached: nobody signs in here
    with serve_app(runs, **space) as url:
        client = Client(url, verbose=False)
        started, _ = client.predict(prompt_file=None, api_name="/start")
        assert "only the Space's owner" in started and "you are not signed in" in started
        assert not [p for p in runs.iterdir() if p.is_dir()]
        assert "**Not stopped:**" in client.predict(api_name="/stop")
        resumed, _ = client.predict("any", api_name="/resume")
        assert "only the Space's owner" in resumed
        pushed = client.predict("any", "latest adapter", "a/b", "private", "", api_name="/push")
        assert pushed.startswith("**Not pushed:** only the Space's owner")
        deleted, _ = client.predict("any", api_name="/delete")
        assert deleted.startswith("**Not deleted:** only the Space's owner")
        _, generated = client.predict("any", "latest adapter", "a cat", 0, api_name="/generate")
        assert generated.startswith("**Not generated:** only the Space's owner")
        # an input image named by its path on the server, not uploaded (gradio_client would upload it: raw HTTP)
        image = {"path": str(ROOT / "presets" / "prompts" / "edits" / "red_circle.png"),
                 "meta": {"_type": "gradio.FileData"}}
        call = requests.post(f"{url}gradio_api/call/generate",
                             json={"data": ["any", "latest adapter", "a cat", 0, image, None, None]})
        events = requests.get(f"{url}gradio_api/call/generate/{call.json()['event_id']}", timeout=60).text
        assert events.startswith("event: error"), events  # refused before any handler (the owner's too)
        assert client.predict("", api_name="/status")["state"] == "none"  # watching works


@pytest.mark.parametrize("run_info", [b"\x00garbage", b"[1, 2]", b'{"family": "sd3"'])
def test_a_garbage_run_info_does_not_stop_the_model_card(tmp_path, run_info):
    run_dir = RunDirectory(tmp_path / "run")
    run_dir.write_config("name: x\nmodel: {name: some/model}\nrewards: [{name: shapes}]\n")
    run_dir.run_info_file.write_bytes(run_info)
    run_dir.lora_dir.mkdir()
    run_dir.lora_file.write_bytes(b"adapter")
    result = run_python(["-m", "jagg_core.hub", "card", str(run_dir.path), "--repo-id", "a/b"], cwd=ROOT, env=ENV)
    assert result.returncode == 0 and "base_model: some/model" in result.stdout, result.stderr[-2000:]
