"""Whole iterations (section 3): short trainings of each setup, alternating iteration by iteration."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from .. import metrics
from ..config import RunConfig
from ..placement import trained_count
from ..trainer import Trainer
from .training import backward_label, comparison_setups
from .variants import BenchOptions, bench_config
from .workload import base_params_m


#: the setups of :func:`~jagg_core.bench.training.comparison_setups` timed here: the ones whose iteration does other
#: work (``cps`` and ``guard`` change a step's arithmetic, not its passes, so they cost the default's iteration;
#: ``reuse`` and ``dppo`` repeat the default's train phase)
ITERATION_SETUPS = ("flow_grpo", "exact", "default", "tree", "flat")


def iteration_setups(config: RunConfig) -> dict[str, list[str]]:
    """The setups of :data:`ITERATION_SETUPS` that apply to ``config``, with their changes
    (:func:`~jagg_core.bench.training.comparison_setups`)."""
    return {name: changes for name, changes in comparison_setups(config).items() if name in ITERATION_SETUPS}


def bench_iterations(model: str, options: BenchOptions) -> list[dict]:
    """Short trainings of ``model``'s bench config (:func:`bench_config`) under each of
    :func:`~jagg_core.bench.training.comparison_setups` in :data:`ITERATION_SETUPS`,
    alternating iteration by iteration, per seed.

    One row per setup: per-iteration seconds over every iteration but the first (the warm-up, unless
    there is only one), as the minimum of the rollout plus the minimum of the train phase (every
    iteration does the same work, so the minimum is the figure least disturbed by other processes,
    as in the train phase) and as the median; ``speedup`` = exact's seconds / the setup's (exact has the
    default's rollout), ``whole_iteration_speedup`` = Flow-GRPO's default's / the setup's; and each seed's reward
    curve as ``[cumulative seconds, rollout reward mean]`` points. The default setup runs the fidelity audit
    (:mod:`jagg_core.audit`) at every iteration, on the config's ``backward.audit_samples``: it changes nothing
    of the training and is timed apart, so its row also has the seconds of one audit (``audit_s``, the minimum),
    their ratio to the iteration's (``audit_ratio``) and the mean audited cosine (``audit_cosine``).
    """
    setups = iteration_setups(bench_config(model, options.overrides))
    times = {name: {"rollout": [], "train": [], "audit": []} for name in setups}
    cosines = {name: [] for name in setups}
    curves = {name: {} for name in setups}
    configs = {}
    first = 1 if options.iterations > 1 else 0
    with tempfile.TemporaryDirectory() as root:
        for seed in options.seeds:
            trainers = {}
            for name, changes in setups.items():
                config = bench_config(model, [*options.overrides, *changes, f"train.seed={seed}",
                                              f"train.iterations={options.iterations}",
                                              f"backward.audit_every={int(name == 'default')}"])
                configs[name] = config
                trainers[name] = Trainer(config, Path(root) / f"{name}-{seed}")
                trainers[name].setup()
                curves[name][str(seed)] = []
            for iteration in range(1, options.iterations + 1):
                for name, trainer in trainers.items():
                    row = trainer.iteration(iteration, evaluate=False)  # no held-out eval, no checkpoint
                    elapsed = row[metrics.TIME_ROLLOUT] + row[metrics.TIME_TRAIN]
                    curve = curves[name][str(seed)]
                    curve.append([(curve[-1][0] if curve else 0.0) + elapsed, row[metrics.REWARD_MEAN]])
                    if iteration > first:
                        times[name]["rollout"].append(row[metrics.TIME_ROLLOUT])
                        times[name]["train"].append(row[metrics.TIME_TRAIN])
                        if metrics.TIME_AUDIT in row:
                            times[name]["audit"].append(row[metrics.TIME_AUDIT])
                            cosines[name].append(row[metrics.JAGG_GRAD_COSINE])
            params_m, device = base_params_m(trainers["exact"]), str(trainers["exact"].accelerator.device)
    iteration_s = {name: min(times[name]["rollout"]) + min(times[name]["train"]) for name in setups}
    audit_s = {name: min(times[name]["audit"]) if times[name]["audit"] else None for name in setups}
    rows = []
    for name, config in configs.items():
        backward = config.backward
        rows.append({
            "section": "iteration", "setup": name, "model": model, "params_m": params_m,
            "mode": "exact" if backward.mode == "exact" else backward_label(config).split()[0],
            "window": backward.window if backward.mode == "jagg" else 1, "joint": backward.joint,
            "frac": backward.frac, "backward": backward_label(config),
            "trained_steps": trained_count(config.trainable_steps(), config.grpo.timestep_fraction),
            "sde_every_step": not config.grpo.ode_after_trained,
            "reference": config.grpo.kl_reference if config.grpo.kl_beta > 0 else None,
            "seconds": iteration_s[name], "rollout_s": min(times[name]["rollout"]),
            "train_s": min(times[name]["train"]),
            "seconds_median": statistics.median(r + t for r, t in zip(times[name]["rollout"], times[name]["train"])),
            "speedup": iteration_s["exact"] / iteration_s[name],
            "whole_iteration_speedup": iteration_s["flow_grpo"] / iteration_s[name],
            "iterations": options.iterations, "seeds": list(options.seeds),
            "reward_final": statistics.mean(c[-1][1] for c in curves[name].values()), "curves": curves[name],
            "peak_mem_ratio": None, "peak_mem_basis": None, "grad_cosine": None, "grad_rel_err": None,
            "audit_s": audit_s[name], "audit_ratio": audit_s[name] / iteration_s[name] if audit_s[name] else None,
            "audit_cosine": statistics.mean(cosines[name]) if cosines[name] else None, "device": device})
    return rows
