"""``python -m jagg_core.compare``: runs side by side, on fabricated run directories with known figures."""

from __future__ import annotations


import pytest
import yaml
from PIL import Image

from jagg_core import compare, metrics
from jagg_core.rundir import RunDirectory

from conftest import ROOT
from zygote import run_python


def fabricated_run(root, name: str, evals: dict[int, float], judge: dict[int, float], seconds: float,
                   algorithm: str = "grpo", colour: str = "red"):
    """A run whose iterations each take ``seconds`` (rollout + train), with eval rows and a grid at ``evals``'s
    iterations."""
    run = RunDirectory(root / name)
    run.write_config(yaml.safe_dump({"name": name, "model": {"name": "jagg-shapes"},
                                     "train": {"algorithm": algorithm, "iterations": max(evals)}}))
    run.create()
    for iteration in range(max(evals) + 1):
        row = {metrics.ITERATION: iteration}
        if iteration:
            row.update({metrics.REWARD_MEAN: 0.5, metrics.TIME_ROLLOUT: seconds / 2, metrics.TIME_TRAIN: seconds / 2})
        if iteration in evals:
            row.update({metrics.EVAL_REWARD_MEAN: evals[iteration], metrics.judge_key("fidelity"): judge[iteration]})
            sample = Image.new("RGB", (32, 32), colour)
            run.write_images(run.samples_dir(iteration), [sample], ["a prompt"], grid=Image.new("RGB", (64, 48), colour))
        run.append_metrics(row)
    return run.path


@pytest.fixture
def runs(tmp_path):
    fast = fabricated_run(tmp_path, "nft-run", {0: 0.70, 5: 0.74, 10: 0.78}, {0: 0.9, 5: 0.9, 10: 0.85}, 6.0, "nft")
    slow = fabricated_run(tmp_path, "grpo-run", {0: 0.70, 10: 0.80, 20: 0.82}, {0: 0.9, 10: 0.91, 20: 0.92}, 12.0,
                          colour="blue")
    return fast, slow


def test_the_table_gives_each_runs_gain_per_training_minute(runs):
    text = compare.table(compare.read_runs(list(runs)))
    lines = text.splitlines()
    assert lines[0].startswith("| run | algorithm | model | iterations | minutes | base eval | last eval | gain |")
    assert "judge fidelity change" in lines[0]
    # nft-run: 10 iterations of 6 s = 1 minute, gain 0.08; grpo-run: 20 of 12 s = 4 minutes, gain 0.12
    assert "| `nft-run` | nft | `jagg-shapes` | 10 | 1.00 | 0.7000 | 0.7800 | +0.0800 | +0.0800 | – | -0.0500 |" in lines
    assert "| `grpo-run` | grpo | `jagg-shapes` | 20 | 4.00 | 0.7000 | 0.8200 | +0.1200 | +0.0300 | – | +0.0200 |" in lines


def test_the_curves_follow_iterations_and_minutes(runs):
    points = compare.curves(compare.read_runs(list(runs)))
    nft = [(p["iteration"], p["minutes"], p["value"]) for p in points
           if p["run"] == "nft-run" and p["metric"] == "held-out reward"]
    assert nft == [(0, 0.0, 0.70), (5, 0.5, 0.74), (10, 1.0, 0.78)]
    assert {p["metric"] for p in points} == {"held-out reward", "judge fidelity"}


def test_the_cli_writes_the_plot_the_table_and_the_grids_side_by_side(runs, tmp_path):
    out = tmp_path / "out"
    result = run_python(["-m", "jagg_core.compare", *map(str, runs), "--out", str(out)], cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert (out / "compare.md").read_text() in result.stdout
    with Image.open(out / "compare.png") as plot:
        assert plot.width >= 1000 and plot.height >= 600  # two rows (reward, judge) of two panels
    with Image.open(out / "compare_grids.png") as grids:
        assert grids.size == (64 + 12 + 64, 28 + 48)  # iteration 10, the last both have
        assert grids.getpixel((10, 40)) == (255, 0, 0) and grids.getpixel((64 + 12 + 10, 40)) == (0, 0, 255)


@pytest.mark.parametrize("args, message", [
    (["{fast}"], "give two or more run directories to compare"),
    (["{fast}", "{tmp}/nothing"], "is not a JAGG run directory"),
    (["{fast}", "{slow}", "--iteration", "5"], "grpo-run has no eval grid of iteration 5; iterations all runs have: 0, 10"),
])
def test_bad_input_is_one_line(runs, tmp_path, args, message):
    fast, slow = runs
    args = [a.format(fast=fast, slow=slow, tmp=tmp_path) for a in args]
    result = run_python(["-m", "jagg_core.compare", *args, "--out", str(tmp_path / "out")], cwd=ROOT)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("jagg_core.compare: error: ")
    assert message in lines[0]
