"""Whole trainings, the default against the exact backward, Flow-GRPO's default iteration, tree or flat rollouts,
the policy losses, the advantages of several rewards and the forward-process algorithms (``python -m jagg_core.bench
--training [--setups flow_grpo,exact,default,flat,cps,guard,reuse,dppo,per_reward,dora,nft,awm]``).

For every seed, the run config (the default task unless told) is trained to its full length under each setup of
:func:`comparison_setups` named by ``--setups`` (default ``exact,default``): ``flow_grpo`` (Flow-GRPO's default
iteration), ``exact`` (the config with ``backward.mode: exact``), ``default`` (the config as it is), ``tree`` or
``flat`` (the config with or without tree rollouts), ``nft`` and ``awm`` (DiffusionNFT and AWM as their presets for
the default task set them, :data:`ALGORITHM_PRESETS`), same seed (so the same prompts at every iteration until the
adapters part), through
:meth:`~jagg_core.trainer.Trainer.fit`. The fidelity audit is off in all (it is timed apart anyway), and so are the
doctor and the judges (:data:`UNTIMED_CHECKS_OFF`). Per run::

    gain     = held-out eval reward at the last iteration - at iteration 0 (the base model)
    minutes  = wall clock of the whole fit (rollouts, backward, evals, checkpoints) / 60
    train    = minutes of the train phase alone (the sum of time/train_s: the backward and the updates)
    gain/min = gain / minutes

(with several rewards, also each reward's own held-out gain, ``eval/reward/NAME`` at the last iteration - at
iteration 0: what ``grpo.multi_reward`` shares out) and per setup the mean and the sample standard deviation over
the seeds. ``--plot`` draws each run's held-out reward against its wall clock. With ``--journal FILE`` every
finished run is appended to FILE (one JSON line: setup, seed, the run config's fingerprint and the run's figures)
and a later bench with the same FILE reuses the runs whose setup, seed and config match instead of training them
again, so a bench of hours that is stopped loses only the run it was in.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

from .. import metrics
from ..config import RunConfig, load_config, term_names, with_overrides
from ..errors import UserError
from ..report import markdown_table, plot_curves
from ..rundir import RunDirectory
from ..trainer import Trainer

#: seeds of the comparison
SEEDS = (0, 1, 2)


def train_once(config: RunConfig, run_dir: Path) -> dict:
    """Train ``config`` into ``run_dir``; its gain, minutes and held-out curve ``[[seconds, reward], ...]``; with
    several rewards, each one's held-out gain (``term_gains``)."""
    trainer = Trainer(config, run_dir)
    began = time.perf_counter()
    trainer.setup()
    trainer.fit()
    trainer.close()
    minutes = (time.perf_counter() - began) / 60
    elapsed, train_seconds, curve, evals = 0.0, 0.0, [], []
    for row in RunDirectory(run_dir).read_metrics():
        elapsed += sum(row.get(key, 0.0) for key in metrics.PHASE_TIMES)
        train_seconds += row.get(metrics.TIME_TRAIN, 0.0)
        if metrics.EVAL_REWARD_MEAN in row:
            curve.append([elapsed, row[metrics.EVAL_REWARD_MEAN]])
            evals.append(row)
    gain = curve[-1][1] - curve[0][1]
    run = {"gain": gain, "minutes": minutes, "train_minutes": train_seconds / 60, "gain_per_minute": gain / minutes,
           "curve": curve}
    if len(config.rewards) > 1:
        terms = term_names([spec.name for spec in config.rewards])
        run["term_gains"] = {term: evals[-1][metrics.eval_reward_part(term)] - evals[0][metrics.eval_reward_part(term)]
                             for term in terms}
    return run


#: Flow-GRPO trains int(0.99 N) of the N rollout steps (its default timestep_fraction)
FLOW_GRPO_TIMESTEP_FRACTION = 0.99
#: Flow-GRPO's default noise level a (its configs' sample.noise_level)
FLOW_GRPO_NOISE_LEVEL = 0.7


def comparison_setups(config: RunConfig) -> dict[str, list[str]]:
    """The setups compared, in whole iterations (``python -m jagg_core.bench``, section 3) and whole trainings, as
    changes to ``config``:

    - ``flow_grpo``: Flow-GRPO's default iteration: every step SDE at its noise level
      (:data:`FLOW_GRPO_NOISE_LEVEL`), the exact backward over its trained steps (``int(0.99 N)`` from the noise
      end: the fraction is written half a step under that count, for our ceil), the reference velocities in the
      rollout;
    - ``exact``: the config's own rollout settings with the exact backward;
    - ``default``: the config as it is (on the CPU models the project's default task: JAGG, ODE outside the trained
      steps, the reference in the training pass);
    - ``tree``: the config with tree rollouts, ``grpo.branch_factor`` :data:`TREE_BRANCH_FACTOR` (when the config
      has none, the group size is a power of it and the trained steps hold the splits);
    - ``flat``: the config without its tree rollouts (when it has them: the default task's), every sample its own
      path;
    - ``cps``: the config with Flow-CPS's coefficients-preserving rollout step at its largest noise
      (:data:`CPS_NOISE_LEVEL`);
    - ``guard``: the config with GRPO-Guard's policy loss;
    - ``reuse``: the config with two optimizer steps on each rollout batch (``grpo.inner_epochs: 2``, PPO's clip);
    - ``per_reward``: the config with each reward's own group advantage (``grpo.multi_reward: per_reward``,
      DanceGRPO's), where ``default`` takes the advantage of their weighted sum;
    - ``dppo``: ``reuse`` with DPPO's trust region in place of the clip;
    - ``dora``: the config with a DoRA in place of its LoRA (``lora.use_dora``), its rank, alpha and learning rate."""
    steps = config.sampling.num_steps
    flow_grpo_steps = int(FLOW_GRPO_TIMESTEP_FRACTION * steps)
    setups = {"flow_grpo": [f"sampling.noise_level={FLOW_GRPO_NOISE_LEVEL}", "grpo.ode_after_trained=false",
                            "grpo.shared_prefix=false", "grpo.branch_factor=0", "grpo.kl_reference=rollout",
                            "grpo.window_placement=range", "grpo.trained_start=0", "grpo.slide_every=0",
                            f"grpo.timestep_fraction={(flow_grpo_steps - 0.5) / steps}", "backward.mode=exact"],
              "exact": ["backward.mode=exact"],
              "default": [],
              "cps": ["sampling.sde_type=cps", f"sampling.noise_level={CPS_NOISE_LEVEL}"],
              "guard": ["grpo.policy_loss=guard"],
              "reuse": ["grpo.inner_epochs=2"],
              "per_reward": ["grpo.multi_reward=per_reward"],
              "dppo": ["grpo.inner_epochs=2", "grpo.policy_loss=dppo"],
              "dora": ["lora.use_dora=true"]}
    if config.grpo.branch_factor:
        return {**setups, "flat": ["grpo.branch_factor=0"]}
    tree = [f"grpo.branch_factor={TREE_BRANCH_FACTOR}"]
    try:
        with_overrides(config, tree)
    except UserError:  # the group cannot split that way
        return setups
    return {**setups, "tree": tree}


#: the branch factor of the ``tree`` setup (BranchGRPO's)
TREE_BRANCH_FACTOR = 2
#: the noise level a of the ``cps`` setup: its step's noise s' sin(a pi / 2) is largest at a = 1 (std s': each step
#: keeps none of the noise it predicts and draws it afresh)
CPS_NOISE_LEVEL = 1.0

#: the forward-process setups: each one is its preset for the default task (the algorithm with its settings, learning
#: rate, groups and length), on the bench's model
ALGORITHM_PRESETS = {"nft": "shapes-nft", "awm": "shapes-awm"}

#: the checks a user switches on or off beside the training, off in every setup: the first iteration's doctor and
#: the judges' scoring of the eval samples (the bench's rows from before they existed trained without them)
UNTIMED_CHECKS_OFF = ["train.doctor=false", "eval.judges=[]"]

#: the setups' names in tables and plots
SETUP_LABELS = {"flow_grpo": "Flow-GRPO default", "exact": "exact, same rollout", "default": "default",
                "tree": "default, tree rollout", "flat": "default, flat rollout", "cps": "default, CPS rollout",
                "guard": "default, GRPO-Guard",
                "reuse": "default, 2 steps a rollout", "dppo": "default, 2 steps a rollout, DPPO",
                "per_reward": "default, each reward's own advantage", "dora": "default, DoRA",
                "nft": "DiffusionNFT", "awm": "AWM"}


def setup_label(name: str) -> str:
    """The setup's name in tables and plots; a composed setup ``a+b`` (:func:`setup_configs`) names the first part
    and then the others' changes: ``guard+tree`` is "default, GRPO-Guard, tree rollout"."""
    first, *rest = (SETUP_LABELS[part] for part in name.split("+"))
    return ", ".join([first, *(label.removeprefix("default, ") for label in rest if label != "default")])


def is_setup(name: str) -> bool:
    """A setup's name: one of :data:`SETUP_LABELS`, or comparison setups joined by ``+``."""
    parts = name.split("+")
    return all(part in SETUP_LABELS for part in parts) and (len(parts) == 1 or
                                                             not any(part in ALGORITHM_PRESETS for part in parts))


def setup_configs(base: RunConfig, names, overrides=()) -> dict[str, RunConfig]:
    """The config of each setup named: :func:`comparison_setups`' changes to ``base`` (the fidelity audit off; a
    composed setup ``a+b`` makes the changes of ``a``, then those of ``b``), or the preset of
    :data:`ALGORITHM_PRESETS` on ``base``'s model; the bench's ``overrides`` (``--set``) go into each, after
    ``base`` or the preset (so a key of one algorithm can be set when only its setup is trained);
    :data:`UNTIMED_CHECKS_OFF` in all."""
    if any(name not in ALGORITHM_PRESETS for name in names):
        base = with_overrides(base, list(overrides))
    changes = comparison_setups(base)
    missing = [part for name in names if name not in ALGORITHM_PRESETS for part in name.split("+")
               if part not in changes]
    if missing:
        raise UserError(f"setup {', '.join(missing)} does not apply to this task (tree: the config has no tree "
                        f"rollouts and grpo.num_generations is a power of {TREE_BRANCH_FACTOR}; flat: the config has "
                        f"tree rollouts); choose from {', '.join([*changes, *ALGORITHM_PRESETS])}")
    configs = {name: load_config(preset=ALGORITHM_PRESETS[name],
                                 overrides=[f"model.name={base.model.name}", *overrides])
               if name in ALGORITHM_PRESETS else
               with_overrides(base, [*(change for part in name.split("+") for change in changes[part]),
                                     "backward.audit_every=0"])
               for name in names}
    return {name: with_overrides(config, UNTIMED_CHECKS_OFF) for name, config in configs.items()}


def backward_label(config: RunConfig) -> str:
    """``exact``, the JAGG variant's mode and window (``cached_shared W=3``), or ``forward process`` (NFT, AWM: no
    trajectory backward)."""
    backward = config.backward
    if config.train.algorithm != "grpo":
        return "forward process"
    if backward.mode == "exact":
        return "exact"
    mode = "forward" if backward.velocities == "forward" else "cached_shared" if backward.shared_knots else "cached"
    return f"{mode} W={backward.window}"


def config_fingerprint(config: RunConfig) -> str:
    """The sha256 of ``config``'s values: two runs with the same fingerprint train the same way."""
    return hashlib.sha256(config.model_dump_json().encode()).hexdigest()


def read_journal(path: Path) -> dict[tuple[str, int, str], dict]:
    """The runs of a ``--journal`` file by (setup, seed, fingerprint); a cut-off last line (a killed bench) is
    skipped."""
    runs = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            entry = json.loads(line)
            runs[(entry["setup"], entry["seed"], entry["config"])] = entry["run"]
        except (ValueError, KeyError, TypeError):
            continue
    return runs


def training_rows(base: RunConfig, seeds=SEEDS, setups=("exact", "default"), journal: Path | None = None,
                  overrides=()) -> list[dict]:
    """One row per setup (of :func:`setup_configs`, ``overrides`` as there): each seed's run, and the mean and
    spread of its figures; the runs already in ``journal`` are reused, and each new one is appended to it."""
    runs: dict[str, dict[int, dict]] = {name: {} for name in setups}
    configs = setup_configs(base, setups, overrides)
    done = read_journal(journal) if journal else {}
    with tempfile.TemporaryDirectory() as root:
        for seed in seeds:
            for name, config in configs.items():
                seeded = with_overrides(config, [f"train.seed={seed}"])
                key = (name, seed, config_fingerprint(seeded))
                if key not in done:
                    done[key] = train_once(seeded, Path(root) / f"{name}-{seed}")
                    if journal:
                        with journal.open("a") as file:
                            file.write(json.dumps({"setup": name, "seed": seed, "config": key[2],
                                                   "run": done[key]}) + "\n")
                runs[name][seed] = done[key]
    rows = []
    for name, by_seed in runs.items():
        config = configs[name]
        row = {"section": "training", "model": base.model.name, "setup": name,
               "backward": backward_label(config), "iterations": config.train.iterations,
               "seeds": list(seeds), "runs": {str(seed): run for seed, run in by_seed.items()},
               "overrides": list(overrides)}
        for key in ("gain", "minutes", "train_minutes", "gain_per_minute"):
            values = [run[key] for run in by_seed.values()]
            row[key] = statistics.mean(values)
            row[f"{key}_std"] = statistics.stdev(values) if len(values) > 1 else None
        for term in next(iter(by_seed.values())).get("term_gains", {}):
            values = [run["term_gains"][term] for run in by_seed.values()]
            row[f"gain/{term}"] = statistics.mean(values)
            row[f"gain/{term}_std"] = statistics.stdev(values) if len(values) > 1 else None
        rows.append(row)
    return rows


def with_earlier(rows: list[dict], earlier: list[dict], source: str) -> list[dict]:
    """``rows`` and, before them, the rows of ``earlier`` (a previous ``--json``) of the setups not in ``rows``, each
    marked with where it was measured."""
    measured = {row["setup"] for row in rows}
    def where(row) -> str:
        return row["measured"] if str(row.get("measured", "")).startswith("earlier") else f"earlier ({source})"
    kept = [{**row, "measured": where(row)} for row in earlier
            if row.get("section") == "training" and row["setup"] not in measured]
    return kept + [{**row, "measured": "this run"} for row in rows]


def minutes_to_reward(curve: list[list[float]], target: float) -> float | None:
    """The wall-clock minutes of the first held-out eval at or above ``target``; None if none is."""
    return next((seconds / 60 for seconds, reward in curve if reward >= target), None)


def mean_curve(runs: dict) -> list[list[float]]:
    """The seeds' curves averaged eval by eval (seconds and reward; the evals of a setup fall at the same
    iterations in every seed), cut at the shortest."""
    return [[statistics.mean(point[0] for point in points), statistics.mean(point[1] for point in points)]
            for points in zip(*(run["curve"] for run in runs.values()))]


def default_final_reward(rows: list[dict]) -> float | None:
    """The default setup's held-out reward at its last iteration, mean over its seeds (None without that row)."""
    default = next((row for row in rows if row["setup"] == "default"), None)
    return statistics.mean(run["curve"][-1][1] for run in default["runs"].values()) if default else None


def format_training(rows: list[dict]) -> str:
    """Markdown: per setup, the mean ± sample standard deviation over the seeds; with Flow-GRPO's default among them,
    each setup's mean gain per minute over its; with the default among them, the minutes each setup's seeds took to
    first reach the default's final held-out reward (mean over the seeds that did, its share of the default's mean
    wall clock, and how many did), and when the seeds' mean curve (:func:`mean_curve`) first reaches it; with several
    rewards, each one's held-out gain."""
    def spread(row, key, spec):
        std = row[f"{key}_std"]
        return format(row[key], spec) + (f" ± {format(std, spec.lstrip('+'))}" if std is not None else "")

    target = default_final_reward(rows)
    default_minutes = next((row["minutes"] for row in rows if row["setup"] == "default"), None)
    flow_grpo = next((row["gain_per_minute"] for row in rows if row["setup"] == "flow_grpo"), None)

    def to_target(row) -> str:
        reached = [m for m in (minutes_to_reward(run["curve"], target) for run in row["runs"].values())
                   if m is not None]
        mean = statistics.mean(reached) if reached else None
        share = f"{mean:.2f} ({mean / default_minutes:.0%} of the default's time), " if reached else ""
        return f"{share}{len(reached)} of {len(row['runs'])} seeds"

    def mean_to_target(row) -> str:
        minutes = minutes_to_reward(mean_curve(row["runs"]), target)
        if minutes is None:
            return "not reached"
        return f"{minutes:.2f} ({minutes / default_minutes:.0%} of the default's time)"

    terms = list(dict.fromkeys(key.removeprefix("gain/") for row in rows for key in row
                               if key.startswith("gain/") and not key.endswith("_std")))
    header = ["model", "setup", "backward", "iterations", "seeds", "held-out gain",
              *(f"held-out gain of {term}" for term in terms), "minutes", "train-phase minutes", "gain per minute"]
    if flow_grpo is not None:
        header.append("gain per minute vs Flow-GRPO's")
    if target is not None:
        header += [f"minutes to the default's final reward ({target:.3f})", "the seeds' mean curve reaches it at"]
    lines = [[r["model"], setup_label(r["setup"]), r["backward"], str(r["iterations"]),
              str(len(r["seeds"])), spread(r, "gain", "+.4f"),
              *(spread(r, f"gain/{term}", "+.4f") if f"gain/{term}" in r else "" for term in terms),
              spread(r, "minutes", ".2f"),
              spread(r, "train_minutes", ".2f"), spread(r, "gain_per_minute", "+.4f"),
              *([f"{r['gain_per_minute'] / flow_grpo:.1f}x"] if flow_grpo is not None else []),
              *([to_target(r), mean_to_target(r)] if target is not None else [])] for r in rows]
    shared = " ".join(f"`--set {override}`" for override in shared_overrides(rows))
    return markdown_table(header, lines) + "\n" + (f"\nEvery run with {shared}.\n" if shared else "")


def shared_overrides(rows: list[dict]) -> list[str]:
    """The bench's ``--set`` overrides (``KEY=VALUE``, in the bench's order) that every row was trained with; a row
    from before they were recorded has none."""
    common = set.intersection(*(set(row.get("overrides", ())) for row in rows)) if rows else set()
    return [override for override in rows[0]["overrides"] if override in common] if common else []


def plot_training(rows: list[dict], path: str | Path) -> None:
    """Held-out reward against wall-clock seconds of every run."""
    series = [(f"{setup_label(r['setup'])} ({r['backward']})",
               {seed: run["curve"] for seed, run in r["runs"].items()}) for r in rows]
    lengths = {r["iterations"] for r in rows}
    length = f"{lengths.pop()} iterations" if len(lengths) == 1 else "each at its full length"
    shared = " ".join(f"--set {override}" for override in shared_overrides(rows))
    plot_curves(series, f"{rows[0]['model']}: held-out reward vs wall-clock ({length})"
                + (f"\n{shared}" if shared else ""),
                "cumulative seconds (rollout + train + eval)", "held-out eval reward", path)
