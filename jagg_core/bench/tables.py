"""The bench's outputs: the Markdown tables, the reward-vs-seconds plot, the JSON."""

from __future__ import annotations

import json
from pathlib import Path

from ..report import cell, markdown_table, plot_curves
from .fidelity import format_fidelity
from .training import SETUP_LABELS


def format_tables(rows: list[dict]) -> str:
    """Markdown tables: train phase and routing, linearity per window, the train phase's rows as whole iterations
    (with the rollout), short trainings."""
    parts = []
    phase = [r for r in rows if r["section"] in ("train_phase", "routing")]
    if phase:
        parts.append(markdown_table(
            ["model", "params (M)", "mode", "W", "endpoints", "frac", "passes", "seconds", "speed-up",
             "peak mem (MB over base)", "mem ratio", "grad cosine", "grad rel err"],
            [[r["model"], f"{r['params_m']:g}", r["mode"], str(r["window"]), "joint" if r["joint"] else "seq",
              f"{r['frac']:g}", str(r["passes"]), f"{r['seconds']:.3f}", f"{r['speedup']:.2f}x",
              cell(r["peak_mem_mb"] - r["base_mem_mb"] if r["peak_mem_mb"] is not None else None, ".1f"),
              cell(r["peak_mem_ratio"], ".2f"), f"{r['grad_cosine']:.4f}", f"{r['grad_rel_err']:.4f}"]
             for r in phase]))
        linearity = {}
        for r in phase:
            if r["mode"] in ("cached", "cached_shared") and r["frac"] == 1 and r["joint"]:
                linearity.setdefault((r["model"], r["mode"], r["window"]), r["linearity"])
        parts.append("Linearity score per window, along the trajectory (noise -> data):\n\n" + markdown_table(
            ["model", "windows", "W", "scores"],
            [[m, "shared knots" if mode == "cached_shared" else "disjoint", str(w), " ".join(f"{s:.3f}" for s in sc)]
             for (m, mode, w), sc in linearity.items()]))
    timed = [r for r in phase if r.get("rollout_s") is not None]
    if timed:
        parts.append("Whole iterations on the same rollout batch (rollout + train phase; peak memory absolute):\n\n"
                     + markdown_table(
                         ["model", "mode", "W", "endpoints", "rollout s", "train s", "iteration s", "speed-up",
                          "rollout peak MB", "train peak MB"],
                         [[r["model"], r["mode"], str(r["window"]), "joint" if r["joint"] else "seq",
                           f"{r['rollout_s']:.3f}", f"{r['train_s']:.3f}", f"{r['iteration_s']:.3f}",
                           f"{r['iteration_speedup']:.2f}x", cell(r.get("rollout_peak_mem_mb"), ".0f"),
                           cell(r["peak_mem_mb"], ".0f")] for r in timed]))
    iteration = [r for r in rows if r["section"] == "iteration"]
    if iteration:
        parts.append("Whole iterations of short trainings of the default task (section 3); speed-up against the exact "
                     "backward with the default's rollout, and against Flow-GRPO's default:\n\n" + markdown_table(
                         ["model", "setup", "backward", "trained steps", "SDE", "reference", "rollout s", "train s",
                          "iteration s", "vs exact (default rollout)", "vs Flow-GRPO", "iteration s (median)",
                          "final reward (mean of seeds)", "audit s", "audit / iteration", "audit cosine"],
                         [[r["model"], SETUP_LABELS[r["setup"]], r["backward"], str(r["trained_steps"]),
                           "every step" if r["sde_every_step"] else "trained steps", r["reference"] or "-",
                           f"{r['rollout_s']:.3f}", f"{r['train_s']:.3f}", f"{r['seconds']:.3f}",
                           f"{r['speedup']:.2f}x", f"{r['whole_iteration_speedup']:.2f}x", f"{r['seconds_median']:.3f}",
                           f"{r['reward_final']:.4f}", cell(r.get("audit_s"), ".3f"), cell(r.get("audit_ratio"), ".1%"),
                           cell(r.get("audit_cosine"), ".4f")] for r in iteration]))
    fidelity = [r for r in rows if r["section"] == "fidelity"]
    if fidelity:
        parts.append("Fidelity along the trajectory (every step trained) and its predictors:\n\n"
                     + format_fidelity(fidelity).strip())
    return "\n\n".join(parts) + "\n"


def plot_rewards(rows: list[dict], path: str | Path) -> None:
    """Reward against wall-clock seconds of every seed's training, exact and JAGG."""
    iteration = [r for r in rows if r["section"] == "iteration" and r["model"] == rows[0]["model"]]
    series = [(f"{SETUP_LABELS[r['setup']]} ({r['backward']})", r["curves"]) for r in iteration]
    title = (f"{iteration[0]['model']}: rollout reward vs wall-clock ({iteration[0]['iterations']} iterations)"
             if iteration else "")
    plot_curves(series, title, "cumulative seconds (rollout + train)", "mean rollout reward", path)


def write_outputs(rows: list[dict], json_path=None, table_path=None, plot_path=None) -> str:
    """Write the JSON, the markdown table and the plot where asked; returns the table."""
    table = format_tables(rows)
    for path in (json_path, table_path, plot_path):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    if table_path:
        Path(table_path).write_text(table)
    if plot_path:
        plot_rewards(rows, plot_path)
    return table
