"""The run directory: the contract between the trainer, the app, the Hub module and tests.

    RUN/config.yaml            resolved config (no secrets)
    RUN/run_info.json          {"family", "base_model"}
    RUN/metrics.jsonl          one JSON object per iteration
    RUN/samples/iter_NNNNNN/   fixed-seed eval samples: 000.png ... + prompts.json
    RUN/rollouts/latest/       the latest rollout images + prompts.json
    RUN/checkpoints/iter_NNNNNN/  LoRA + optimizer + trainer_state.json (written atomically)
    RUN/lora/pytorch_lora_weights.safetensors   latest adapter, diffusers format
    RUN/status.json            {"state": running|finished|failed|stopped, "pid", "iteration", ...}
    RUN/train.log              the trainer's log lines

Every file is replaced atomically (written beside, then renamed), so a reader or a killed writer
never sees half a file, and a checkpoint folder exists only once complete.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

from .rewards.base import to_pil

LORA_FILE = "pytorch_lora_weights.safetensors"
STATE_FILE = "trainer_state.json"


def iteration_dirname(iteration: int) -> str:
    return f"iter_{iteration:06d}"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunDirectory:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    # ----- paths ---------------------------------------------------------------------
    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def status_file(self) -> Path:
        return self.path / "status.json"

    @property
    def log_file(self) -> Path:
        return self.path / "train.log"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def lora_dir(self) -> Path:
        return self.path / "lora"

    def samples_dir(self, iteration: int) -> Path:
        return self.path / "samples" / iteration_dirname(iteration)

    # ----- small files -----------------------------------------------------------------
    def create(self) -> None:
        for sub in ("samples", "checkpoints", "lora", "rollouts"):
            (self.path / sub).mkdir(parents=True, exist_ok=True)

    def write_json(self, name: str, data: dict) -> None:
        atomic_write_text(self.path / name, json.dumps(data, indent=1))

    def read_status(self) -> dict:
        try:
            return json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return {}

    def write_status(self, state: str, **fields) -> None:
        status = {**self.read_status(), **fields, "state": state, "updated_at": time.time()}
        self.write_json("status.json", status)

    def log(self, line: str) -> None:
        with self.log_file.open("a") as handle:
            handle.write(line.rstrip("\n") + "\n")

    # ----- metrics ---------------------------------------------------------------------
    def append_metrics(self, row: dict) -> None:
        with self.metrics_file.open("a") as handle:
            handle.write(json.dumps(row) + "\n")

    def read_metrics(self) -> list[dict]:
        if not self.metrics_file.is_file():
            return []
        rows = []
        for line in self.metrics_file.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a kill mid-write
        return rows

    def truncate_metrics(self, last_iteration: int) -> None:
        """Keep the rows up to ``last_iteration`` (on resume, iterations after the checkpoint rerun)."""
        rows = [r for r in self.read_metrics() if r.get("iteration", 0) <= last_iteration]
        atomic_write_text(self.metrics_file, "".join(json.dumps(r) + "\n" for r in rows))

    # ----- images ----------------------------------------------------------------------
    def write_images(self, folder: Path, images: torch.Tensor, prompts: list[str], **extra) -> None:
        """Write ``000.png ...`` and ``prompts.json`` into ``folder``, replacing it atomically."""
        tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for i, image in enumerate(to_pil(images)):
            image.save(tmp / f"{i:03d}.png")
        (tmp / "prompts.json").write_text(json.dumps(prompts, indent=1))
        if extra:
            (tmp / "info.json").write_text(json.dumps(extra, indent=1))
        old = folder.with_name(f".{folder.name}.{os.getpid()}.old")
        if folder.exists():
            os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)

    # ----- checkpoints -----------------------------------------------------------------
    def checkpoint_iterations(self) -> list[int]:
        """Iterations of the complete checkpoints, oldest first."""
        if not self.checkpoints_dir.is_dir():
            return []
        return sorted(int(p.name.removeprefix("iter_")) for p in self.checkpoints_dir.glob("iter_*")
                      if (p / STATE_FILE).is_file())

    def latest_checkpoint(self) -> Path | None:
        iterations = self.checkpoint_iterations()
        return self.checkpoints_dir / iteration_dirname(iterations[-1]) if iterations else None

    def write_checkpoint(self, iteration: int, write_contents, keep: int) -> Path:
        """Call ``write_contents(tmp_folder)``, add the state file last, rename into place, prune."""
        final = self.checkpoints_dir / iteration_dirname(iteration)
        tmp = self.checkpoints_dir / f".tmp-{iteration_dirname(iteration)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_contents(tmp)
        (tmp / STATE_FILE).write_text(json.dumps({"iteration": iteration, "time": time.time()}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in self.checkpoint_iterations()[:-keep]:
            shutil.rmtree(self.checkpoints_dir / iteration_dirname(old), ignore_errors=True)
        for stale in self.checkpoints_dir.glob(".tmp-*"):
            if not stale.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(stale, ignore_errors=True)
        return final

    def publish_lora(self, checkpoint: Path) -> None:
        """Copy the checkpoint's adapter to ``RUN/lora/`` atomically."""
        self.lora_dir.mkdir(parents=True, exist_ok=True)
        target = self.lora_dir / LORA_FILE
        tmp = self.lora_dir / f".{LORA_FILE}.{os.getpid()}.tmp"
        shutil.copyfile(checkpoint / LORA_FILE, tmp)
        os.replace(tmp, target)
