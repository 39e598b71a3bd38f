"""Trackers (TensorBoard, trackio through accelerate), learning-rate schedules, EMA, and what the card says of them."""

from __future__ import annotations

import importlib.util
import json
import signal
import sqlite3
import subprocess
import sys

import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from app import live
from jagg_core import metrics
from jagg_core.host import cpu_name
from jagg_core.hub import write_model_card
from jagg_core.rundir import TRAINING_STATE_FILE, RunDirectory
from jagg_core.stopping import STOP, StopRequested
from jagg_core.trainer import Trainer

from conftest import ROOT, run_cli, tiny_config

TRACKED = ["--preset", "tiny-sd3", "--set", "train.iterations=3", "--set", "sampling.num_steps=4",
           "--set", "grpo.num_generations=2", "--set", "grpo.prompts_per_iteration=1", "--set", "prompts.eval_count=2",
           "--set", "sampling.resolution=16", "--set", "train.sample_every=1", "--set", "train.checkpoint_every=1",
           "--set", "train.report_to=[tensorboard, trackio]", "--set", "train.lr_scheduler=cosine",
           "--set", "train.lr_warmup_steps=1", "--set", "train.ema_decay=0.5"]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    root = tmp_path_factory.mktemp("tracked")
    run_dir = root / "run"
    result = run_cli(*TRACKED, "--output-dir", str(run_dir), env={"TRACKIO_DIR": str(root / "trackio")})
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, root / "trackio"


def scalars(row: dict) -> dict:
    return {k: float(v) for k, v in row.items() if k != metrics.ITERATION and isinstance(v, (bool, int, float))}


def test_tensorboard_holds_every_metric_and_an_eval_grid_per_eval(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _ = tracked
    events = EventAccumulator(str(run_dir / "tracking" / "tiny-sd3"), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    rows = RunDirectory(run_dir).read_metrics()
    assert [r[metrics.ITERATION] for r in rows] == [0, 1, 2, 3]
    for row in rows:
        for key, value in scalars(row).items():
            logged = {e.step: e.value for e in events.Scalars(key)}
            assert logged[row[metrics.ITERATION]] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert [e.step for e in events.Images("eval/samples")] == [0, 1, 2, 3]


def test_trackio_records_the_run_locally(tracked):
    run_dir, trackio_dir = tracked
    with sqlite3.connect(trackio_dir / "tiny-sd3.db") as db:
        logged = db.execute("select step, metrics from metrics where run_name = ?", (run_dir.name,)).fetchall()
    by_step = {}
    for step, values in logged:
        by_step.setdefault(step, {}).update(json.loads(values))
    for row in RunDirectory(run_dir).read_metrics():
        step = by_step[row[metrics.ITERATION]]
        assert scalars(row).keys() <= step.keys() and step["eval/samples"]["_type"] == "trackio.image"


def test_the_page_and_the_card_say_where_and_how_the_run_was_tracked_and_scheduled(tracked):
    run_dir, _ = tracked
    words = live.status_words(run_dir, live.progress(run_dir))
    assert f"`tensorboard --logdir {run_dir / 'tracking'}`" in words and "`trackio show --project tiny-sd3`" in words
    card = write_model_card(run_dir, "alice/tracked").text
    assert "| | iteration | held-out reward | jpeg_compressibility |" in card
    assert "`cosine` learning-rate schedule with 1 warm-up steps" in card and "EMA of the weights (decay 0.5)" in card
    assert f"of rollouts, updates and evals on {cpu_name()} ({torch.get_num_threads()} threads)" in card


def test_the_learning_rate_follows_the_schedule(tracked):
    run_dir, _ = tracked
    rates = [row[metrics.LEARNING_RATE] for row in RunDirectory(run_dir).read_metrics()[1:]]
    assert rates[0] == 0.0 and rates[1] == pytest.approx(1e-3) and 0 < rates[2] < rates[1]  # warm-up, then cosine


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_without_its_package_is_one_line():
    result = subprocess.run([sys.executable, "-m", "jagg_core.run", "--set", "train.report_to=[wandb]", "--dry-run"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "jagg_core.run: error: train.report_to names wandb, but the 'wandb' package is not installed; "
        "run `pip install wandb`, or remove wandb from train.report_to"]


SCHEDULED = {"train__lr_scheduler": "cosine_with_restarts", "train__lr_num_cycles": 2, "train__lr_warmup_steps": 1,
             "train__ema_decay": 0.5, "train__iterations": 4}


def test_a_stopped_run_with_a_schedule_and_ema_resumes_bit_for_bit(tmp_path, offline):
    straight = Trainer(tiny_config(**SCHEDULED), tmp_path / "straight")
    straight.setup()
    straight.fit()
    interrupted = Trainer(tiny_config(**SCHEDULED), tmp_path / "interrupted")
    interrupted.setup()
    one_iteration = interrupted.iteration

    def stop_after_two(iteration):
        row = one_iteration(iteration)
        if iteration == 2:
            STOP.requested = signal.SIGTERM  # as the handler does when a SIGTERM arrives mid-iteration
        return row
    interrupted.iteration = stop_after_two
    try:
        with pytest.raises(StopRequested):
            interrupted.fit()
    finally:
        STOP.requested = None
    assert RunDirectory(tmp_path / "interrupted").checkpoint_iterations()[-1] == 2
    resumed = Trainer(tiny_config(**SCHEDULED), tmp_path / "interrupted", resume=True)
    resumed.setup()
    assert resumed.start_iteration == 3
    resumed.fit()
    runs = [RunDirectory(tmp_path / name) for name in ("straight", "interrupted")]
    a, b = (load_file(run.lora_file) for run in runs)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r.get(metrics.LEARNING_RATE) for r in runs[0].read_metrics()] == \
        [r.get(metrics.LEARNING_RATE) for r in runs[1].read_metrics()]
    states = [torch.load(run.latest_checkpoint() / TRAINING_STATE_FILE, weights_only=False) for run in runs]
    assert all(torch.equal(x, y) for x, y in zip(states[0]["lora"], states[1]["lora"]))
    assert all(torch.equal(x, y) for x, y in zip(states[0]["ema"]["shadow_params"], states[1]["ema"]["shadow_params"]))


def test_with_ema_the_adapter_and_the_eval_samples_are_the_average(tmp_path, offline):
    trainer = Trainer(tiny_config(train__ema_decay=0.5, train__iterations=2, train__learning_rate=0.05), tmp_path / "r")
    trainer.setup()
    trainer.fit()
    saved = load_file(RunDirectory(tmp_path / "r").lora_file)
    averaged = torch.cat([p.flatten() for p in trainer.ema.shadow_params])
    trained = torch.cat([p.detach().flatten() for p in trainer.params])
    assert not torch.equal(averaged, trained), "the test needs the average to differ from the trained weights"
    with trainer.averaged_weights():
        in_context = torch.cat([p.detach().flatten() for p in trainer.params])
        state = {k: v.detach().clone() for k, v in get_peft_model_state_dict(trainer.model.transformer).items()}
    assert torch.equal(in_context, averaged)
    assert torch.equal(torch.cat([p.detach().flatten() for p in trainer.params]), trained)  # restored after
    assert all(torch.equal(saved[k], state[k.removeprefix("transformer.")].cpu()) for k in saved)
