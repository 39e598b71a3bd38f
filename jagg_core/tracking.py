"""Experiment trackers (TensorBoard, trackio, Weights & Biases) through accelerate.

With ``train.report_to`` set, every metrics row goes to each tracker under its namespaced keys
(:mod:`jagg_core.metrics`), at the iteration as step, and each eval's fixed-seed samples as one
grid image (``eval/samples``). TensorBoard writes under ``RUN/tracking/NAME`` (``tensorboard
--logdir RUN/tracking``); trackio keeps its local database in ``$TRACKIO_DIR`` (default
``~/.cache/huggingface/trackio``; ``trackio show --project NAME``); W&B logs to its server.
"""

from __future__ import annotations

import importlib.util
import json

from .config import RunConfig, flat_keys
from .errors import UserError
from .rundir import RunDirectory

#: tracker name -> the package it needs
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb"}
EVAL_GRID = "eval/samples"


def check_trackers(names: list[str]) -> None:
    """Each tracker's package is installed; otherwise one line saying how to get it."""
    for name in names:
        package = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise UserError(f"train.report_to names {name}, but the '{package}' package is not installed; "
                            f"run `pip install {package}`, or remove {name} from train.report_to")


def flat_config(config: RunConfig) -> dict:
    """The config as ``section/key -> scalar`` (what trackers store as hyper-parameters): the leaves of
    :func:`~jagg_core.config.flat_keys`, a list or mapping as its JSON text."""
    return {key: value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
            for key, value in flat_keys(config.model_dump(mode="json"), separator="/").items()}


def start_trackers(accelerator, config: RunConfig, run: RunDirectory) -> None:
    """Open the configured trackers for this run (a resumed run continues the same tracker run)."""
    if not config.train.report_to:
        return
    name = run.path.name
    accelerator.init_trackers(config.name, config=flat_config(config), init_kwargs={
        "trackio": {"name": name, "resume": "allow"},
        "wandb": {"name": name, "id": name, "resume": "allow", "dir": str(run.tracking_dir)}})


def log_row(accelerator, row: dict) -> None:
    """One metrics row, its numbers (booleans as 0/1) at its iteration."""
    from . import metrics

    values = {key: float(value) for key, value in row.items()
              if key != metrics.ITERATION and isinstance(value, (bool, int, float))}
    accelerator.log(values, step=row[metrics.ITERATION])


def log_eval_grid(accelerator, grid, step: int) -> None:
    """The eval samples' grid (a PIL image) to every tracker, in the form each takes images."""
    for tracker in accelerator.trackers:
        if tracker.name == "tensorboard":
            import numpy as np
            tracker.log_images({EVAL_GRID: np.asarray(grid)[None]}, step=step, dataformats="NHWC")
        elif tracker.name == "wandb":
            tracker.log_images({EVAL_GRID: [grid]}, step=step)
        elif tracker.name == "trackio":
            import trackio
            tracker.log({EVAL_GRID: trackio.Image(grid, caption="held-out prompts, fixed seeds")}, step=step)


def dashboard_hints(config: dict, run: RunDirectory) -> list[str]:
    """How to open each configured tracker's dashboard, for a run's config mapping."""
    hints = {"tensorboard": f"TensorBoard: `tensorboard --logdir {run.tracking_dir}`",
             "trackio": f"trackio: `trackio show --project {config.get('name', 'run')}`",
             "wandb": f"W&B: project `{config.get('name', 'run')}`, run `{run.path.name}`"}
    return [hints[name] for name in (config.get("train") or {}).get("report_to") or [] if name in hints]
