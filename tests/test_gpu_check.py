"""The one-command GPU check, run here at toy size (``--reduced``): its steps, outputs and failure handling."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from jagg_core.config import load_config
from jagg_core.gpu_check import (CheckOptions, format_tables, memory_presets, memory_recipe, run_check,
                                 step_names, _step_process)

OFFLINE = {"HF_HUB_OFFLINE": "1"}


def run_gpu_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jagg_core.gpu_check", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, **OFFLINE}, timeout=1200)


def test_the_check_covers_every_family_both_real_archs_and_the_16_24_gb_presets():
    names = step_names()
    assert names[:4] == ["device", "tiny-sd3", "tiny-flux", "tiny-qwen"]
    assert {"bench-sd35-medium", "bench-flux-dev"} <= set(names)
    assert set(memory_presets()) == {"sd35-medium-pickscore-16gb", "flux-dev-pickscore-24gb",
                                     "qwen-image-pickscore-24gb", "flux2-klein-pickscore-24gb",
                                     "zimage-turbo-pickscore-24gb", "wan21-t2v-1.3b-pickscore-24gb",
                                     "flux-kontext-clipdir-24gb", "qwen-image-edit-clipdir-24gb"}
    assert {f"memory-{p}" for p in memory_presets()} <= set(names)


@pytest.mark.parametrize("preset", ["sd35-medium-pickscore-16gb", "flux-dev-pickscore-24gb",
                                    "qwen-image-pickscore-24gb", "wan21-t2v-1.3b-pickscore-24gb"])
def test_the_measured_recipe_keeps_what_memory_depends_on(preset):
    full, measured = load_config(preset=preset), memory_recipe(preset, CheckOptions())
    same = ["model.dtype", "model.quantize", "model.max_sequence_length", "model.cache_text_embeddings",
            "sampling.resolution", "sampling.num_frames", "sampling.rollout_batch_size", "lora.rank",
            "lora.target_modules",
            "backward.mode", "backward.window", "backward.joint", "backward.velocities", "train.optimizer",
            "train.mixed_precision", "train.gradient_checkpointing", "grpo.kl_beta", "sampling.num_steps"]
    for key in same:
        section, name = key.split(".")
        assert getattr(getattr(measured, section), name) == getattr(getattr(full, section), name), key

    def micro_batch(config):
        samples = config.grpo.num_generations * config.grpo.prompts_per_iteration
        return math.ceil(samples / config.train.gradient_accumulation_steps)

    assert micro_batch(measured) == micro_batch(full)
    assert measured.model.name.startswith("random:") and "@" not in measured.model.name  # the real depth
    assert [r.name for r in measured.rewards] == ["jpeg_compressibility"]
    assert measured.grpo.prompts_per_iteration == 1 and measured.prompts.eval_count <= measured.grpo.num_generations


def test_a_reduced_check_runs_each_kind_of_step_and_writes_its_tables(tmp_path):
    out = tmp_path / "out"
    done = run_gpu_check("--reduced", "--out", str(out), "--budget-s", "1200",
                         "--only", "device,tiny-sd3,bench-sd35-medium,memory-sd35-medium-pickscore-16gb")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    rows = {(r["step"], r.get("recipe") or r.get("mode")): r for r in report["rows"]}

    assert rows[("device", None)]["status"] == "ok" and rows[("device", None)]["versions"]["diffusers"]
    for recipe in ("bf16", "int8"):  # 2 iterations in bf16 with 8-bit AdamW, then the loss and rewards
        tiny = rows[("tiny-sd3", recipe)]
        assert tiny["status"] == "ok" and math.isfinite(tiny["loss"]) and math.isfinite(tiny["eval_reward"])
    assert rows[("tiny-sd3", "nf4")]["status"] == "skipped" and "CUDA" in rows[("tiny-sd3", "nf4")]["reason"]

    exact, jagg = rows[("bench-sd35-medium", "exact")], rows[("bench-sd35-medium", "cached")]
    assert exact["model"] == "random:sd35-medium@1" and exact["resolution"] == 64
    assert jagg["window"] == 5 and jagg["joint"] and 0 < jagg["grad_cosine"] < 0.9999
    assert exact["grad_cosine"] == pytest.approx(1)
    assert jagg["train_s"] > 0 and jagg["iteration_speedup"] > 0

    memory = rows[("memory-sd35-medium-pickscore-16gb", None)]
    assert memory["status"] == "ok", memory
    assert 0.75 <= memory["planned_over_measured"] <= 1.25, memory
    assert memory["preset_planned_gb"] > 5 * memory["planned_setup_gb"]  # the preset at 512 px with the real encoders

    table = (out / "gpu_check.md").read_text()
    assert "| tiny-sd3 | int8 | ok |" in table and "JAGG W=5 cached joint" in table
    assert "| sd35-medium-pickscore-16gb | ok |" in table
    assert table in done.stdout and "0 failed" in done.stdout
    assert "===== memory-sd35-medium-pickscore-16gb =====" in (out / "gpu_check.log").read_text()


def test_a_failing_step_is_a_row_with_its_reason(tmp_path):
    log = tmp_path / "log"
    log.write_text("")
    rows = _step_process("bench-no-such-arch", CheckOptions(reduced=True), 300, log)
    assert rows == [{"step": "bench-no-such-arch", "status": "failed", "reason": rows[0]["reason"]}]
    assert "unknown arch 'no-such-arch'" in rows[0]["reason"]


def test_steps_past_the_budget_are_skipped_and_reported(tmp_path):
    rows = run_check(tmp_path, CheckOptions(reduced=True), budget_s=0, log=lambda line: None)
    assert [r["step"] for r in rows] == step_names()
    assert all(r["status"] == "skipped" and "budget" in r["reason"] for r in rows)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["rows"] == rows and "skipped: the 0 s budget is spent" in (tmp_path / "gpu_check.md").read_text()


def test_an_unknown_step_is_one_line(tmp_path):
    done = run_gpu_check("--only", "tiny-sdxl", "--out", str(tmp_path))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "unknown step(s) tiny-sdxl; steps: device, tiny-sd3" in done.stderr


def test_the_tables_read_without_a_gpu():
    rows = [{"step": "device", "status": "failed", "reason": "CUDA is not visible", "cuda": False,
             "versions": {"torch": "2.13.0"}}]
    text = format_tables(rows, CheckOptions(), 3.0)
    assert text.startswith("GPU check (real size), 3 s: no GPU; torch 2.13.0")


def test_the_script_runs_the_check_into_its_folder(tmp_path):
    done = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path / "out"), "--reduced", "--only", "device"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check.json", "gpu_check.log", "gpu_check.md"]
    assert "1 rows, 0 failed" in done.stdout
