"""The run directory: the contract between the trainer, the app, the Hub module and tests.

    RUN/config.yaml            resolved config (no secrets)
    RUN/run_info.json          {"family", "base_model", "hardware", "processes"}
    RUN/metrics.jsonl          one JSON object per iteration (keys: :mod:`jagg_core.metrics`)
    RUN/samples/iter_NNNNNN/   fixed-seed eval samples: 000.png ... + prompts.json + info.json + grid.png (all of
                               them in one picture, each captioned with its prompt and reward); a video model's
                               samples are 000.mp4 ... with 000.png ... their frame strips (grid: middle frames)
    RUN/rollouts/latest/       the latest rollout images (videos: MP4s + strips) + prompts.json + info.json
    RUN/checkpoints/iter_NNNNNN/  LoRA (the EMA weights when on) + optimizer.pt + training_state.pt (schedule,
                               EMA, raw LoRA) + trainer_state.json (written atomically)
    RUN/tracking/              experiment trackers' files (TensorBoard events, W&B)
    RUN/text_embeddings.safetensors  every prompt's text-encoder output (model.cache_text_embeddings)
    RUN/lora/pytorch_lora_weights.safetensors   latest adapter, diffusers format (model.expert both: and the
                               low-noise expert's pytorch_lora_weights_transformer_2.safetensors, here and below)
    RUN/best/pytorch_lora_weights.safetensors   the adapter of the best eval so far (``eval.best_by``), with
    RUN/best/best.json         {"iteration", "metric" (a metrics key), "label" (in words), "value", "reason"}
    RUN/doctor.json            the first iteration's checklist: {"iteration", "passed", "checks": [{"check",
                               "status": pass|fail|skip, "detail", "fix"}]} (also in status.json's "doctor")
    RUN/status.json            {"state": running|finished|failed|stopped, "phase": loading|downloading|base eval|
                               training, "message" (what it is doing, e.g. "base eval 16/64"), "pid", "iteration",
                               "download" (phase downloading: {"done": bytes of the base model in the Hugging Face
                               cache, "total": bytes it needs, "rate": bytes/s}; null otherwise),
                               "doctor" (as doctor.json), "alarm" (the reward-hacking alarm's line), ...}
    RUN/train.log              the trainer's log lines
    RUN/stdout.log             the output of a job the app launched
    RUN/.trainer.lock          held (flock) by the live trainer; the OS releases it when the process dies

:class:`RunDirectory` is the only code that knows these names: every reader and writer asks it.
Every file is replaced atomically (written beside, then renamed), so a reader or a killed writer
never sees half a file, and a checkpoint folder exists only once complete. This module imports
no deep-learning library, so the app's job control can use it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import metrics
from .errors import UserError
from .video import write_mp4

LORA_FILE = "pytorch_lora_weights.safetensors"
#: the low-noise expert's adapter beside :data:`LORA_FILE` (the high-noise one's) when a run trains both experts of
#: a two-expert model (``model.expert: both``); diffusers loads it with ``weight_name=`` this and
#: ``load_into_transformer_2=True``
TRANSFORMER_2_LORA_FILE = "pytorch_lora_weights_transformer_2.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
TRAINING_STATE_FILE = "training_state.pt"
STATE_FILE = "trainer_state.json"
BEST_RECORD = "best.json"
GRID_FILE = "grid.png"  # an eval's samples in one captioned picture
ITERATION_NAME = re.compile(r"iter_(\d+)")


def iteration_dirname(iteration: int) -> str:
    """``10`` -> ``iter_000010``."""
    return f"iter_{iteration:06d}"


def parse_iteration(name: str) -> int | None:
    """``iter_000010`` or ``iter_10`` -> ``10``; anything else -> None."""
    match = ITERATION_NAME.fullmatch(name.strip())
    return int(match.group(1)) if match else None


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def adapter_filenames(expert: str) -> tuple[str, ...]:
    """The files of one adapter of a run of ``model.expert``: :data:`LORA_FILE`, and :data:`TRANSFORMER_2_LORA_FILE`
    beside it when the run trains both experts."""
    return (LORA_FILE, TRANSFORMER_2_LORA_FILE) if expert == "both" else (LORA_FILE,)


def adapter_files(file: Path) -> list[Path]:
    """The files of the adapter whose first file is ``file``: it, and the low-noise expert's beside it when there
    is one (:data:`TRANSFORMER_2_LORA_FILE`)."""
    second = file.parent / TRANSFORMER_2_LORA_FILE
    return [file, second] if file.name == LORA_FILE and second.is_file() else [file]


def replace_folder(folder: Path, fill) -> None:
    """Replace ``folder`` atomically by a new one that ``fill(tmp_folder)`` writes beside it: a reader sees the old
    folder or the new one, never half of either."""
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill(tmp)
    old = folder.with_name(f".{folder.name}.{os.getpid()}.old")
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def _read_json(path: Path, kind: type) -> Any:
    """The JSON value of ``path`` if it is a ``kind``, else an empty ``kind`` (missing, half-written, other)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return kind()
    return value if isinstance(value, kind) else kind()


@dataclass
class ImageSet:
    """The images of one folder (eval samples of an iteration, or the latest rollouts), with their prompts and,
    when known, their rewards."""

    folder: Path
    iteration: int | None
    images: list[Path]
    prompts: list[str]
    rewards: list[float] = field(default_factory=list)
    videos: list[Path] = field(default_factory=list)  # a video model's MP4s (``images`` are then their strips)


class RunDirectory:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    # ----- paths ---------------------------------------------------------------------
    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    @property
    def run_info_file(self) -> Path:
        return self.path / "run_info.json"

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
    def output_log(self) -> Path:
        return self.path / "stdout.log"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"

    @property
    def lora_dir(self) -> Path:
        return self.path / "lora"

    @property
    def lora_file(self) -> Path:
        return self.lora_dir / LORA_FILE

    @property
    def best_dir(self) -> Path:
        """The adapter of the best eval so far (``eval.best_by``) and its record."""
        return self.path / "best"

    @property
    def best_lora_file(self) -> Path:
        return self.best_dir / LORA_FILE

    @property
    def doctor_file(self) -> Path:
        return self.path / "doctor.json"

    @property
    def tracking_dir(self) -> Path:
        return self.path / "tracking"

    @property
    def text_embeddings_file(self) -> Path:
        """Every prompt's text-encoder output, written at set-up (``model.cache_text_embeddings``)."""
        return self.path / "text_embeddings.safetensors"

    @property
    def samples_root(self) -> Path:
        return self.path / "samples"

    @property
    def rollouts_dir(self) -> Path:
        return self.path / "rollouts" / "latest"

    def samples_dir(self, iteration: int) -> Path:
        return self.samples_root / iteration_dirname(iteration)

    def checkpoint_dir(self, iteration: int) -> Path:
        return self.checkpoints_dir / iteration_dirname(iteration)

    @property
    def lock_file(self) -> Path:
        return self.path / ".trainer.lock"

    def is_run(self) -> bool:
        """Whether this folder holds a run (its config has been written)."""
        return self.config_file.is_file()

    # ----- the trainer's lock ---------------------------------------------------------
    def acquire_trainer_lock(self) -> None:
        """Hold this run's lock for the life of this process (one run directory, one trainer); a one-line
        :class:`UserError` if a live process holds it. The OS releases it when the process ends, however."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            handle = self.lock_file.open("a")
        except OSError as err:
            raise UserError(f"cannot write the run directory {self.path}: {err.strerror}") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            pid = self.read_status().get("pid")
            raise UserError(f"{self.path} is being trained by another process{f' (pid {pid})' if pid else ''}; "
                            "stop that run first, or choose another --output-dir") from None
        self._lock = handle  # open for as long as this object lives, as the lock

    def trainer_alive(self) -> bool:
        """Whether a live process, wherever it was started, holds this run's lock."""
        try:
            handle = self.lock_file.open("r")
        except OSError:
            return False
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
        return False

    def remove_temporaries(self) -> None:
        """Delete the half-written files this process left (``.NAME.PID.tmp``, checkpoint ``.tmp-*-PID``)."""
        pid = os.getpid()
        for stray in [*self.path.rglob(f".*.{pid}.tmp"), *self.checkpoints_dir.glob(f".tmp-*-{pid}")]:
            shutil.rmtree(stray, ignore_errors=True) if stray.is_dir() else stray.unlink(missing_ok=True)

    # ----- small files -----------------------------------------------------------------
    def create(self) -> None:
        for folder in (self.samples_root, self.checkpoints_dir, self.lora_dir, self.rollouts_dir.parent):
            folder.mkdir(parents=True, exist_ok=True)

    def write_json(self, path: Path, data: dict) -> None:
        atomic_write_text(path, json.dumps(data, indent=1))

    def write_config(self, text: str) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.config_file, text)

    def read_config(self) -> dict:
        """The resolved config as a mapping; a missing or broken file is a one-line :class:`UserError`."""
        if not self.is_run():
            raise UserError(f"{self.path} is not a JAGG run directory (no config.yaml)")
        try:
            config = yaml.safe_load(self.config_file.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise UserError(f"{self.config_file} is not valid YAML: {str(err).splitlines()[0]}") from None
        if not isinstance(config, dict):
            raise UserError(f"{self.config_file} does not hold a run config")
        return config

    def configured_iterations(self) -> int:
        """``train.iterations`` of the config, 0 if it cannot be read."""
        try:
            return int(self.read_config()["train"]["iterations"])
        except (UserError, KeyError, TypeError, ValueError):
            return 0

    def write_run_info(self, family: str, base_model: str, hardware: str, processes: int = 1,
                       text_windows: list[dict] | None = None, expert: str | None = None) -> None:
        """What the run trains on: ``text_windows``, how its prompts fill the text encoders' windows
        (:meth:`jagg_core.models.text_windows.WindowReading.record`), and ``expert``, the ``model.expert`` a
        two-expert base model's adapter is for (None: a model of one transformer), for the model card."""
        self.write_json(self.run_info_file, {"family": family, "base_model": base_model, "hardware": hardware,
                                             "processes": processes, "text_windows": text_windows or [],
                                             "expert": expert})

    def read_run_info(self) -> dict:
        return _read_json(self.run_info_file, dict)

    def read_status(self) -> dict:
        return _read_json(self.status_file, dict)

    def write_status(self, state: str, **fields) -> None:
        status = {**self.read_status(), **fields, "state": state, "updated_at": time.time()}
        self.write_json(self.status_file, status)

    def log(self, line: str) -> None:
        with self.log_file.open("a") as handle:
            handle.write(line.rstrip("\n") + "\n")

    def log_tail(self, max_bytes: int) -> str:
        """The last ``max_bytes`` of the job's output (``stdout.log``, else ``train.log``); "" if neither exists."""
        path = self.output_log if self.output_log.is_file() else self.log_file
        try:
            with path.open("rb") as handle:
                handle.seek(max(0, path.stat().st_size - max_bytes))
                return handle.read().decode(errors="replace")
        except OSError:
            return ""

    # ----- metrics ---------------------------------------------------------------------
    def append_metrics(self, row: dict) -> None:
        with self.metrics_file.open("a") as handle:
            handle.write(json.dumps(row) + "\n")

    def read_metrics(self) -> list[dict]:
        """The rows of metrics.jsonl with namespaced keys (old runs' flat keys renamed, see
        :func:`jagg_core.metrics.normalize`); a line cut by a kill mid-write, or not a row, is skipped."""
        if not self.metrics_file.is_file():
            return []
        rows = []
        for line in self.metrics_file.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get(metrics.ITERATION), int):
                rows.append(metrics.normalize(row))
        return rows

    def truncate_metrics(self, last_iteration: int) -> None:
        """Keep the rows up to ``last_iteration`` (on resume, iterations after the checkpoint rerun)."""
        rows = [r for r in self.read_metrics() if r[metrics.ITERATION] <= last_iteration]
        atomic_write_text(self.metrics_file, "".join(json.dumps(r) + "\n" for r in rows))

    # ----- images ----------------------------------------------------------------------
    def write_images(self, folder: Path, images: list, prompts: list[str], grid=None, videos: list | None = None,
                     fps: int = 16, **info) -> None:
        """Write PIL ``images`` as ``000.png ...`` with ``prompts.json`` (and ``info.json`` holding ``info``,
        e.g. rewards and iteration, and ``grid.png``, the PIL image ``grid`` of them all) into ``folder``, replacing
        it atomically. ``videos``: the frames (``uint8 [F, H, W, 3]``) of each sample, written as ``000.mp4 ...`` at
        ``fps`` (the images are then their strips)."""
        def fill(tmp: Path) -> None:
            for i, image in enumerate(images):
                image.save(tmp / f"{i:03d}.png")
            for i, frames in enumerate(videos or []):
                write_mp4(tmp / f"{i:03d}.mp4", frames, fps)
            if grid is not None:
                grid.save(tmp / GRID_FILE)
            (tmp / "prompts.json").write_text(json.dumps(prompts, indent=1))
            if info:
                (tmp / "info.json").write_text(json.dumps(info, indent=1))

        replace_folder(folder, fill)

    @staticmethod
    def read_images(folder: Path) -> ImageSet | None:
        """The images of ``folder`` (written by :meth:`write_images`), or None while it is not complete."""
        images = sorted(folder.glob("[0-9][0-9][0-9].png"))
        prompts = _read_json(folder / "prompts.json", list)
        if not images or not prompts:
            return None
        info = _read_json(folder / "info.json", dict)
        rewards = info.get("rewards") if isinstance(info.get("rewards"), list) else []
        iteration = parse_iteration(folder.name)
        if iteration is None and isinstance(info.get("iteration"), int):
            iteration = info["iteration"]
        count = min(len(images), len(prompts))
        videos = sorted(folder.glob("[0-9][0-9][0-9].mp4"))[:count]
        return ImageSet(folder, iteration, images[:count], [str(p) for p in prompts[:count]], rewards[:count], videos)

    def sample_iterations(self) -> list[int]:
        """Iterations that have fixed-seed eval samples, oldest first (0 is the base model)."""
        found = (parse_iteration(p.name) for p in self.samples_root.glob("iter_*") if (p / "prompts.json").is_file())
        return sorted(i for i in found if i is not None)

    def grid_file(self, iteration: int) -> Path:
        """The captioned grid of an eval's samples (runs from before grids were written have none)."""
        return self.samples_dir(iteration) / GRID_FILE

    def samples(self, iteration: int) -> ImageSet | None:
        return self.read_images(self.samples_dir(iteration))

    def rollouts(self) -> ImageSet | None:
        return self.read_images(self.rollouts_dir)

    # ----- checkpoints -----------------------------------------------------------------
    def checkpoint_iterations(self) -> list[int]:
        """Iterations of the complete checkpoints, oldest first."""
        if not self.checkpoints_dir.is_dir():
            return []
        found = (parse_iteration(p.name) for p in self.checkpoints_dir.glob("iter_*") if (p / STATE_FILE).is_file())
        return sorted(i for i in found if i is not None)

    def latest_checkpoint(self) -> Path | None:
        iterations = self.checkpoint_iterations()
        return self.checkpoint_dir(iterations[-1]) if iterations else None

    def checkpoint_adapter(self, name: str) -> tuple[int, Path]:
        """The iteration and adapter file of checkpoint ``name`` (``iter_N``); a one-line error if there is none."""
        iteration = parse_iteration(name)
        if iteration is None:
            raise UserError(f"checkpoint '{name}' must look like iter_N, e.g. iter_000100")
        if iteration not in self.checkpoint_iterations():
            available = ", ".join(iteration_dirname(i) for i in self.checkpoint_iterations()) or "none"
            raise UserError(f"{self.path} has no checkpoint {iteration_dirname(iteration)}; available: {available}")
        return iteration, self.checkpoint_dir(iteration) / LORA_FILE

    def write_checkpoint(self, iteration: int, write_contents, keep: int) -> Path:
        """Call ``write_contents(tmp_folder)``, add the state file last, rename into place, prune."""
        final = self.checkpoint_dir(iteration)
        tmp = self.checkpoints_dir / f".tmp-{iteration_dirname(iteration)}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        write_contents(tmp)
        (tmp / STATE_FILE).write_text(json.dumps({"iteration": iteration, "time": time.time()}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in self.checkpoint_iterations()[:-keep]:
            shutil.rmtree(self.checkpoint_dir(old), ignore_errors=True)
        for stale in self.checkpoints_dir.glob(".tmp-*"):
            if not stale.name.endswith(f"-{os.getpid()}"):
                shutil.rmtree(stale, ignore_errors=True)
        return final

    # ----- the best adapter and the doctor's checklist ----------------------------------------
    def write_best(self, write_adapter, record: dict) -> None:
        """Replace ``RUN/best/`` atomically: ``write_adapter(folder)`` writes the adapter, then ``record`` goes to
        ``best.json`` (see the module's list)."""
        def fill(tmp: Path) -> None:
            write_adapter(tmp)
            (tmp / BEST_RECORD).write_text(json.dumps(record, indent=1))

        replace_folder(self.best_dir, fill)

    def write_best_record(self, record: dict) -> None:
        """Bring ``best.json`` up to date (the adapter stays)."""
        self.write_json(self.best_dir / BEST_RECORD, record)

    def read_best(self) -> dict:
        """``best.json`` when the best adapter exists; else an empty mapping."""
        return _read_json(self.best_dir / BEST_RECORD, dict) if self.best_lora_file.is_file() else {}

    def write_doctor(self, report: dict) -> None:
        self.write_json(self.doctor_file, report)

    def read_doctor(self) -> dict:
        return _read_json(self.doctor_file, dict)

    def publish_lora(self, checkpoint: Path) -> None:
        """Copy the checkpoint's adapter (its one or two files, :func:`adapter_files`) to ``RUN/lora/`` atomically."""
        def fill(tmp: Path) -> None:
            for file in adapter_files(checkpoint / LORA_FILE):
                shutil.copyfile(file, tmp / file.name)

        replace_folder(self.lora_dir, fill)
