"""Whole trainings, exact backward against JAGG (``python -m jagg_core.bench --training``).

For every seed, the run config (the default task unless told) is trained to its full length twice, with
``backward.mode: exact`` and with the config's own JAGG backward, same seed (so the same prompts and initial
noise at every iteration until the adapters part), through :meth:`~jagg_core.trainer.Trainer.fit`. The fidelity
audit is off in both (it is timed apart anyway). Per run::

    gain     = held-out eval reward at the last iteration - at iteration 0 (the base model)
    minutes  = wall clock of the whole fit (rollouts, backward, evals, checkpoints) / 60
    train    = minutes of the train phase alone (the sum of time/train_s: the backward and the updates)
    gain/min = gain / minutes

and per backward the mean and the sample standard deviation over the seeds. ``--plot`` draws each run's held-out
reward against its wall clock.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from . import metrics
from .config import RunConfig
from .report import markdown_table, plot_curves
from .rundir import RunDirectory
from .trainer import Trainer

#: seeds of the comparison
SEEDS = (0, 1, 2)


def train_once(config: RunConfig, run_dir: Path) -> dict:
    """Train ``config`` into ``run_dir``; its gain, minutes and held-out curve ``[[seconds, reward], ...]``."""
    trainer = Trainer(config, run_dir)
    began = time.perf_counter()
    trainer.setup()
    trainer.fit()
    trainer.close()
    minutes = (time.perf_counter() - began) / 60
    elapsed, train_seconds, curve = 0.0, 0.0, []
    for row in RunDirectory(run_dir).read_metrics():
        elapsed += sum(row.get(key, 0.0) for key in metrics.PHASE_TIMES)
        train_seconds += row.get(metrics.TIME_TRAIN, 0.0)
        if metrics.EVAL_REWARD_MEAN in row:
            curve.append([elapsed, row[metrics.EVAL_REWARD_MEAN]])
    gain = curve[-1][1] - curve[0][1]
    return {"gain": gain, "minutes": minutes, "train_minutes": train_seconds / 60, "gain_per_minute": gain / minutes,
            "curve": curve}


def training_rows(base: RunConfig, seeds=SEEDS) -> list[dict]:
    """One row per backward (exact, then ``base``'s JAGG): each seed's run, and the mean and spread of its
    figures."""
    runs: dict[str, dict[int, dict]] = {"exact": {}, "jagg": {}}
    with tempfile.TemporaryDirectory() as root:
        for seed in seeds:
            for mode in runs:
                config = base.model_copy(deep=True)
                config.train.seed = seed
                config.backward = config.backward.model_copy(update={"audit_every": 0, "mode": mode})
                runs[mode][seed] = train_once(config, Path(root) / f"{mode}-{seed}")
    rows = []
    for mode, by_seed in runs.items():
        row = {"section": "training", "model": base.model.name, "mode": mode,
               "window": base.backward.window if mode == "jagg" else 1, "iterations": base.train.iterations,
               "seeds": list(seeds), "runs": {str(seed): run for seed, run in by_seed.items()}}
        for key in ("gain", "minutes", "train_minutes", "gain_per_minute"):
            values = [run[key] for run in by_seed.values()]
            row[key] = statistics.mean(values)
            row[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else None
        rows.append(row)
    return rows


def format_training(rows: list[dict]) -> str:
    """Markdown: per backward, the mean ± sample standard deviation over the seeds."""
    def spread(row, key, spec):
        std = row[f"{key}_std"]
        return format(row[key], spec) + (f" ± {format(std, spec.lstrip('+'))}" if std is not None else "")
    header = ["model", "backward", "iterations", "seeds", "held-out gain", "minutes", "train-phase minutes",
              "gain per minute"]
    lines = [[r["model"], "exact" if r["mode"] == "exact" else f"JAGG W={r['window']}", str(r["iterations"]),
              str(len(r["seeds"])), spread(r, "gain", "+.4f"), spread(r, "minutes", ".2f"),
              spread(r, "train_minutes", ".2f"), spread(r, "gain_per_minute", "+.4f")] for r in rows]
    return markdown_table(header, lines) + "\n"


def plot_training(rows: list[dict], path: str | Path) -> None:
    """Held-out reward against wall-clock seconds of every run."""
    series = [("exact" if r["mode"] == "exact" else f"JAGG W={r['window']}",
               {seed: run["curve"] for seed, run in r["runs"].items()}) for r in rows]
    plot_curves(series, f"{rows[0]['model']}: held-out reward vs wall-clock ({rows[0]['iterations']} iterations)",
                "cumulative seconds (rollout + train + eval)", "held-out eval reward", path)
