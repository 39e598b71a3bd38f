"""A run's adapter against its base model on many prompts and noises: its rewards and judges (or others) with
standard errors, a benchmark beyond the run's held-out eval (one image of each of a few prompts).

    python -m jagg_core.evaluate RUN [--prompts SOURCE] [--limit N] [--images-per-prompt K] [--checkpoint best|iter_N]
                                 [--against RUN2 [--against-checkpoint best|iter_N]]
                                 [--reward SPEC ...] [--batch B] [--seed S] [--out DIR]

Each prompt (by default the run's held-out eval prompts; ``--prompts``: a built-in set, a file, an image folder or
``hf://DATASET[:COLUMN]``, ``--limit`` of its distinct prompts drawn with ``--seed``) is sampled ``K`` times by the base
model and ``K`` times by the adapter from the same ``K`` noises (each drawn from its own seed, :func:`pair_seed`, on the
CPU, so a batch changes nothing and the device holds one batch's), with the run's fixed-seed ODE sampler, steps and
sizes (as its evals). Every reward scores both: by default the run's rewards (``reward NAME``) and judges (``judge
NAME``), each with its options; ``--reward`` names others instead (``geneval`` or a YAML mapping such as ``"{name:
geneval, options: {strict: true}}"``, repeated). For each, over the ``n = N K`` pairs, the ``N`` prompts as the units
(a prompt's ``K`` pairs share it, so they are not independent draws: each prompt's mean over its ``K`` is one value,
``x_i``; with one prompt its ``K`` pairs are the units)::

    base, adapter      mean(x) +- standard error, s_x / sqrt(N)
    adapter - base     the paired difference's mean +- its standard error (same prompt, same noise): with each
                       prompt's mean difference d_i, mean(d) +- s_d / sqrt(N)
    adapter wins       the share of pairs the adapter scores higher (a tie counts a half)
    p                  two-sided, that the adapter and the base score the same on average over prompts:
                       z = mean(d) / (s_d / sqrt(N)), p = erfc(|z| / sqrt 2) (a normal approximation, close from
                       about 30 prompts; none with one prompt)

``--against RUN2`` compares the adapter with another adapter of the same base model instead of the base model (an A/B
test of two runs, say GRPO's and DiffusionNFT's, or with ``RUN2 = RUN`` of two checkpoints): RUN2's latest adapter, or
its ``--against-checkpoint``, loaded beside the run's with its own rank and targets, samples the other side of each
pair, with the run's sampler and sizes. Of a two-expert model (Wan 2.2 A14B) RUN2 may have trained other experts
(``model.expert``: say both against the low-noise one alone): each side adapts the experts its run trained, the
others sampling with their base weights. ``--against`` may also name a LoRA that is no run's (a
``pytorch_lora_weights.safetensors`` file, its folder or a Hub id, e.g. a published adapter of the same base model).

When every prompt reads as the ``geneval`` reward reads prompts (the ``geneval`` and ``compositional`` sets), each
reward's means are also given by GenEval task (single object, two objects, counting, colours, position, colour
attribution: :attr:`~jagg_core.object_prompts.PromptRequirements.task`), as GenEval reports them.

It writes ``DIR/evaluation.md`` (the tables, printed too), ``DIR/evaluation.json`` (the settings, the adapter file's
SHA-256 among them, and every score) and ``DIR/evaluation.png`` (the first noise's samples of the first 8 prompts, base
beside adapter, with the first reward's scores), ``DIR`` by default ``evaluations/RUN_NAME-ADAPTER``
(``latest-adapter``, ``best-adapter``, ``iter_N``; against another adapter ``-vs-RUN2_NAME-ITS_ADAPTER``); nothing is
written in the run directory.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import UserError, exit_on_user_error, made_folder

if TYPE_CHECKING:
    from PIL import Image

    from .adapters import Adapter

PROG = "jagg_core.evaluate"
TABLE_FILE = "evaluation.md"
SCORES_FILE = "evaluation.json"
GRID_FILE = "evaluation.png"
#: prompts whose first samples the grid shows
GRID_PROMPTS = 8
#: the peft name of the adapter an evaluation compares the run's with (``--against``)
OTHER_ADAPTER = "against"
#: ``model.expert`` in words: which experts of a two-expert model the other adapter adapts, where the run's differ
EXPERT_WORDS = {"high_noise": "the high-noise expert", "low_noise": "the low-noise expert", "both": "both experts"}


@dataclass
class Scored:
    """One reward's scores of the same pairs (prompt, noise): the base model's and the adapter's."""

    label: str
    base: list[float]
    adapter: list[float]

    def row(self, prompts: int) -> dict:
        """Means with standard errors, the paired difference, the adapter's wins and the p-value, the ``prompts`` as
        the units (pair ``k N + i`` is prompt ``i``'s ``k``-th; the module docstring)."""
        difference = [a - b for a, b in zip(self.adapter, self.base)]
        wins = sum(1.0 if d > 0 else 0.5 if d == 0 else 0.0 for d in difference) / len(difference)
        mean_difference = mean_and_error(prompt_means(difference, prompts))
        return {"reward": self.label, "pairs": len(difference), "base": mean_and_error(prompt_means(self.base, prompts)),
                "adapter": mean_and_error(prompt_means(self.adapter, prompts)), "difference": mean_difference,
                "adapter_wins": wins, "p_value": p_value(*mean_difference) if prompts > 1 else None}


def prompt_means(values: list[float], prompts: int) -> list[float]:
    """Each prompt's mean over its pairs (pair ``k N + i`` is prompt ``i``'s), the units of the standard errors;
    one prompt's pairs themselves."""
    if prompts < 2:
        return values
    return [sum(values[i::prompts]) / len(values[i::prompts]) for i in range(prompts)]


def p_value(mean: float, error: float) -> float:
    """Two-sided p of a zero mean difference from its mean and standard error (the module docstring)."""
    if error == 0:
        return 1.0 if mean == 0 else 0.0
    return math.erfc(abs(mean / error) / math.sqrt(2))


def mean_and_error(values: list[float]) -> tuple[float, float]:
    """``(mean, s / sqrt(n))`` with ``s`` the sample standard deviation (0 for one value)."""
    n = len(values)
    mean = sum(values) / n
    spread = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, spread / math.sqrt(n)


def reward_specs(config, given: list[str]):
    """``(label, spec)`` of each reward that scores: the ``--reward`` specs given, else the run's rewards and
    judges."""
    import yaml

    from .config import RewardSpec, term_names
    from .rewards.catalog import reward_options

    if not given:
        rewards = config.rewards
        return ([(f"reward {name}", spec) for name, spec in zip(term_names([s.name for s in rewards]), rewards)]
                + [(f"judge {name}", spec) for name, spec in zip(term_names([s.name for s in config.eval.judges]),
                                                                   config.eval.judges)])
    specs = []
    for text in given:
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            data = None
        data = {"name": data} if isinstance(data, str) else data
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise UserError(f"--reward {text!r}: give a reward's name (geneval) or a mapping such as "
                            "'{name: geneval, options: {strict: true}}'")
        reward_options(data["name"], data.get("options") or {})  # an unknown name or option: one line
        specs.append(RewardSpec(name=data["name"], options=data.get("options") or {}))
    return [(f"reward {name}", spec) for name, spec in zip(term_names([spec.name for spec in specs]), specs)]


def pair_seed(seed: int, k: int, index: int) -> int:
    """The seed of the ``k``-th noise of prompt ``index``: each pair's noise is its own draw, whatever the batch."""
    return (seed * 1_000_003 + k * 65_537 + index) % (2 ** 63)


def evaluation_prompts(config, source: str | None, limit: int | None, seed: int) -> list[str]:
    """The distinct prompts to evaluate on (module docstring)."""
    from .prompts import limit_prompts, load_prompts, run_prompts

    prompts = run_prompts(config.prompts)[1] if source is None else load_prompts(source)
    return limit_prompts(list(dict.fromkeys(prompts)), limit, seed)


#: the label of an ``--against`` adapter that is no run's
LORA_LABEL = "LoRA"


def other_adapter(config, against: str, checkpoint: str | None) -> tuple[Adapter, dict]:
    """What the run's adapter is compared with: the adapter of the run folder ``against`` (its latest, ``best`` or
    ``iter_N``; a one-line :class:`UserError` when that run trained another base model), or the LoRA ``against``
    names (a file, a folder or a Hub id: :func:`~jagg_core.hubclient.resolve_lora`); and how the evaluation records
    it (``source``, ``name``, ``adapter``, ``adapter_sha256``, and ``expert``, that run's ``model.expert``, where it
    differs from this run's)."""
    from .adapters import Adapter, choose_adapter
    from .config import validate_config
    from .hubclient import resolve_lora
    from .rundir import LORA_FILE, RunDirectory, adapter_filenames

    run = RunDirectory(against)
    if run.config_file.is_file():
        other = validate_config(run.read_config()).model
        if (other.name, other.revision) != (config.model.name, config.model.revision):
            raise UserError(f"--against {against}: its adapter is of {other.name}, the run's of "
                            f"{config.model.name}; compare adapters of the same base model")
        expert = other.expert if other.expert != config.model.expert else None  # a two-expert model's other expert(s)
        adapter = choose_adapter(against, checkpoint)
        name, label = run.path.resolve().name, adapter.label
    else:
        if checkpoint:
            raise UserError(f"--against-checkpoint names a checkpoint of a run, but {against} is a LoRA, not a run "
                            "folder")
        adapter = Adapter(resolve_lora(str(against), files=adapter_filenames(config.model.expert)), None, None)
        local = Path(against).expanduser()
        if not local.exists():
            name = str(against)  # a Hub id
        elif local.is_file() and local.name == LORA_FILE:
            name = local.resolve().parent.name  # its folder's
        else:
            name = local.resolve().name
        label, expert = LORA_LABEL, None
    return adapter, {"source": str(against), "name": name, "adapter": label, "adapter_sha256": adapter.digest(),
                     **({"expert": expert} if expert else {})}


def baseline_name(settings: dict) -> str:
    """What the adapter is compared with, in a table's column: ``base``, or the other adapter's name and label."""
    other = settings.get("against")
    return f"{other['name']} {other['adapter']}" if other else "base"


def evaluate(run_dir: Path, *, source: str | None = None, limit: int | None = None, images_per_prompt: int = 4,
             checkpoint: str | None = None, against: str | Path | None = None, against_checkpoint: str | None = None,
             given_rewards: list[str] | None = None, batch: int = 8,
             seed: int = 0) -> tuple[dict, list[Scored], "Image.Image"]:
    """Sample and score (module docstring): the settings, each reward's :class:`Scored` (``base``: the base model's
    scores, or with ``against`` the other adapter's) and the samples' grid."""
    from .adapters import choose_adapter
    from .config import validate_config
    from .rewards.catalog import reward_entry
    from .rundir import RunDirectory

    if images_per_prompt < 1 or batch < 1 or (limit is not None and limit < 1):
        raise UserError("--images-per-prompt, --batch and --limit must be at least 1")
    if against_checkpoint and against is None:
        raise UserError("--against-checkpoint names a checkpoint of the --against run: give that run too")
    config = validate_config(RunDirectory(run_dir).read_config())
    adapter = choose_adapter(run_dir, checkpoint)
    digest = adapter.digest()  # which weights are scored: a file of up to a few hundred MB, read once
    other, against_record = other_adapter(config, against, against_checkpoint) if against is not None else (None, None)
    if against_record is not None and against_record["adapter_sha256"] == digest:
        raise UserError(f"--against: the {against_record['adapter']} of {against} holds the same weights as the "
                        f"{adapter.label} evaluated; name another run, checkpoint (--against-checkpoint) or LoRA")
    prompts = evaluation_prompts(config, source, limit, seed)
    specs = reward_specs(config, given_rewards or [])
    for label, spec in specs:
        reward_entry(spec.name).check_prompts(prompts, f"the {label}")
    from .quiet import quiet_libraries
    quiet_libraries()
    import torch

    from .generate import adapter_model
    from .images import still_frames
    from .config import term_names
    from .rewards import CombinedReward, build_reward
    from .models.base import DEFAULT_ADAPTER
    from .sampler import initial_noise, ode_sample

    model, sigmas = adapter_model(config, prompts, adapter.file, scoring=not given_rewards)  # the run's scorers
    if other is not None:
        model.load_other_lora(other.file, OTHER_ADAPTER, against_record.get("expert"))
    baseline = OTHER_ADAPTER if other is not None else None
    scorer = CombinedReward([build_reward(spec, model.device) for _, spec in specs], [1.0] * len(specs),
                            term_names([spec.name for _, spec in specs]), config.sampling.reward_frames)
    steps, size = len(sigmas) - 1, config.sampling.size
    scored = [Scored(label, [], []) for label, _ in specs]
    shown: list[tuple[torch.Tensor, torch.Tensor]] = []  # the first noise's samples of the first GRID_PROMPTS prompts
    for k in range(images_per_prompt):
        for start in range(0, len(prompts), batch):
            rows = prompts[start:start + batch]
            cond = model.conditioning(rows)
            z0 = torch.cat([initial_noise(model, 1, size, torch.Generator().manual_seed(pair_seed(seed, k, index)))
                            for index in range(start, start + len(rows))])
            with torch.no_grad():
                model.use_adapter(baseline)
                base = model.decode_samples(ode_sample(model, cond, sigmas, z0), cond).float().cpu()
                model.use_adapter(DEFAULT_ADAPTER)
                tuned = model.decode_samples(ode_sample(model, cond, sigmas, z0), cond).float().cpu()
            for result, before, after in zip(scored, scorer(base, rows)[1].values(), scorer(tuned, rows)[1].values()):
                result.base += before.tolist()  # each reward's own scores, unweighted
                result.adapter += after.tolist()
            if k == 0 and start < GRID_PROMPTS:
                shown.append((still_frames(base), still_frames(tuned)))
    settings = {"run": str(run_dir), "adapter": adapter.label, "adapter_sha256": digest,
                "prompts": source or "the run's held-out eval prompts",
                "distinct_prompts": len(prompts), "images_per_prompt": images_per_prompt, "seed": seed,
                "model": config.model.name, "steps": steps, "resolution": size.config_value(),
                "rewards": [{"label": label, "name": spec.name, "options": spec.options} for label, spec in specs],
                "tasks": geneval_tasks(prompts),
                "against": against_record}
    return settings, scored, sample_grid(shown, prompts, scored[0], size.width, against=other is not None)


def sample_grid(shown: list[tuple], prompts: list[str], first: Scored, width: int, against: bool = False):
    """The base model's (``against``: the other adapter's) and the adapter's first samples of the first
    :data:`GRID_PROMPTS` prompts, side by side, each captioned with the first reward's score."""
    import torch

    from .images import captioned_grid, to_pil
    base, tuned = (torch.cat([pair[side] for pair in shown])[:GRID_PROMPTS] for side in (0, 1))
    side, left = ("other", "other adapter") if against else ("base", "base model")  # the table names the other
    pictures, captions = [], []
    for index, (before, after) in enumerate(zip(to_pil(base), to_pil(tuned))):
        pictures += [before, after]
        captions += [f"{side} {first.base[index]:.3f}: {prompts[index]}", f"adapter {first.adapter[index]:.3f}"]
    return captioned_grid(pictures, captions, title=f"first noise: {left} | adapter ({first.label})", columns=4,
                          cell=min(256, max(128, width)))


def geneval_tasks(prompts: list[str]) -> list[str] | None:
    """Each prompt's GenEval task (:attr:`~jagg_core.object_prompts.PromptRequirements.task`) when every prompt reads
    as the geneval reward reads them, else None."""
    from .object_prompts import read_prompt
    read = [read_prompt(prompt) for prompt in prompts]
    return None if None in read else [requirements.task for requirements in read]


def by_task(result: Scored, tasks: list[str]) -> dict[str, dict]:
    """The base's and the adapter's mean of each task's pairs (pair ``k N + i`` is prompt ``i``'s ``k``-th) and its
    number of prompts, the tasks in GenEval's order."""
    order = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
    rows = {}
    for task in sorted(set(tasks), key=order.index):
        pairs = [p for p in range(len(result.base)) if tasks[p % len(tasks)] == task]
        rows[task] = {"prompts": tasks.count(task), "base": sum(result.base[p] for p in pairs) / len(pairs),
                      "adapter": sum(result.adapter[p] for p in pairs) / len(pairs)}
    return rows


def p_words(p: float | None) -> str:
    """A p-value as a table shows it: ``0.032``, ``< 0.001``, or ``-`` for none."""
    return "-" if p is None else "< 0.001" if p < 0.001 else f"{p:.3f}"


def table(settings: dict, scored: list[Scored]) -> str:
    """The markdown table of the evaluation, its settings above it."""
    pairs, prompts = settings["distinct_prompts"] * settings["images_per_prompt"], settings["distinct_prompts"]
    units = f"over the {prompts} prompts' means" if prompts > 1 else f"over the {pairs} pairs"
    other, baseline = settings.get("against"), baseline_name(settings)
    expert = f"of {EXPERT_WORDS[other['expert']]}; " if other and other.get("expert") else ""
    versus = (f"its base model {settings['model']}" if not other else f"the LoRA `{other['source']}`"
              if other["adapter"] == LORA_LABEL else
              f"the {other['adapter']} of `{other['name']}` ({expert}the same base model {settings['model']})")
    lines = [f"**{settings['adapter']}** of `{Path(settings['run']).name}` against {versus}: "
             f"{settings['distinct_prompts']} prompts ({settings['prompts']}) x {settings['images_per_prompt']} "
             f"noises, {settings['steps']} steps at {settings['resolution']} px ({pairs} pairs); mean ± standard "
             f"error {units}; p: that both score the same", "",
             f"| reward | {baseline} | adapter | adapter - {baseline} | adapter wins | p |", "|---|---|---|---|---|---|"]
    for result in scored:
        row = result.row(settings["distinct_prompts"])
        base, tuned, difference = row["base"], row["adapter"], row["difference"]
        lines.append(f"| {result.label} | {base[0]:.4f} ± {base[1]:.4f} | {tuned[0]:.4f} ± {tuned[1]:.4f} | "
                     f"{difference[0]:+.4f} ± {difference[1]:.4f} | {row['adapter_wins']:.0%} | "
                     f"{p_words(row['p_value'])} |")
    if settings.get("tasks"):
        tasks = [by_task(result, settings["tasks"]) for result in scored]
        lines += ["", f"By GenEval task (the prompts' kind), mean of {'the base model' if not other else baseline} "
                  "-> the adapter:", "",
                  "| task | prompts | " + " | ".join(result.label for result in scored) + " |",
                  "|---|---|" + "---|" * len(scored)]
        for task, first in tasks[0].items():
            means = " | ".join(f"{rows[task]['base']:.4f} -> {rows[task]['adapter']:.4f}" for rows in tasks)
            lines.append(f"| {task} | {first['prompts']} | {means} |")
    return "\n".join(lines) + "\n"


def write_evaluation(out: Path, settings: dict, scored: list[Scored], grid: "Image.Image") -> str:
    """Write the evaluation's files into ``out`` (module docstring); its tables' text."""
    text = table(settings, scored)
    (out / TABLE_FILE).write_text(text)
    grid.save(out / GRID_FILE)
    (out / SCORES_FILE).write_text(json.dumps({
        "settings": settings, "results": [result.row(settings["distinct_prompts"]) for result in scored],
        "by_task": {result.label: by_task(result, settings["tasks"]) for result in scored} if settings["tasks"]
        else None,
        "scores": {result.label: {"base": result.base, "adapter": result.adapter} for result in scored}}, indent=1))
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the run directory")
    parser.add_argument("--prompts", metavar="SOURCE", help="a prompt set (default: the run's held-out eval prompts)")
    parser.add_argument("--limit", type=int, metavar="N", help="evaluate on N of its distinct prompts, a seeded draw")
    parser.add_argument("--images-per-prompt", type=int, default=4, metavar="K")
    parser.add_argument("--checkpoint", metavar="best|iter_N", help="the best adapter or a checkpoint's (default: "
                        "the latest)")
    parser.add_argument("--against", metavar="RUN2|LORA", help="compare with another run's adapter of the same base "
                        "model, or a LoRA (a file, a folder, a Hub id), instead of the base model")
    parser.add_argument("--against-checkpoint", metavar="best|iter_N", help="that run's best adapter or a "
                        "checkpoint's (default: its latest)")
    parser.add_argument("--reward", action="append", default=[], metavar="SPEC",
                        help="a reward to score with instead of the run's rewards and judges (repeat)")
    parser.add_argument("--batch", type=int, default=8, help="prompts sampled together")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, metavar="DIR")
    args = parser.parse_args(argv)
    with exit_on_user_error(PROG):
        settings, scored, grid = evaluate(args.run_dir, source=args.prompts, limit=args.limit,
                                    images_per_prompt=args.images_per_prompt, checkpoint=args.checkpoint,
                                    against=args.against, against_checkpoint=args.against_checkpoint,
                                    given_rewards=args.reward, batch=args.batch, seed=args.seed)
        name = f"{args.run_dir.resolve().name}-{settings['adapter'].replace(' ', '-')}"
        if args.against is not None:
            other = settings["against"]
            name += f"-vs-{other['name']}-{other['adapter']}".replace(" ", "-").replace("/", "-")
        out = made_folder(args.out or Path("evaluations") / name)
        print(write_evaluation(out, settings, scored, grid), end="")
        print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
