"""What a run publishes: its model card, reward curve, before/after grid and public config.

Everything here is read from the run directory (see DESIGN.md, "The run directory") and nothing is written
to it, so a card can be previewed while a run is still going. :mod:`jagg_core.hub` uploads the result. The adapter
is the latest, the best (``eval.best_by``) or a checkpoint's (:mod:`jagg_core.adapters`); the card says which, and
why for the best, and quotes the newest reward-hacking alarm up to its iteration.

Files in the published repo::

    pytorch_lora_weights.safetensors   the adapter (diffusers format)
    pytorch_lora_weights_transformer_2.safetensors   an adapter of both experts of a two-expert model: the
                                       low-noise expert's (``load_into_transformer_2=True``)
    README.md                          the model card built by build_model_card
    config.yaml                        the resolved config, secrets removed
    images/reward_curve.png            training reward (mean +- std), held-out eval reward and each judge's eval
                                       mean (dashed) per iteration
    images/before_after.png            eval samples of the base model (top) and of the adapter (bottom)
    samples/NNN.png                    the adapter's eval samples (also the card's widget; a video's frame strip)
    samples/NNN.mp4                    a video model's eval videos, embedded in the card
    images/eval_grid_iter_NNNNNN.png   every eval sample of the base model and of the adapter, captioned with its
                                       prompt and reward (the run's ``samples/iter_N/grid.png``)
    images/evaluation.png              with an evaluation of the pushed adapter (``python -m jagg_core.evaluate``):
                                       its first samples, base beside adapter; its tables are the card's Evaluation
"""

from __future__ import annotations

import io
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml
from huggingface_hub import ModelCard, ModelCardData

from . import metrics
from .adapters import BEST, Adapter, choose_adapter
from .config import AwmConfig, ModelConfig, SamplingConfig
from .edit_prompts import instruction_of
from .errors import UserError
from .family_names import EULER_SHIFT_KEY, DeclaredFamily, PromptEmbeddings
from .image_size import ImageSize, parse_resolution
from .model_index import ASSETS_DIR, absent_components, embedded_models, model_source, read_model_index
from .rundir import GRID_FILE as GRID_NAME
from .rundir import LORA_FILE, TRANSFORMER_2_LORA_FILE, ImageSet, RunDirectory, iteration_dirname

CURVE_FILE = "images/reward_curve.png"
EVALUATION_IMAGE = "images/evaluation.png"
GRID_FILE = "images/before_after.png"
SAMPLES_DIR = "samples"
GRID_COLUMNS = 4
WIDGET_SAMPLES = 8
#: the snippet's pipeline class, which loads the one the base model's ``model_index.json`` names
AUTO_PIPELINE = "DiffusionPipeline"
SECRET_KEY = re.compile(r"token|secret|password|api_?key", re.IGNORECASE)
HUB_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass
class RunSnapshot:
    """The parts of a run directory that get published, up to the pushed adapter's iteration."""

    config: dict
    run_info: dict
    metrics: list[dict]
    adapter: Adapter  # which adapter is pushed, and for the best, why
    iteration: int | None
    before: ImageSet | None
    after: ImageSet | None
    evaluation: "Evaluation | None" = None
    doctor: dict = field(default_factory=dict)  # the first iteration's checklist (RUN/doctor.json), if it ran

    @property
    def base_model(self) -> str:
        return self.run_info.get("base_model") or self.config.get("model", {}).get("name", "")


@dataclass(frozen=True)
class Evaluation:
    """An evaluation of the pushed adapter (``python -m jagg_core.evaluate``'s folder): its tables and its grid."""

    tables: str
    grid: Path | None


def read_evaluation(folder: str | Path, run_dir: str | Path, adapter: Adapter) -> Evaluation:
    """The evaluation in ``folder``, once it is of this run's ``adapter`` (the run's folder name, the adapter's label
    and its file's SHA-256, as the evaluation recorded them: a latest adapter trained on since is another); any other
    is a one-line :class:`UserError`."""
    from .evaluate import GRID_FILE as EVALUATION_GRID
    from .evaluate import SCORES_FILE, TABLE_FILE

    folder = Path(folder)
    try:
        settings = json.loads((folder / SCORES_FILE).read_text())["settings"]
        tables = (folder / TABLE_FILE).read_text()
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"{folder} holds no evaluation: make one with python -m jagg_core.evaluate RUN --out "
                        f"{folder}") from None
    if Path(settings.get("run", "")).name != Path(run_dir).resolve().name:
        raise UserError(f"the evaluation in {folder} is of the run '{Path(settings.get('run', '')).name}', not "
                        f"'{Path(run_dir).resolve().name}'")
    if settings.get("adapter") != adapter.label:
        raise UserError(f"the evaluation in {folder} is of the {settings.get('adapter')}, but the {adapter.label} is "
                        "pushed: evaluate that one (--checkpoint), or push the one evaluated")
    if settings.get("adapter_sha256") != adapter.digest():
        raise UserError(f"the evaluation in {folder} is of other weights than the {adapter.label} now (the run "
                        "trained on since): evaluate it again")
    grid = folder / EVALUATION_GRID
    return Evaluation(tables, grid if grid.is_file() else None)


def read_run(run_dir: str | Path, checkpoint: str | None = None, evaluation: str | Path | None = None) -> RunSnapshot:
    """Gather what a push publishes: the latest adapter, the best (``best``) or a checkpoint's (``iter_N``), the
    metrics rows and eval samples up to its iteration, and the ``evaluation`` folder of that adapter if given."""
    run = RunDirectory(run_dir)
    config = run.read_config()
    adapter = choose_adapter(run.path, checkpoint)
    rows = run.read_metrics()
    iteration = adapter.iteration
    if iteration is None:
        iteration = rows[-1][metrics.ITERATION] if rows else None
    else:
        rows = [row for row in rows if row[metrics.ITERATION] <= iteration]
    sampled = run.sample_iterations()
    trained = [i for i in sampled if i > 0 and (iteration is None or i <= iteration)]
    return RunSnapshot(config, run.read_run_info(), rows, adapter, iteration,
                       run.samples(0) if 0 in sampled else None, run.samples(trained[-1]) if trained else None,
                       read_evaluation(evaluation, run.path, adapter) if evaluation is not None else None,
                       run.read_doctor())


def _scrub(node):
    """``node`` with every mapping key that looks like a secret (token, secret, password, api key) removed."""
    if isinstance(node, dict):
        return {k: _scrub(v) for k, v in node.items() if not SECRET_KEY.search(str(k))}
    if isinstance(node, list):
        return [_scrub(v) for v in node]
    return node


def public_config(config: dict) -> str:
    """The config as YAML, without secrets."""
    return yaml.safe_dump(_scrub(config), sort_keys=False)


def reward_curve_figure(rows: list[dict]):
    """Training reward (mean with a +-std band), held-out eval reward and, dashed on a second y-axis (their scales
    differ), each judge's eval mean against iteration: a matplotlib Figure."""
    from matplotlib.figure import Figure  # no pyplot: no global state, safe in the app's worker threads

    train = [row for row in rows if metrics.REWARD_MEAN in row]
    evals = [row for row in rows if row.get(metrics.EVAL_REWARD_MEAN) is not None]
    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.subplots()
    if train:
        x = [row[metrics.ITERATION] for row in train]
        mean = [row[metrics.REWARD_MEAN] for row in train]
        std = [row.get(metrics.REWARD_STD, 0.0) for row in train]
        ax.plot(x, mean, label="train reward (mean)")
        ax.fill_between(x, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    if evals:
        ax.plot([row[metrics.ITERATION] for row in evals], [row[metrics.EVAL_REWARD_MEAN] for row in evals], "o-",
                label="held-out eval reward")
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    axes = [ax]
    judges = metrics.judge_names(rows)
    if judges:
        judge_ax = ax.twinx()
        judge_ax.set_ylabel("judge score (dashed)")
        for i, name in enumerate(judges):
            key = metrics.judge_key(name)
            scored = [row for row in rows if isinstance(row.get(key), (int, float))]
            judge_ax.plot([row[metrics.ITERATION] for row in scored], [row[key] for row in scored], "s--",
                          color=f"C{i + 2}", label=f"judge {name}")  # C0, C1: the rewards
        axes.append(judge_ax)
    handles = [handle for axis in axes for handle in axis.get_legend_handles_labels()[0]]
    axes[-1].legend(handles=handles, loc="best")  # on the top axis, drawn over every line
    fig.tight_layout()
    return fig


def reward_curve_png(rows: list[dict]) -> bytes:
    """:func:`reward_curve_figure` as PNG bytes."""
    buffer = io.BytesIO()
    reward_curve_figure(rows).savefig(buffer, format="png")
    return buffer.getvalue()


def sample_grid_png(before: ImageSet, after: ImageSet, cell: int = 256) -> bytes:
    """Two rows of eval samples, the base model on top and the adapter below (same prompts and seeds), each sample
    ``cell`` pixels wide and as tall as its shape makes it (a landscape image, a video's frame strip)."""
    from PIL import Image, ImageDraw, ImageFont

    count = min(len(before.images), len(after.images), GRID_COLUMNS)
    with Image.open(before.images[0]) as first:
        height = max(1, round(cell * first.height / first.width))
    label_height, gap = 24, 4
    grid = Image.new("RGB", ((cell + gap) * count - gap, 2 * (height + label_height)), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default(size=14)
    for row, (samples, label) in enumerate([(before, "base model"), (after, f"iteration {after.iteration}")]):
        top = row * (height + label_height)
        draw.text((4, top + 4), label, fill="black", font=font)
        for column, path in enumerate(samples.images[:count]):
            with Image.open(path) as image:
                grid.paste(image.convert("RGB").resize((cell, height)), (column * (cell + gap), top + label_height))
    buffer = io.BytesIO()
    grid.save(buffer, format="PNG")
    return buffer.getvalue()


def _eval_reward(rows: list[dict]) -> tuple[dict | None, dict | None]:
    """The first and last metrics rows that carry a held-out eval reward."""
    evals = [row for row in rows if row.get(metrics.EVAL_REWARD_MEAN) is not None]
    return (evals[0], evals[-1]) if len(evals) >= 2 else (None, None)


def _load_lines(repo_id: str, expert: str | None) -> str:
    """The snippet's ``load_lora_weights`` calls: one, into the trained expert; two for an adapter of both experts
    (the low-noise one's file into ``transformer_2``)."""
    if expert == "both":
        return (f'pipe.load_lora_weights("{repo_id}")\n'
                f'pipe.load_lora_weights("{repo_id}", weight_name="{TRANSFORMER_2_LORA_FILE}", '
                "load_into_transformer_2=True)")
    return f'pipe.load_lora_weights("{repo_id}"{", load_into_transformer_2=True" if expert == "low_noise" else ""})'


def _schedule_line(flow_shift: float | None, family: DeclaredFamily | None) -> str:
    """The snippet's scheduler line, so that it steps as the sampler did: the pipeline's flow-matching Euler scheduler
    at the run's ``model.flow_shift`` (nothing when unset); a family of another scheduler (Wan's UniPC) gets the
    Euler one, at the shift its config has (the family's ``scheduler_shift_key``) unless the run set one."""
    key = family.scheduler_shift_key if family is not None else EULER_SHIFT_KEY
    if key != EULER_SHIFT_KEY:
        shift = flow_shift if flow_shift is not None else f"pipe.scheduler.config.{key}"
        return f"pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift={shift})  # the steps it was trained with\n"
    if flow_shift is None:
        return ""
    return f"pipe.scheduler = pipe.scheduler.from_config(pipe.scheduler.config, shift={flow_shift})  # as trained\n"


def _base_line(base: str, pipeline_class: str, model: ModelConfig | None) -> str:
    """The snippet's line loading the base model: its Hub id (at the run's revision) or folder, an embedded model's
    folder in a clone of the JAGG Studio repository (its name alone is no Hub id); a folder's text encoders that its
    ``model_index.json`` lists as ``[null, null]`` (an SD3 saved without T5) passed as None, as diffusers asks."""
    source, note = base, ""
    if base in embedded_models():
        source = (ASSETS_DIR.relative_to(ASSETS_DIR.parents[1]) / base).as_posix()
        note = f"# {base} is JAGG Studio's embedded model: run this in a clone of its repository\n"
    arguments = [f'"{source}"']
    if model is not None and model.revision:
        arguments.append(f'revision="{model.revision}"')
    folder = Path(model_source(base)).expanduser()
    try:  # a folder's only: the Hub's would be a download
        index = read_model_index(str(folder), None) if folder.is_dir() else {}
    except UserError:
        index = {}
    arguments += [f"{name}=None" for name in absent_components(index) if name.startswith(("text_encoder", "tokenizer"))]
    return note + _python_call(f"pipe = {pipeline_class}.from_pretrained",
                               [*arguments, "torch_dtype=torch.bfloat16"], '.to("cuda")')


def _expert_words(expert: str | None) -> str:
    """What a two-expert base model's adapter is for (``model.expert``); nothing for a model of one transformer."""
    if expert is None:
        return ""
    if expert == "both":
        return (f"\nThe base model has two experts; this adapter trains both, together at every step: `{LORA_FILE}` "
                f"is the high-noise expert's (`pipe.transformer`), `{TRANSFORMER_2_LORA_FILE}` the low-noise "
                "expert's (`pipe.transformer_2`, loaded with `load_into_transformer_2=True`).\n")
    component, other = ("transformer_2", "high-noise") if expert == "low_noise" else ("transformer", "low-noise")
    return (f"\nThe base model has two experts; this adapter is its {expert.replace('_', '-')} expert's "
            f"(`pipe.{component}`), trained at that expert's steps while the {other} expert sampled with its base "
            "weights. Load an adapter of the other expert beside it, if you have one, with "
            f"`load_into_transformer_2={expert != 'low_noise'}`.\n")


def _recipe(config: dict, snap: RunSnapshot, editing: bool, family: DeclaredFamily | None) -> str:
    """The training recipe section: rewards, prompts, iterations and the algorithm's settings (``editing``: the
    base model, of ``family``, edits images, and the section says the size of their inputs)."""
    model, lora, sampling, train, prompts = (
        config.get(name) or {} for name in ["model", "lora", "sampling", "train", "prompts"])
    rewards = "\n".join(
        f"| `{r.get('name')}` | {r.get('weight', 1.0)} | {json.dumps(_scrub(r.get('options') or {}))} |"
        for r in config.get("rewards") or [])
    if (config.get("grpo") or {}).get("multi_reward") == "per_reward" and len(config.get("rewards") or []) > 1:
        rewards += "\n\nEach reward's own group advantage, their mean weighted by the weights (`grpo.multi_reward`)."
    done = f"{snap.iteration} of {train.get('iterations')}" if snap.iteration is not None else train.get("iterations")
    init = f", started from `{lora['init_lora']}`" if lora.get("init_lora") else ""
    kind = ", DoRA (`lora.use_dora`)" * bool(lora.get("use_dora")) + \
        ", rsLoRA scale alpha / sqrt(rank) (`lora.use_rslora`)" * bool(lora.get("use_rslora"))
    schedule = f"`{train.get('lr_scheduler', 'constant')}` learning-rate schedule"
    if train.get("lr_warmup_steps"):
        schedule += f" with {train['lr_warmup_steps']} warm-up steps"
    if train.get("ema_decay"):
        schedule += f"; the adapter is the EMA of the weights (decay {train['ema_decay']})"
    seconds = _training_time(snap.metrics)
    spent = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"
    hardware = snap.run_info.get("hardware")
    compute = f"{spent} of rollouts, updates and evals" + (f" on {hardware}" if hardware else "")
    return f"""## Training recipe

| reward | weight | options |
|---|---|---|
{rewards}

- **Prompts:** `{prompts.get('source')}` ({prompts.get('eval_count')} held out for evaluation)
- **Iterations:** {done}, learning rate {train.get('learning_rate')}, {schedule}
- **Compute:** {compute}
{_algorithm_lines(config, snap)}
- **LoRA:** rank {lora.get('rank')}, alpha {lora.get('alpha')}{kind}{init}
- **Sampling:** {sampling.get('resolution')} px, {sampling.get('num_steps')} steps{_sampler_words(config)}\
{_guidance_words(model, sampling)}; model dtype {model.get('dtype')}
{_input_words(config, family) if editing else ""}{_text_words(snap.run_info.get("text_windows") or [])}
The full resolved configuration is in [config.yaml](config.yaml).
"""


def _input_words(config: dict, family: DeclaredFamily | None) -> str:
    """An editing run's line on the size its input images were trained at (``model.condition_resolution``), which
    the pipelines would otherwise choose from each input's shape, or (``family.pipeline_input_area``) which its
    pipeline changes whatever the input's size."""
    size = (config.get("model") or {}).get("condition_resolution", ModelConfig().condition_resolution)
    trained = f"- **Input images:** centre-cropped to {size} px (`model.condition_resolution`); "
    if family is not None and family.pipeline_input_area:
        side = round(math.sqrt(family.pipeline_input_area))
        return (trained + f"the pipeline resizes every input to about {side} x {side} pixels in its own shape, so its "
                f"edits read inputs at another size than training did unless it was {side} px\n")
    return trained + "give the pipeline inputs of that shape\n"


def _text_words(windows: list[dict]) -> str:
    """The recipe's line on what the text encoders read of the prompts (``RUN/run_info.json``'s ``text_windows``), so
    that who samples the adapter gives them as much; empty for a run that did not record it."""
    if not windows:
        return ""
    parts = [f"{window['encoder']} {window['tokens']}" + (f" (`{window['setting']}`)" if window.get("setting") else "")
             + (f", {window['longer']} of {window['prompts']} prompts longer and cut" if window.get("longer") else "")
             for window in windows]
    return f"- **Text:** the encoders read the prompts' first tokens: {'; '.join(parts)}\n"


def run_algorithm(config: dict) -> str:
    """The run's ``train.algorithm`` (configs written before it are GRPO's)."""
    return (config.get("train") or {}).get("algorithm", "grpo")


def algorithm_name(config: dict) -> str:
    """The run's algorithm, in words."""
    return ALGORITHM_NAMES[run_algorithm(config)]


ALGORITHM_NAMES = {"grpo": "GRPO", "nft": "DiffusionNFT", "awm": "Advantage Weighted Matching (AWM)"}


def _algorithm_lines(config: dict, snap: RunSnapshot) -> str:
    """The recipe's lines of the run's algorithm and its settings."""
    grpo, backward = config.get("grpo") or {}, config.get("backward") or {}
    algorithm = run_algorithm(config)
    groups = f"{grpo.get('num_generations')} images per prompt, {grpo.get('prompts_per_iteration')} prompts per " \
             "iteration"
    if algorithm == "nft":
        nft = config.get("nft") or {}
        return (f"- **DiffusionNFT:** {groups}, beta {nft.get('beta')}, KL beta {nft.get('kl_beta')}, trained at "
                f"a {nft.get('timestep_fraction')} fraction of the steps, {nft.get('updates_per_rollout', 1)} "
                f"optimizer step(s) per rollout; the old (sampling) policy trails with decay "
                f"min({nft.get('old_decay_max')}, {nft.get('old_decay_rate')} x optimizer step)")
    if algorithm == "awm":
        awm = AwmConfig.model_validate(config.get("awm") or {})
        steps = awm.steps_per_sample(SamplingConfig.model_validate(config.get("sampling") or {}).num_steps)
        return (f"- **AWM:** {groups}, {steps} trained steps per sample, `{awm.weighting}` weighting (power "
                f"{awm.ghuber_power}), KL beta {awm.kl_beta}, EMA KL beta {awm.ema_kl_beta} (decay up to "
                f"{awm.ema_kl_decay_max})")
    tree = f", tree rollouts splitting {grpo['branch_factor']} ways" if grpo.get("branch_factor") else ""
    if backward.get("mode") == "jagg":
        backward_text = (f"JAGG (window {backward.get('window')}, velocities `{backward.get('velocities')}`, "
                         f"JAGG fraction {backward.get('frac')}){_audit_words(snap.metrics)}")
    else:
        backward_text = "exact per-step backward"
    policy = {"guard": f"GRPO-Guard's normalized ratio, clip range {grpo.get('clip_range')}",
              "dppo": f"DPPO's trust region, KL threshold {grpo.get('kl_mask_threshold')}"}.get(
        grpo.get("policy_loss"), f"clip range {grpo.get('clip_range')}")
    steps = f", {grpo['inner_epochs']} optimizer steps per rollout" if grpo.get("inner_epochs", 1) > 1 else ""
    return (f"- **GRPO:** {groups}, {policy}, KL beta {grpo.get('kl_beta')}{steps}{tree}\n"
            f"- **Backward:** {backward_text}")


def _sampler_words(config: dict) -> str:
    """How rollouts sample: GRPO's SDE (its type when not Flow-GRPO's) with its noise level, or the forward-process
    methods' ODE."""
    if run_algorithm(config) != "grpo":
        return ", ODE rollouts"
    sampling = config.get("sampling") or {}
    sde = {"dance_grpo": "DanceGRPO ", "cps": "CPS "}.get(sampling.get("sde_type"), "")
    return f", {sde}SDE noise level {sampling.get('noise_level')}"


def _guidance_words(model: dict, sampling: dict) -> str:
    """What else the samples were made with, to sample the adapter as it was trained and judged: the evals' steps
    when they differ, the CFG scale (a two-expert model's low-noise one) and negative prompt, the schedule shift."""
    defaults = ModelConfig()
    words = []
    if sampling.get("eval_num_steps"):
        words.append(f"evals {sampling['eval_num_steps']} steps")
    scale = model.get("guidance_scale", defaults.guidance_scale)
    if scale > 1:
        low_noise = f" ({model['guidance_scale_2']} at the low-noise steps)" if model.get("guidance_scale_2") else ""
        negative = f', negative prompt "{model["negative_prompt"]}"' if model.get("negative_prompt") else ""
        words.append(f"CFG {scale}{low_noise}{negative}")
    if model.get("flow_shift") is not None:
        words.append(f"schedule shift {model['flow_shift']}")
    return "".join(f", {word}" for word in words)


def _results_table(first: dict, last: dict) -> str:
    """Held-out reward, each reward term's and each judge's (``eval.judges``), of the base model (first eval) and the
    adapter (last eval)."""
    prefix = metrics.eval_reward_part("")
    terms = [key for key in last if key.startswith(prefix) and key in first]
    judges = [metrics.judge_key(name) for name in metrics.judge_names([last]) if metrics.judge_key(name) in first]
    columns = [key.removeprefix(prefix) for key in terms] + [
        f"judge {key.removeprefix(metrics.JUDGE_PREFIX)}" for key in judges]
    header = "| | iteration | held-out reward |" + "".join(f" {column} |" for column in columns)
    lines = [header, "|---" * (3 + len(columns)) + "|"]
    for label, row in (("before", first), ("after", last)):
        lines.append(f"| {label} | {row[metrics.ITERATION]} | {row[metrics.EVAL_REWARD_MEAN]:.4f} |"
                     + "".join(f" {row[key]:.4f} |" for key in terms + judges))
    judged = " (the judges score the same samples; training never saw their scores)" if judges else ""
    return f"Mean reward of fixed-seed samples of held-out prompts{judged}:\n\n" + "\n".join(lines) + "\n"


def _which_adapter(snap: RunSnapshot) -> str:
    """Which adapter of the run this is, in one sentence (the best: its iteration and why)."""
    adapter = snap.adapter
    if adapter.choice == BEST:
        return f"This is the best adapter of the run: iteration {adapter.iteration}, {adapter.record['reason']}."
    if adapter.choice is None:
        at = f" (iteration {snap.iteration})" if snap.iteration is not None else ""
        return f"This is the latest adapter{at}."
    return f"This is checkpoint {adapter.choice}."


def _hacking_warning(rows: list[dict]) -> str:
    """A warning line quoting the newest reward-hacking alarm of ``rows``; empty when none fired."""
    alarms = [row for row in rows if row.get(metrics.HACKING_ALARM)]
    if not alarms:
        return ""
    newest = alarms[-1]
    return (f"> ⚠️ **Warning, at iteration {newest[metrics.ITERATION]}:** {newest[metrics.HACKING_ALARM]}. Compare "
            "the eval samples before trusting the reward.\n")


def _training_time(rows: list[dict]) -> float:
    """Seconds of rollouts, updates, audits and evals over the run's iterations (loading excluded)."""
    return sum(metrics.seconds(row) for row in rows)


def _audit_words(rows: list[dict]) -> str:
    """The fidelity audits of the run (``backward.audit_every``) in words: how many, and the mean cosine and
    relative error of the JAGG gradient with the exact per-step one; empty when none was made."""
    audits = [(row[metrics.JAGG_GRAD_COSINE], row[metrics.JAGG_GRAD_REL_ERR]) for row in rows
              if isinstance(row.get(metrics.JAGG_GRAD_COSINE), (int, float))
              and math.isfinite(row[metrics.JAGG_GRAD_COSINE])]
    if not audits:
        return ""
    cosine = sum(c for c, _ in audits) / len(audits)
    rel_err = sum(e for _, e in audits) / len(audits)
    times = "once" if len(audits) == 1 else f"at {len(audits)} iterations"
    return (f"; audited {times} against the exact per-step gradient of the same samples: mean cosine "
            f"**{cosine:.3f}**, mean relative error {rel_err:.3f}")


def _run_family(config: dict) -> tuple[ModelConfig | None, DeclaredFamily | None]:
    """The run's model config and its base model's declared family (:func:`~jagg_core.preflight.model_family`);
    None for what cannot be read or looked up."""
    from .preflight import model_family
    try:
        model = ModelConfig.model_validate(config.get("model") or {})
        return model, model_family(model)
    except (ValueError, UserError):
        return None, None


def _input_images(model: ModelConfig | None, family: DeclaredFamily | None) -> tuple[int, str]:
    """The input images of a prompt row of the run's base model (:func:`~jagg_core.preflight.input_images_a_row`):
    ``model.input_images`` when it takes them, 0 when it does not or cannot be looked up; and the diffusers pipeline
    class that runs the adapter: the family's ``edit_pipeline`` for a run with input images (Wan's image-to-video),
    else ``DiffusionPipeline`` (which loads the class the base model names)."""
    try:
        count = family.input_images(model.input_images) if family is not None and model is not None else 0
    except UserError:
        return 0, AUTO_PIPELINE
    return count, (family.edit_pipeline if count and family.edit_pipeline else AUTO_PIPELINE)


#: the width the snippet's pipeline call is wrapped at
SNIPPET_WIDTH = 100


def _python_call(head: str, arguments: list[str], tail: str) -> str:
    """``head(arguments)tail`` as Python lines of about :data:`SNIPPET_WIDTH` characters, whole arguments to a line,
    the lines after the first indented under the parenthesis."""
    lines = [f"{head}("]
    for k, argument in enumerate(arguments):
        piece = argument + ("," if k < len(arguments) - 1 else f"){tail}")
        if k and len(lines[-1]) + 1 + len(piece) > SNIPPET_WIDTH:
            lines.append(" " * (len(head) + 1) + piece)
        else:
            lines[-1] += f" {piece}" if k else piece
    return "\n".join(lines)


def _sample_call(prompt: str, sampling: dict, size: ImageSize, videos: bool, input_images: int,
                 arguments: dict[str, object]) -> tuple[str, str]:
    """The usage snippet's utility imports and sampling lines, at ``size`` (the adapter's trained size), with the
    evals' steps and ``arguments`` (the family's :meth:`~jagg_core.family_names.DeclaredFamily.pipeline_arguments`,
    so that the snippet samples as the evals did): an image (an edit of ``input_images`` input images, 0 for a
    text-to-image model), or a video written as an MP4 at the run's fps (of an input image: image-to-video)."""
    images = 'load_image("input.png")' if input_images == 1 else \
        "[" + ", ".join(f'load_image("picture{k}.png")' for k in range(1, input_images + 1)) + "]"
    text = json.dumps(instruction_of(prompt) if input_images else prompt)
    steps = sampling.get("eval_num_steps") or sampling.get("num_steps", SamplingConfig().num_steps)
    embeddings = "".join(
        f"# the pipeline takes this prompt as its embeddings only\n{name} = pipe.encode_prompt("
        f"{json.dumps(value.text)}, max_sequence_length={arguments['max_sequence_length']})[0]\n"
        for name, value in arguments.items() if isinstance(value, PromptEmbeddings))
    call = [*([f"image={images}"] if input_images else []), f"prompt={text}", f"height={size.height}",
            f"width={size.width}", *([f"num_frames={sampling.get('num_frames')}"] if videos else []),
            f"num_inference_steps={steps}",
            *(f"{name}={name if isinstance(value, PromptEmbeddings) else _python_value(value)}"
              for name, value in arguments.items())]
    if not videos:
        return ("from diffusers.utils import load_image" if input_images else "",
                embeddings + _python_call("image = pipe", call, ".images[0]"))
    utilities = ("export_to_video, load_image  # image-to-video cleans prompts with ftfy: pip install ftfy"
                 if input_images else "export_to_video")
    return (f"from diffusers.utils import {utilities}",
            embeddings + _python_call("frames = pipe", call, ".frames[0]")
            + f"\nexport_to_video(frames, \"sample.mp4\", fps={sampling.get('fps')})")


def _python_value(value: object) -> str:
    """``value`` (a string or a number) as a Python literal."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


#: a check's mark by its status, in the fonts every browser has (emoji may not be)
DOCTOR_MARKS = {"pass": "✓", "fail": "✗", "skip": "–"}


def checklist_markdown(report: dict, fix_words: Callable[[str], str] = str) -> list[str]:
    """The first iteration's checklist (``RUN/doctor.json``) as Markdown lines: its verdict, then a line per check,
    ✓ passed, ✗ failed (with its fix, put in ``fix_words``) or – skipped, with its detail (the page's Watch and the
    model card)."""
    checks = report.get("checks") or []
    failed = sum(check.get("status") == "fail" for check in checks)
    verdict = f"{failed} of {len(checks)} failed" if failed else "passed"
    lines = [f"**First-iteration check** (iteration {report.get('iteration', 1)}): {verdict}", ""]
    for check in checks:
        line = f"- {DOCTOR_MARKS.get(check.get('status'), '–')} {check.get('check')}"
        if check.get("detail"):
            line += f": {check['detail']}"
        if check.get("status") == "fail" and check.get("fix"):
            line += f"  \n  **Fix:** {fix_words(check['fix'])}"
        lines.append(line)
    return lines


def build_model_card(snap: RunSnapshot, repo_id: str) -> ModelCard:
    """The model card: Hub metadata (base model, tags, widget) and a body describing use, recipe and results."""
    base = snap.base_model
    reward_names = [str(r.get("name")) for r in snap.config.get("rewards") or []]
    family = snap.run_info.get("family")
    algorithm = run_algorithm(snap.config)
    tags = ["lora", "diffusers", algorithm, *(["jagg"] if algorithm == "grpo" else []), *([family] if family else []),
            *reward_names]
    model, declared = _run_family(snap.config)
    input_images, pipeline_class = _input_images(model, declared)
    editing = input_images > 0
    widget = [{"text": prompt, "output": {"url": f"{SAMPLES_DIR}/{i:03d}.png"}}  # an edit needs its input: none
              for i, prompt in enumerate(snap.after.prompts[:WIDGET_SAMPLES])] if snap.after and not editing else None
    on_hub = bool(HUB_REPO_ID.match(base)) and not Path(base).exists()
    sampling = snap.config.get("sampling") or {}
    # a video model's samples are videos; before its first eval, its frames say so
    videos = bool(snap.after.videos) if snap.after else sampling.get("num_frames", 1) > 1
    data = ModelCardData(
        base_model=base if on_hub else None,
        library_name="diffusers",
        pipeline_tag=("image-to-video" if editing else "text-to-video") if videos else
        "image-to-image" if editing else "text-to-image",
        tags=list(dict.fromkeys(tags)),
        widget=widget,
    )

    name = repo_id.split("/")[-1]
    prompt = (snap.after or snap.before).prompts[0] if (snap.after or snap.before) else "a photo of a cat"
    base_text = f"[{base}](https://huggingface.co/{base})" if on_hub else f"`{base}`"
    parts = [f"# {name}\n",
             f"A LoRA adapter for {base_text} fine-tuned with {algorithm_name(snap.config)} reinforcement learning in JAGG Studio "
             f"(rewards: {', '.join(f'`{n}`' for n in reward_names)}).\n",
             f"{_which_adapter(snap)}\n"]
    if warning := _hacking_warning(snap.metrics):
        parts.append(warning)
    if snap.config.get("description"):
        parts.append(f"{snap.config['description'].strip()}\n")
    if snap.before and snap.after:
        parts.append(f"![Eval samples before and after training]({GRID_FILE})\n\n"
                     f"*Top: the base model. Bottom: this adapter at iteration {snap.after.iteration}. "
                     f"Same held-out prompts and seeds.*\n")
    grids = eval_grids(snap)
    if grids:
        parts.append("## Eval samples\n\nEvery held-out prompt (fixed seeds) with its reward, the base model first:\n\n"
                     + "\n\n".join(f"![Captioned eval samples]({path})" for path in grids) + "\n")
    if videos and snap.after:
        parts.append("## Eval videos\n\nThe adapter's held-out eval samples (fixed seeds):\n\n" + "\n\n".join(
            f'<video src="{SAMPLES_DIR}/{i:03d}.mp4" controls loop muted></video>\n\n*{text}*'
            for i, text in enumerate(snap.after.prompts[:len(snap.after.videos)])) + "\n")
    expert = snap.run_info.get("expert")
    size = parse_resolution(sampling.get("resolution", SamplingConfig().resolution))
    arguments = declared.pipeline_arguments(model, size) if declared is not None else {}
    utilities, call = _sample_call(prompt, sampling, size, videos, input_images, arguments)
    schedule = _schedule_line(model.flow_shift if model is not None else None, declared)
    euler = ", FlowMatchEulerDiscreteScheduler" if "FlowMatchEulerDiscreteScheduler(" in schedule else ""
    imports = f"from diffusers import {pipeline_class}{euler}" + (f"\n{utilities}" if utilities else "")
    parts.append(f"""## Use it

```python
import torch
{imports}

{_base_line(base, pipeline_class, model)}
{_load_lines(repo_id, expert)}
{schedule}{call}
```
{_expert_words(expert)}""")
    first, last = _eval_reward(snap.metrics)
    results = ["## Results\n"]
    if first and last:
        results.append(_results_table(first, last))
    if snap.metrics:
        results.append(f"![Reward per iteration]({CURVE_FILE})\n")
    if snap.doctor.get("checks"):
        results.append("\n".join(checklist_markdown(snap.doctor)) + "\n")
    if len(results) > 1:
        parts.append("\n".join(results))
    if snap.evaluation is not None:
        image = f"\n![First samples of the evaluation, the adapter's on the right]({EVALUATION_IMAGE})\n" \
            if snap.evaluation.grid else ""
        parts.append(f"## Evaluation\n\n{snap.evaluation.tables}{image}")
    parts.append(_recipe(snap.config, snap, editing, declared))
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(parts))


def eval_grids(snap: RunSnapshot) -> dict[str, Path]:
    """The captioned eval grids of the base model and of the adapter, by their path in the published repo."""
    grids = {}
    for samples in (snap.before, snap.after):
        if samples is not None and (samples.folder / GRID_NAME).is_file():
            grids[f"images/eval_grid_{iteration_dirname(samples.iteration)}.png"] = samples.folder / GRID_NAME
    return grids


def publish_files(snap: RunSnapshot, repo_id: str) -> dict[str, bytes | Path]:
    """Every file of the published repo: path in the repo -> bytes, or a local path for the adapter's files."""
    files: dict[str, bytes | Path] = {
        **{file.name: file for file in snap.adapter.files},
        "README.md": str(build_model_card(snap, repo_id)).encode(),
        "config.yaml": public_config(snap.config).encode(),
    }
    if snap.metrics:
        files[CURVE_FILE] = reward_curve_png(snap.metrics)
    if snap.before and snap.after:
        files[GRID_FILE] = sample_grid_png(snap.before, snap.after)
    files.update(eval_grids(snap))
    if snap.evaluation is not None and snap.evaluation.grid is not None:
        files[EVALUATION_IMAGE] = snap.evaluation.grid
    if snap.after:
        for i, path in enumerate(snap.after.images):
            files[f"{SAMPLES_DIR}/{i:03d}.png"] = path
        for i, path in enumerate(snap.after.videos):
            files[f"{SAMPLES_DIR}/{i:03d}.mp4"] = path
    return files
