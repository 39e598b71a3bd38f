"""The headless CLI: presets, dry runs, bad input, data-parallel runs, and a kill mid-checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from jagg_core import metrics
from jagg_core.rundir import RunDirectory

from conftest import ROOT, run_cli

# Training runs are waited on by state (the awaited output or state, or the process gone); this cap only keeps a hung
# CI job from waiting forever, far beyond what a loaded machine needs.
SAFETY_CAP_S = 1800

SMALL = ["--set", "train.iterations=2", "--set", "sampling.num_steps=6", "--set", "grpo.num_generations=2",
         "--set", "prompts.eval_count=2", "--set", "train.sample_every=1", "--set", "train.checkpoint_every=1"]


def test_list_presets_names_every_preset_with_a_description():
    result = run_cli("--list-presets")
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(None, 1) for line in result.stdout.strip().splitlines())
    assert "tiny-sd3" in lines and all(description.strip() for description in lines.values())


def test_dry_run_prints_the_resolved_config_with_overrides():
    result = run_cli("--preset", "tiny-sd3", "--set", "backward.window=4", "--set", "lora.rank=2", "--dry-run")
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert config["backward"]["window"] == 4 and config["lora"]["rank"] == 2
    assert config["model"]["name"] == "tiny-sd3"


@pytest.mark.parametrize("args, message", [
    (["--preset", "nope"], "unknown preset 'nope'; available: "),
    (["--set", "train.iterationz=3"], "unknown config key 'train.iterationz'; allowed here: algorithm, iterations"),
    (["--set", "nosection.x=1"], "unknown config key 'nosection'; allowed here: name"),
    (["--set", "backward.mode=fast"], "bad value 'fast' for 'backward.mode'"),
    (["--set", "sampling.resolution=30"], "resolution must be a multiple of 16"),
    (["--set", "grpo.num_generations=1"], "bad value 1 for 'grpo.num_generations'"),
    (["--set", "rewards=[{name: beauty}]"], "unknown reward 'beauty'; available: "),
    (["--set", "eval.judges=[{name: motion}]"], "the motion reward scores videos of 2 frames or more: use a video "
                                                "model (Wan) with sampling.num_frames >= 5"),
    (["--set", "prompts.source=missing.txt"], "missing.txt"),
    (["--set", "prompts.source=presets/prompts/general.txt"], "the reward 'shapes' cannot read the prompt"),
    (["--config", "does-not-exist.yaml"], "config file 'does-not-exist.yaml' does not exist"),
    (["--config", "presets"], "config file 'presets' is a folder, not a YAML file"),
    (["--set", "model.name=./no-such-folder", "--output-dir", "{tmp}/run"], "model './no-such-folder' is neither"),
    (["--preset", "flux-dev-pickscore-24gb", "--output-dir", "{tmp}/run"],  # offline, not in the cache
     "cannot load model 'black-forest-labs/FLUX.1-dev': the Hub is unreachable and it is not in the local cache"),
    (["--set", "model.name=models/flux1-dev.safetensors", "--output-dir", "{tmp}/run"],
     "model 'models/flux1-dev.safetensors' is a single weights file; point model.name at a diffusers pipeline"),
    (["--plan", "--gpu-memory", "-5"], "--gpu-memory -5: give the GPU's memory in GB, a positive number"),
    (["--plan", "--gpu-memory", "0"], "--gpu-memory 0: give the GPU's memory in GB"),
    (["--doctor", "--resume", "--output-dir", "{tmp}/run"], "--doctor checks a new run's first iteration"),
])
def test_bad_input_is_one_line_and_exit_code_two(args, message, tmp_path):
    result = run_cli(*[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("jagg_core.run: error: ") and message in lines[0]


SLOW_CHECKPOINT = """
import sys, time
from jagg_core import rundir
write = rundir.RunDirectory.write_checkpoint
def slow(self, iteration, contents, keep):
    def slow_contents(folder):
        contents(folder)
        if iteration == 2:
            print("WRITING-CHECKPOINT-2", flush=True)
            time.sleep(120)
    return write(self, iteration, slow_contents, keep)
rundir.RunDirectory.write_checkpoint = slow
from jagg_core.run import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_run_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--preset", "tiny-sd3", *SMALL, "--set", "train.iterations=3", "--output-dir", str(run_dir)]
    stderr_log = tmp_path / "first-run.stderr"
    with stderr_log.open("w") as stderr:
        process = subprocess.Popen([sys.executable, "-c", SLOW_CHECKPOINT, *args], cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=stderr, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    watchdog = threading.Timer(SAFETY_CAP_S, process.kill)  # ends the wait on a hung run: its stdout closes
    watchdog.start()
    seen, reached = [], False
    try:
        for line in process.stdout:  # until the marker, or the end of the output (the process ended)
            seen.append(line)
            if "WRITING-CHECKPOINT-2" in line:
                reached = True
                break
    finally:
        watchdog.cancel()
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
        process.wait()
        process.stdout.close()
    assert reached, ("the run ended (or hit the safety cap) before writing checkpoint 2:\n"
                     + "".join(seen)[-2000:] + stderr_log.read_text()[-3000:])
    run = RunDirectory(run_dir)
    assert run.checkpoint_iterations() == [1], "the half-written checkpoint must not count"
    assert any(p.name.startswith(".tmp-iter_000002") for p in run.checkpoints_dir.iterdir())

    result = run_cli(*args, "--resume", timeout=SAFETY_CAP_S)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from iter_000001" in result.stdout + result.stderr
    assert run.checkpoint_iterations() == [1, 2, 3]
    assert not any(p.name.startswith(".tmp-") for p in run.checkpoints_dir.iterdir())
    assert [r["iteration"] for r in run.read_metrics()] == [0, 1, 2, 3]
    assert run.read_status()["state"] == "finished"


def test_sigterm_stops_cleanly_and_says_how_to_resume(tmp_path):
    run_dir = tmp_path / "run"
    stderr_log = tmp_path / "stderr.log"
    with stderr_log.open("w") as stderr_file:
        process = subprocess.Popen([sys.executable, "-m", "jagg_core.run", "--preset", "tiny-sd3", *SMALL,
                                    "--set", "train.iterations=200", "--output-dir", str(run_dir)],
                                   cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr_file, text=True,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    run = RunDirectory(run_dir)
    cap = time.monotonic() + SAFETY_CAP_S
    try:
        while not run.checkpoint_iterations():  # until the first checkpoint, or the process has ended
            if process.poll() is not None or time.monotonic() > cap:
                why = "the run ended" if process.poll() is not None else f"the {SAFETY_CAP_S} s safety cap"
                pytest.fail(f"no checkpoint before {why}:\n{stderr_log.read_text()[-3000:]}")
            time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=SAFETY_CAP_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    stderr = stderr_log.read_text()
    assert process.returncode == 143  # 128 + SIGTERM
    assert "resume with --resume" in stderr and "Traceback" not in stderr
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "stopped"
    # the iteration running at the signal was finished and checkpointed: a resume continues right after it
    done = run.checkpoint_iterations()[-1]
    assert done == status["iteration"] >= 1
    assert [r[metrics.ITERATION] for r in run.read_metrics()] == list(range(done + 1))


def test_the_default_preset_runs_with_no_arguments_but_a_short_length(tmp_path):
    """``python -m jagg_core.run`` trains the embedded shapes model on the shapes reward."""
    run_dir = tmp_path / "default"
    result = run_cli("--set", "train.iterations=2", "--set", "train.sample_every=2", "--output-dir", str(run_dir),
                     timeout=SAFETY_CAP_S)
    assert result.returncode == 0, result.stderr[-3000:]
    run = RunDirectory(run_dir)
    config = yaml.safe_load(run.config_file.read_text())
    assert config["model"]["name"] == "jagg-shapes" and config["rewards"][0]["name"] == "shapes"
    rows = run.read_metrics()
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert 0.4 <= rows[0][metrics.EVAL_REWARD_MEAN] <= 0.85, "the base model's held-out reward leaves room for RL"
    assert len(run.samples(2).images) == config["prompts"]["eval_count"] and run.grid_file(2).is_file()
    assert run.read_status()["state"] == "finished"
