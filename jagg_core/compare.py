"""Runs side by side: their held-out reward and judges against iterations and against training minutes, a table, and
their eval grids of one iteration next to each other.

    python -m jagg_core.compare RUN RUN [RUN ...] [--out DIR] [--iteration N]

writes ``DIR/compare.png`` (the curves), ``DIR/compare.md`` (the table) and ``DIR/compare_grids.png`` (each run's
captioned eval grid of iteration ``N``, default the last eval iteration every run has), and prints the table. The
page's Compare section shows the same (:func:`curves`, :func:`table`, :func:`grids_at`). Minutes are training
minutes: the sum of an iteration's phases (rollout, update, audit, eval) up to each eval, loading excluded, as the
model card counts them. Everything is read from the run directories; nothing is written there.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from . import metrics
from .errors import UserError, exit_on_user_error, made_folder
from .rundir import RunDirectory

PROG = "jagg_core.compare"
CURVES_FILE = "compare.png"
TABLE_FILE = "compare.md"
GRIDS_FILE = "compare_grids.png"


@dataclass
class RunCurves:
    """One run's evals: iteration, training minutes so far and each eval metric (``eval/reward_mean``, judges)."""

    name: str
    path: Path
    algorithm: str
    model: str
    evals: list[dict]          # {"iteration", "minutes", metric key: value}
    best: dict                 # RUN/best/best.json, or {}

    def values(self, key: str) -> list[tuple[int, float, float]]:
        """``(iteration, minutes, value)`` of every eval that measured ``key``."""
        return [(e["iteration"], e["minutes"], e[key]) for e in self.evals if isinstance(e.get(key), (int, float))]


def read_curves(path: str | Path) -> RunCurves:
    """A run's evals; a folder that holds no run is a one-line :class:`UserError`."""
    run = RunDirectory(path)
    config = run.read_config()  # raises when there is no run
    seconds, evals = 0.0, []
    for row in run.read_metrics():
        seconds += metrics.seconds(row)
        if isinstance(row.get(metrics.EVAL_REWARD_MEAN), (int, float)):
            measured = {k: v for k, v in row.items() if k == metrics.EVAL_REWARD_MEAN or k.startswith(metrics.JUDGE_PREFIX)}
            evals.append({"iteration": row[metrics.ITERATION], "minutes": seconds / 60, **measured})
    return RunCurves(run.path.name, run.path, (config.get("train") or {}).get("algorithm", "grpo"),
                     str((config.get("model") or {}).get("name", "")), evals, run.read_best())


def read_runs(paths: list[str | Path]) -> list[RunCurves]:
    if len(paths) < 2:
        raise UserError("give two or more run directories to compare")
    runs = [read_curves(path) for path in paths]
    empty = [r.name for r in runs if not r.evals]
    if empty:
        raise UserError(f"{', '.join(empty)} has no eval yet (not even the base model's); wait for its first eval")
    return runs


def judge_keys(runs: list[RunCurves]) -> list[str]:
    """The judge metrics any of the runs measured, in the order first seen."""
    keys = (k for r in runs for e in r.evals for k in e if k.startswith(metrics.JUDGE_PREFIX))
    return list(dict.fromkeys(keys))


def table(runs: list[RunCurves]) -> str:
    """One Markdown row per run: its algorithm and model, its length in iterations and training minutes, the
    held-out reward of the base model and of its last eval, the gain and the gain per minute, its best adapter, and
    each judge's change since the base model."""
    judges = judge_keys(runs)
    header = ["run", "algorithm", "model", "iterations", "minutes", "base eval", "last eval", "gain", "gain / min",
              "best", *(f"judge {key.removeprefix(metrics.JUDGE_PREFIX)} change" for key in judges)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        first, last = run.evals[0], run.evals[-1]
        gain = last[metrics.EVAL_REWARD_MEAN] - first[metrics.EVAL_REWARD_MEAN]
        per_minute = f"{gain / last['minutes']:+.4f}" if last["minutes"] > 0 else "–"
        best = f"{run.best['value']:.4f} at {run.best['iteration']}" if run.best else "–"
        changes = [f"{last[key] - first[key]:+.4f}" if key in first and key in last else "–" for key in judges]
        cells = [f"`{run.name}`", run.algorithm, f"`{run.model}`", str(last["iteration"]), f"{last['minutes']:.2f}",
                 f"{first[metrics.EVAL_REWARD_MEAN]:.4f}", f"{last[metrics.EVAL_REWARD_MEAN]:.4f}", f"{gain:+.4f}",
                 per_minute, best, *changes]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def curves(runs: list[RunCurves]) -> list[dict]:
    """Long-format points for plotting: ``{"run", "metric", "iteration", "minutes", "value"}``, the metric in words
    (``held-out reward``, ``judge NAME``)."""
    points = []
    for run in runs:
        for key in [metrics.EVAL_REWARD_MEAN, *judge_keys(runs)]:
            label = "held-out reward" if key == metrics.EVAL_REWARD_MEAN else \
                f"judge {key.removeprefix(metrics.JUDGE_PREFIX)}"
            points += [{"run": run.name, "metric": label, "iteration": i, "minutes": m, "value": v}
                       for i, m, v in run.values(key)]
    return points


def curves_png(runs: list[RunCurves], path: str | Path) -> None:
    """The held-out reward (top) and each judge (below) of every run, against iterations (left) and training minutes
    (right)."""
    from matplotlib.figure import Figure

    keys = [metrics.EVAL_REWARD_MEAN, *judge_keys(runs)]
    fig = Figure(figsize=(11, 3.4 * len(keys)), dpi=100)
    axes = fig.subplots(len(keys), 2, squeeze=False)
    for row, key in enumerate(keys):
        label = "held-out reward" if key == metrics.EVAL_REWARD_MEAN else \
            f"judge {key.removeprefix(metrics.JUDGE_PREFIX)}"
        for run in runs:
            points = run.values(key)
            for column, x in enumerate(([p[0] for p in points], [p[1] for p in points])):
                axes[row][column].plot(x, [p[2] for p in points], "o-", label=run.name)
        for column, x_label in enumerate(("iteration", "training minutes")):
            axis = axes[row][column]
            axis.set_xlabel(x_label)
            axis.set_ylabel(label)
            axis.grid(alpha=0.3)
        axes[row][0].legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def common_iterations(runs: list[RunCurves]) -> list[int]:
    """The eval iterations every run has an eval grid of, oldest first."""
    shared = set.intersection(*(set(RunDirectory(r.path).sample_iterations()) for r in runs))
    return sorted(i for i in shared if all(RunDirectory(r.path).grid_file(i).is_file() for r in runs))


def grids_at(runs: list[RunCurves], iteration: int | None = None) -> list[tuple[str, str]]:
    """``(grid png, caption)`` of each run's eval grid of ``iteration`` (default: the last one all runs have); a
    one-line :class:`UserError` when a run has none there."""
    shared = common_iterations(runs)
    if iteration is None:
        if not shared:
            raise UserError("the runs have no eval iteration in common; pass --iteration N of one each has")
        iteration = shared[-1]
    missing = [r.name for r in runs if not RunDirectory(r.path).grid_file(iteration).is_file()]
    if missing:
        raise UserError(f"{', '.join(missing)} has no eval grid of iteration {iteration}; iterations all runs have: "
                        f"{', '.join(map(str, shared)) or 'none'}")
    return [(str(RunDirectory(r.path).grid_file(iteration)), f"{r.name} · iteration {iteration}") for r in runs]


def grids_png(grids: list[tuple[str, str]], path: str | Path) -> None:
    """The grids next to each other, each under its caption."""
    from PIL import Image, ImageDraw, ImageFont

    pictures = [Image.open(png).convert("RGB") for png, _ in grids]
    label, gap = 28, 12
    width = sum(p.width for p in pictures) + gap * (len(pictures) - 1)
    sheet = Image.new("RGB", (width, label + max(p.height for p in pictures)), "white")
    draw, font, left = ImageDraw.Draw(sheet), ImageFont.load_default(size=16), 0
    for picture, (_, caption) in zip(pictures, grids):
        draw.text((left + 4, 4), caption, fill="black", font=font)
        sheet.paste(picture, (left, label))
        left += picture.width + gap
    sheet.save(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    parser.add_argument("--out", default=".", help="folder for compare.png, compare.md, compare_grids.png")
    parser.add_argument("--iteration", type=int, help="the eval iteration whose grids go side by side (default: "
                        "the last one all runs have)")
    args = parser.parse_args(argv)
    with exit_on_user_error(PROG):
        runs = read_runs(args.runs)
        out = made_folder(Path(args.out))
        text = table(runs)
        (out / TABLE_FILE).write_text(text)
        curves_png(runs, out / CURVES_FILE)
        grids_png(grids_at(runs, args.iteration), out / GRIDS_FILE)
        print(text, end="")
        print(f"wrote {out / CURVES_FILE}, {out / TABLE_FILE}, {out / GRIDS_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
