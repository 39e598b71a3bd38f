"""Shared helpers: tiny run configs and a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jagg_core.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def tiny_config(model: str = "tiny-sd3", **overrides):
    """The tiny-sd3 preset, made smaller still, with ``section__key=value`` overrides."""
    base = {"train.iterations": 2, "sampling.num_steps": 6, "sampling.resolution": 32, "grpo.num_generations": 2,
            "grpo.prompts_per_iteration": 2, "prompts.eval_count": 2, "backward.window": 3,
            "train.sample_every": 1, "train.checkpoint_every": 1, "model.name": model}
    base.update({k.replace("__", "."): v for k, v in overrides.items()})
    return load_config(preset="tiny-sd3", overrides=[f"{k}={v}" for k, v in base.items()])


def run_cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m jagg_core.run ARGS`` in the repository root, offline."""
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "jagg_core.run", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
