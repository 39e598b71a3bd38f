"""Fidelity along the trajectory, and how well routing predicts it (``python -m jagg_core.bench --fidelity``).

For each noise level ``a`` and window layout, rollouts ``1..R`` of the embedded model with every step trained
(``grpo.timestep_fraction = 1``, SDE at every step) are audited (:mod:`jagg_core.audit`, on the whole rollout
batch, every window with interior steps under JAGG): each window k gets its true fidelity
``c_k = cos(JAGG gradient of window k, its exact gradient)``. Two predictors of ``c_k``, known before the
backward, are ranked against it::

    linearity  the window's linearity score on this rollout (:func:`~jagg_core.jagg.linearity_score`)
    audit      c_k of the previous rollout: the latest audit's cosine, as a router refreshed by audits sees it

with Spearman's rank correlation across the windows of one rollout (rho = Pearson correlation of the ranks, ties
given their mean rank), averaged over the rollouts that have both (the audit predictor starts at rollout 2).
The LoRA is the run's initial one (its B at zero: the gradient of the first update).
"""

from __future__ import annotations

import statistics
import tempfile

from .. import metrics
from ..config import BackwardConfig, RunConfig
from ..jagg import linearity_score
from ..report import markdown_table
from ..trainer import Trainer

#: (window, shared_knots): W = 3 leaves windows with one interior step each; disjoint: 3 of them on 10 steps,
#: shared knots: 4
LAYOUTS = ((3, False), (3, True))
NOISE_LEVELS = (0.7, 1.2)


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties given their mean rank."""
    order = sorted(range(len(values)), key=lambda k: values[k])
    result = [0.0] * len(values)
    first = 0
    while first < len(order):
        last = first
        while last + 1 < len(order) and values[order[last + 1]] == values[order[first]]:
            last += 1
        for position in range(first, last + 1):
            result[order[position]] = (first + last) / 2 + 1
        first = last + 1
    return result


def spearman(x: list[float], y: list[float]) -> float | None:
    """Spearman's rho of two equal-length lists; None when either is constant (no ranking)."""
    rx, ry = ranks(x), ranks(y)
    if len(set(rx)) < 2 or len(set(ry)) < 2:
        return None
    return statistics.correlation(rx, ry)


def fidelity_rows(base: RunConfig, rollouts: int, noise_levels=NOISE_LEVELS, layouts=LAYOUTS) -> list[dict]:
    """One row per noise level and layout of the run config ``base`` with every step trained: the mean true cosine
    of every window along the trajectory, and each predictor's mean Spearman rho (with the number of rollouts it
    is averaged over)."""
    rows, model = [], base.model.name
    for noise in noise_levels:
        with tempfile.TemporaryDirectory() as run_dir:
            config = base.model_copy(deep=True)
            config.sampling.noise_level = noise
            config.grpo = config.grpo.model_copy(update={"timestep_fraction": 1.0, "ode_after_trained": False,
                                                         "window_placement": "range", "trained_start": 0})
            trainer = Trainer(config, run_dir)
            trainer.setup()
            batches = [trainer.rollout(iteration) for iteration in range(1, rollouts + 1)]
            for window, shared in layouts:
                backward = BackwardConfig(mode="jagg", window=window, shared_knots=shared, velocities="cached",
                                          joint=True, audit_samples=config.grpo.num_generations
                                          * config.grpo.prompts_per_iteration)
                trainer.config.backward = backward
                true, linearity = [], []
                for rollout in batches:
                    advantages = trainer.advantages(rollout)
                    plan = trainer.algorithm.plan_backward(rollout.trajectory, rollout.spans, backward)
                    audited = trainer.algorithm.audit(rollout, advantages, plan)
                    interior = [k for k, win in enumerate(plan.windows) if len(win.intermediates) > 0]
                    true.append([audited[metrics.JAGG_WINDOW_COSINES][k] for k in interior])
                    traj = rollout.trajectory
                    linearity.append([linearity_score(traj.velocities, traj.sigmas, plan.windows[k]) for k in interior])
                rho = {"linearity": [spearman(s, c) for s, c in zip(linearity, true)],
                       "audit": [spearman(before, c) for before, c in zip(true, true[1:])]}
                rho = {name: [r for r in values if r is not None] for name, values in rho.items()}
                rows.append({"section": "fidelity", "model": model, "noise_level": noise, "window": window,
                             "shared_knots": shared, "rollouts": rollouts,
                             "windows": [[w.start, w.end] for w in plan.windows if len(w.intermediates) > 0],
                             "window_cosines": [statistics.mean(c) for c in zip(*true)],
                             "window_cosines_min": [min(c) for c in zip(*true)],
                             "linearity": [statistics.mean(s) for s in zip(*linearity)],
                             **{f"spearman_{name}": statistics.mean(r) if r else None for name, r in rho.items()},
                             **{f"spearman_{name}_n": len(r) for name, r in rho.items()}})
    return rows


def format_fidelity(rows: list[dict]) -> str:
    """Markdown: per-window fidelity along the trajectory, and the predictors' rank correlations."""
    header = ["model", "noise", "W", "windows", "mean cosine per window (noise -> data)", "min cosine",
              "linearity score", "Spearman linearity", "Spearman last audit"]
    lines = []
    for r in rows:
        def rho(name):
            value = r[f"spearman_{name}"]
            return "-" if value is None else f"{value:+.2f} (n={r[f'spearman_{name}_n']})"
        lines.append([r["model"], f"{r['noise_level']:g}", f"{r['window']}{' shared' if r['shared_knots'] else ''}",
                      " ".join(f"{a}-{b}" for a, b in r["windows"]),
                      " ".join(f"{c:.4f}" for c in r["window_cosines"]),
                      " ".join(f"{c:.4f}" for c in r["window_cosines_min"]),
                      " ".join(f"{s:.4f}" for s in r["linearity"]), rho("linearity"), rho("audit")])
    return markdown_table(header, lines) + "\n"
