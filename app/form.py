"""The set-up form and the run config: which config key each field edits, a preset's values for the form, and
the validated :class:`~jagg_core.config.RunConfig` a filled-in form means.

A run config is built as the command line builds one: the chosen preset's YAML, the form's values applied as
overrides (:func:`~jagg_core.config.apply_override`), then :func:`~jagg_core.config.validate_config` and the
reward/prompt checks of :func:`jagg_core.preflight.check_references`. Any problem is a one-line
:class:`~jagg_core.errors.UserError` naming the field, raised before anything is launched.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from jagg_core.archs import HUB_IDS
from jagg_core.config import (ALGORITHM_LABELS, DEFAULT_PRESET, RunConfig, apply_override, flat_keys, key_owner,
                              list_presets, preset_path, reset_other_algorithms, validate_config, yaml_value)
from jagg_core.download import DownloadPlan
from jagg_core.errors import UserError
from jagg_core.image_size import COMMON_SIZES
from jagg_core.preflight import check_references
from jagg_core.prompts import ARCHIVE_SUFFIX, FILE_SUFFIXES, builtin_prompt_sets, load_prompts, unpack_image_folder
from jagg_core.rewards.catalog import available_rewards, reward_entry

PROMPTS_BUILTIN, PROMPTS_UPLOAD, PROMPTS_TEXT = "Built-in set", "Upload a file", "Write my own"
#: where a run keeps the image folder uploaded as a .zip (an editing model's prompt set)
UPLOADED_IMAGE_FOLDER = "prompt_images"
#: folders (``os.pathsep``-separated) whose prompt files and image folders the page may name as a prompt set; none by
#: default
PROMPT_DIRS_ENV = "JAGG_PROMPT_DIRS"
PROMPT_MODES = (PROMPTS_BUILTIN, PROMPTS_UPLOAD, PROMPTS_TEXT)


@dataclass(frozen=True)
class Knob:
    """One form field that edits one config key.

    ``kind`` picks the widget: an integer or float box, a checkbox, a choice, or several choices (``multi``; ``specs``:
    rewards' names that the config holds as reward specs, e.g. the judges); ``size``: an image size, one of
    ``choices`` or one's own typed in (``sampling.resolution``'s 512 or 832x480). A checkbox may stand for two
    config values (``on``/``off``), e.g. "8-bit AdamW" is ``train.optimizer`` = ``adamw8bit`` or ``adamw``. The
    help text under the widget (``info``) is the config schema's description of the key, as in the config
    reference (docs/config.md), so the two never say different things.
    """

    key: str
    label: str
    kind: Literal["int", "float", "bool", "choice", "multi", "specs", "size"]
    choices: tuple[tuple[str, str], ...] = ()  # (shown label, config value)
    on: Any = True
    off: Any = False
    optional: bool = False  # an empty field means null (the schema's default); so does 0, which the page's
    # number box sends for an empty field once it has been shown

    @property
    def info(self) -> str:
        """The schema's description of ``key`` (:meth:`RunConfig.describe`)."""
        return RunConfig.describe(self.key)

    @property
    def algorithm(self) -> str | None:
        """The only algorithm (``train.algorithm``) that reads this knob's key; None: every algorithm does."""
        return key_owner(self.key)

    @property
    def elem_id(self) -> str:
        return "knob-" + self.key.replace(".", "-").replace("_", "-")

    def to_config(self, value: Any) -> Any:
        if self.kind == "bool":
            return self.on if value else self.off
        if self.kind == "multi":
            return list(value or [])
        if self.kind == "specs":
            return [{"name": name} for name in value or []]
        if value is None or value == "" or (self.optional and value == 0):
            if self.optional:
                return None
            raise UserError(f"'{self.label}' needs a value")
        if self.kind == "size":  # a square's side as the config writes it; the config reads the rest
            return int(value) if str(value).strip().isdigit() else value
        if self.kind in ("int", "float"):
            try:
                number = float(value)
            except (TypeError, ValueError):
                raise UserError(f"'{self.label}' must be a number, got {str(value)[:40]!r}") from None
            return int(number) if self.kind == "int" and number.is_integer() else value
        return value

    def from_config(self, value: Any) -> Any:
        if self.kind == "specs":
            return [spec["name"] for spec in value]
        if self.kind == "size":
            return str(value)
        return value == self.on if self.kind == "bool" else value


#: the sizes a size knob offers (one's own may be typed in)
SIZE_CHOICES = tuple((size, size) for size in COMMON_SIZES)

MAIN_KNOBS = (
    Knob("train.iterations", "Iterations", "int"),
    Knob("grpo.num_generations", "Group size", "int"),
    Knob("sampling.num_steps", "Sampling steps", "int"),
    Knob("sampling.resolution", "Resolution", "size", choices=SIZE_CHOICES),
    Knob("train.learning_rate", "Learning rate", "float"),
    Knob("lora.rank", "LoRA rank", "int"),
)

ADVANCED_KNOBS = (
    Knob("backward.mode", "Backward", "choice", choices=(("JAGG", "jagg"), ("exact", "exact"))),
    Knob("backward.window", "JAGG window", "int"),
    Knob("backward.velocities", "Velocities", "choice", choices=(("cached", "cached"), ("forward", "forward"))),
    Knob("backward.frac", "JAGG fraction", "float"),
    Knob("backward.joint", "Joint endpoints", "bool"),
    Knob("backward.shared_knots", "Shared knots", "bool"),
    Knob("sampling.noise_level", "Noise level", "float"),
    Knob("sampling.sde_type", "SDE", "choice", choices=(("Flow-GRPO", "flow_grpo"), ("DanceGRPO", "dance_grpo"),
                                                       ("CPS (coefficients-preserving)", "cps"))),
    Knob("grpo.policy_loss", "Policy loss", "choice", choices=(("PPO clip (Flow-GRPO)", "clip"),
                                                                 ("GRPO-Guard", "guard"), ("DPPO trust region", "dppo"))),
    Knob("grpo.clip_range", "Clip range", "float"),
    Knob("grpo.kl_mask_threshold", "DPPO KL threshold", "float"),
    Knob("grpo.inner_epochs", "Optimizer steps per rollout", "int"),
    Knob("grpo.kl_beta", "KL beta", "float"),
    Knob("grpo.timestep_fraction", "Trained steps", "float"),
    Knob("grpo.ode_after_trained", "ODE after trained steps", "bool"),
    Knob("grpo.window_placement", "Trained steps placement", "choice",
         choices=(("a range", "range"), ("random blocks", "random"))),
    Knob("grpo.trained_start", "First trained step", "int"),
    Knob("grpo.slide_every", "Slide the trained steps every", "int"),
    Knob("grpo.shared_prefix", "Shared prefix per prompt", "bool"),
    Knob("grpo.branch_factor", "Tree rollout branch factor", "int"),
    Knob("grpo.kl_reference", "KL reference", "choice", choices=(("training pass", "train"), ("rollout", "rollout"))),
    Knob("grpo.kl_form", "KL form", "choice", choices=(("Gaussian step KL", "step"), ("Flow-GRPO's", "flow_grpo"))),
    Knob("grpo.multi_reward", "Several rewards' advantage", "choice",
         choices=(("of their weighted sum (Flow-GRPO)", "sum"),
                  ("each reward's own, weighted (DanceGRPO)", "per_reward"))),
    Knob("backward.audit_every", "Fidelity audit every", "int"),
    Knob("model.guidance_scale", "CFG scale", "float"),
    Knob("model.flow_shift", "Schedule shift (empty: the model's)", "float", optional=True),
    Knob("model.guidance_scale_2", "CFG scale, low-noise expert (Wan 2.2 A14B)", "float", optional=True),
    Knob("model.max_sequence_length", "Text tokens", "int"),  # what the doctor's prompt-window fix names
    Knob("grpo.prompts_per_iteration", "Prompts per iteration", "int"),
    Knob("lora.alpha", "LoRA alpha", "float"),
    Knob("lora.use_dora", "DoRA", "bool"),
    Knob("lora.use_rslora", "rsLoRA scale", "bool"),
    Knob("train.mixed_precision", "Mixed precision", "choice",
         choices=(("no", "no"), ("fp16", "fp16"), ("bf16", "bf16"))),
    Knob("model.dtype", "Base model dtype", "choice",
         choices=(("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"))),
    Knob("train.optimizer", "8-bit AdamW", "bool", on="adamw8bit", off="adamw"),
    Knob("model.quantize", "Quantize base model", "choice",
         choices=(("no", "none"), ("NF4 (4-bit, GPU)", "nf4"), ("int8", "int8"))),
    Knob("model.expert", "Trained expert (Wan 2.2 A14B)", "choice",
         choices=(("high-noise (transformer)", "high_noise"), ("low-noise (transformer_2)", "low_noise"),
                  ("both (two adapter files)", "both"))),
    Knob("train.gradient_checkpointing", "Gradient checkpointing", "bool"),
    Knob("train.gradient_accumulation_steps", "Micro-batches", "int"),
    Knob("train.lr_scheduler", "LR schedule", "choice",
         choices=tuple((name, name) for name in ("constant", "constant_with_warmup", "linear", "cosine",
                                                  "cosine_with_restarts"))),
    Knob("train.lr_warmup_steps", "Warm-up steps", "int"),
    Knob("train.ema_decay", "EMA decay", "float"),
    Knob("eval.judges", "Judges", "specs", choices=tuple((name, name) for name in available_rewards())),
    Knob("eval.judges_on_cpu", "Judges on the CPU", "bool"),
    Knob("train.report_to", "Trackers", "multi",
         choices=(("TensorBoard", "tensorboard"), ("trackio", "trackio"), ("Weights & Biases", "wandb"))),
    Knob("train.seed", "Seed", "int"),
    Knob("prompts.eval_count", "Eval prompts", "int"),
    Knob("prompts.limit", "Training prompts at most", "int", optional=True),
    Knob("train.sample_every", "Sample every", "int"),
    Knob("train.checkpoint_every", "Checkpoint every", "int"),
    Knob("sampling.num_frames", "Video frames", "int"),
    Knob("sampling.fps", "Video fps", "int"),
    Knob("sampling.reward_frames", "Frames an image reward scores", "int"),
    Knob("model.condition_resolution", "Input image size (editing)", "size", choices=SIZE_CHOICES),
    Knob("model.input_images", "Input images a prompt row (editing; 1: image-to-video)", "int", optional=True),
    Knob("sampling.rollout_chunk", "Rollout chunk", "int", optional=True),
)

#: the algorithm and the knobs of the forward-process algorithms (each shown only when its algorithm is chosen)
ALGORITHM_KNOBS = (
    Knob("train.algorithm", "Algorithm", "choice",
         choices=tuple((label, name) for name, label in ALGORITHM_LABELS.items())),
    Knob("nft.beta", "NFT beta", "float"),
    Knob("nft.kl_beta", "NFT KL beta", "float"),
    Knob("nft.timestep_fraction", "NFT trained steps", "float"),
    Knob("nft.updates_per_rollout", "NFT updates per rollout", "int"),
    Knob("nft.old_decay_max", "NFT old-policy decay (max)", "float"),
    Knob("nft.old_decay_rate", "NFT old-policy decay rate", "float"),
    Knob("awm.train_timesteps", "AWM steps per sample", "int", optional=True),
    Knob("awm.weighting", "AWM weighting", "choice",
         choices=(("generalized Huber", "ghuber"), ("uniform", "uniform"))),
    Knob("awm.kl_beta", "AWM KL beta", "float"),
    Knob("awm.ema_kl_beta", "AWM EMA KL beta", "float"),
    Knob("awm.ema_kl_decay_max", "AWM EMA decay (max)", "float"),
)

#: every knob, the optional ones last (the page's API leaves them out: their default is null)
KNOBS = tuple(sorted(MAIN_KNOBS + ADVANCED_KNOBS + ALGORITHM_KNOBS, key=lambda knob: knob.optional))


@dataclass
class Form:
    """A filled-in set-up form. ``weights`` are table rows ``[reward, weight]``; ``knobs`` maps config keys to
    field values."""

    preset: str = DEFAULT_PRESET
    name: str = ""
    model: str = ""
    rewards: list[str] = field(default_factory=list)
    weights: list[list] = field(default_factory=list)
    prompt_mode: str = PROMPTS_BUILTIN
    prompt_set: str = ""
    prompt_file: str | None = None
    prompt_text: str = ""
    eval_text: str = ""  # the eval prompts, one per line; empty: held out from the prompt set
    knobs: dict[str, Any] = field(default_factory=dict)


def _get(data: dict, key: str) -> Any:
    """The value of the dotted config ``key`` in ``data``; None where a section or the key is missing."""
    for part in key.split("."):
        data = (data or {}).get(part)
    return data


def model_choices() -> list[str]:
    """Base models to offer: the tiny test model, every preset's model, then the Hub model of every shipped arch
    (any Hub id or folder may be typed)."""
    names = ["tiny-sd3"]
    for preset in list_presets():
        name = (yaml.safe_load(preset_path(preset).read_text()).get("model") or {}).get("name")
        if name and name not in names:
            names.append(name)
    return [*names, *(repo for repo in HUB_IDS.values() if repo not in names)]


def preset_config(preset: str) -> RunConfig:
    """A preset's validated config."""
    return validate_config(yaml.safe_load(preset_path(preset).read_text()))


def preset_form(preset: str) -> Form:
    """The form a preset fills in."""
    return config_form(preset_config(preset), preset)


def config_form(config: RunConfig, preset: str, run_dir: Path | None = None) -> Form:
    """The form that means ``config`` (started from ``preset``); prompts written into the run ``run_dir`` come back
    as typed prompts."""
    data = config.model_dump(mode="json")

    def typed(source: str | None) -> str | None:
        """The prompts the user typed, when ``source`` is the file they were saved to in the run."""
        path = Path(source or "")
        written = run_dir is not None and path.suffix == ".txt" and path.is_file() and _inside(path, run_dir)
        return path.read_text() if written else None

    prompt_text = typed(config.prompts.source)
    return Form(preset=preset, name=config.name, model=config.model.name, rewards=[s.name for s in config.rewards],
                weights=[[spec.name, spec.weight] for spec in config.rewards],
                prompt_mode=PROMPTS_BUILTIN if prompt_text is None else PROMPTS_TEXT,
                prompt_set=config.prompts.source if prompt_text is None else "", prompt_text=prompt_text or "",
                eval_text=typed(config.prompts.eval_source) or "",
                knobs={knob.key: knob.from_config(_get(data, knob.key)) for knob in KNOBS})


#: config keys the form shows under another name, beside the knobs' labels
FIELD_LABELS = {"model.name": "Base model", "prompts.source": "Prompt set", "prompts.eval_source": "Eval prompts of my own",
                **{knob.key: knob.label for knob in KNOBS}}


def with_labels(message: str) -> str:
    """``message`` with the config keys it names replaced by the form's field labels."""
    for key in sorted(FIELD_LABELS, key=len, reverse=True):  # train.lr_warmup_steps before a shorter key in it
        message = re.sub(rf"'?(?<![\w.]){re.escape(key)}(?![\w])'?", f"'{FIELD_LABELS[key]}'", message)
    return message


def cli_command(config: RunConfig, preset: str) -> str:
    """The ``python -m jagg_core.run`` command line that resolves to ``config``: ``preset`` and a ``--set`` for each
    value that differs from it."""
    base = flat_keys(preset_config(preset).model_dump(mode="json"))
    wanted = flat_keys(config.model_dump(mode="json"))
    sets = [f"--set {shlex.quote(f'{key}={yaml_value(value)}')}" for key, value in wanted.items()
            if key not in base or base[key] != value]
    return " ".join(["python -m jagg_core.run", f"--preset {shlex.quote(preset)}", *sets])


def reward_words(rewards: list[str] | None) -> str:
    """What each chosen reward scores (the catalog's sentence), a Markdown line each: under the page's Rewards."""
    return "  \n".join(f"**{name}**: {reward_entry(name).about}" for name in rewards or []
                       if name in available_rewards())


def weight_rows(rewards: list[str], rows: list[list] | None) -> list[list]:
    """The weights table for ``rewards``: known weights kept, new rewards at 1.0."""
    known = {str(row[0]): row[1] for row in rows or [] if row and row[0]}
    return [[name, known.get(name, 1.0)] for name in rewards]


def _weight(value: Any, reward: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(f"the weight of reward '{reward}' must be a number, got {value!r}") from None


def _inside(path: Path, folder: Path) -> bool:
    """Whether ``path``, links resolved, lies in ``folder``."""
    return path.resolve().is_relative_to(folder.resolve())


def _in_prompt_dirs(source: str) -> bool:
    """Whether ``source`` is a file, or an image folder (an editing prompt set), in one of the folders of
    ``$JAGG_PROMPT_DIRS``."""
    folders = [Path(f) for f in os.environ.get(PROMPT_DIRS_ENV, "").split(os.pathsep) if f]
    return Path(source).exists() and any(_inside(Path(source), folder) for folder in folders)


def _prompt_source(form: Form, run_dir: Path) -> str:
    """The ``prompts.source`` of the form; an uploaded file or the typed prompts are saved into ``run_dir``."""
    if form.prompt_mode == PROMPTS_BUILTIN:
        source = form.prompt_set.strip()
        if not source:
            raise UserError(f"choose a prompt set: {', '.join(builtin_prompt_sets())}")
        if source not in builtin_prompt_sets() and not source.startswith("hf://") and not _in_prompt_dirs(source):
            raise UserError(f"the prompt set must be one of {', '.join(builtin_prompt_sets())}, an hf://DATASET, or a "
                            f"file or image folder in a folder listed in ${PROMPT_DIRS_ENV}; got '{source[:80]}'")
        return source
    if form.prompt_mode == PROMPTS_UPLOAD:
        if not form.prompt_file:
            raise UserError("upload a prompt file (.txt one per line, .csv or .jsonl with a 'prompt' column; for an "
                            "image-editing model a .zip of images with prompts.csv)")
        from gradio.utils import get_upload_folder
        if not _inside(Path(form.prompt_file), Path(get_upload_folder())):
            raise UserError("the prompt file must be a file uploaded through the page")
        suffix = Path(form.prompt_file).suffix.lower()
        if suffix == ARCHIVE_SUFFIX:  # an image folder: an editing model's prompt set
            return str(unpack_image_folder(Path(form.prompt_file), run_dir / UPLOADED_IMAGE_FOLDER))
        if suffix not in FILE_SUFFIXES:
            raise UserError(f"the prompt file must be {', '.join((*FILE_SUFFIXES, ARCHIVE_SUFFIX))}, got "
                            f"'{Path(form.prompt_file).name}'")
        target = run_dir / f"prompts{suffix}"
        shutil.copyfile(form.prompt_file, target)
        return str(target)
    if form.prompt_mode == PROMPTS_TEXT:
        if not form.prompt_text.strip():
            raise UserError("write some prompts, one per line")
        target = run_dir / "prompts.txt"
        target.write_text(form.prompt_text.strip() + "\n")
        return str(target)
    raise UserError(f"unknown prompt source '{form.prompt_mode}'; choose one of {', '.join(PROMPT_MODES)}")


def build_config(form: Form, run_dir: Path) -> RunConfig:
    """The validated config of ``form`` for a new run in ``run_dir`` (which receives the user's prompt file), for a
    memory plan or an export: the disk's room for the base model's download is checked by a start alone."""
    return checked_config(form, run_dir, disk=False)[0]


def checked_config(form: Form, run_dir: Path, disk: bool = True) -> tuple[RunConfig, DownloadPlan | None]:
    """:func:`build_config` with the disk's room checked (``disk``), and the base model's download plan of the
    pre-flight check (``.left``: bytes still to download; None when it is not a Hub model or the Hub is offline)."""
    if not form.preset:
        raise UserError("choose a preset to start from")
    preset = yaml.safe_load(preset_path(form.preset).read_text())
    data = copy.deepcopy(preset)  # the preset stays as written: its rewards' and judges' options are looked up there
    name = form.name.strip()
    if not name:
        raise UserError("give the run a name")
    model = form.model.strip()
    if not model:
        raise UserError("choose a base model, or type a Hub id (owner/name) or a local folder")
    if model.startswith(("/", ".", "~")) and not Path(model).expanduser().is_dir():
        raise UserError(f"the model folder '{model}' does not exist")
    if not form.rewards:
        raise UserError("choose at least one reward")
    weights = {str(row[0]): row[1] for row in form.weights or [] if row and row[0]}
    options = preset_options(preset, "rewards")
    data["name"] = name
    apply_override(data, ["model", "name"], model)
    data["rewards"] = [{"name": reward, "weight": _weight(weights.get(reward, 1.0), reward),
                        "options": options.get(reward, {})} for reward in form.rewards]
    apply_override(data, ["prompts", "source"], _prompt_source(form, run_dir))
    if form.eval_text.strip():
        eval_file = run_dir / "eval_prompts.txt"
        eval_file.write_text(form.eval_text.strip() + "\n")
        apply_override(data, ["prompts", "eval_source"], str(eval_file))
    for knob in KNOBS:
        if knob.key in form.knobs:
            value = knob.to_config(form.knobs[knob.key])
            if knob.kind == "specs":  # a reward the preset names keeps its options
                kept = preset_options(preset, knob.key)
                value = [{**spec, "options": kept.get(spec["name"], {})} for spec in value]
            apply_override(data, knob.key.split("."), value)
    reset_other_algorithms(data)  # the hidden knobs of the algorithms not chosen keep their defaults
    try:
        config = validate_config(data)
        plan = check_references(config, disk)
    except UserError as err:
        raise UserError(with_labels(str(err))) from None
    return config, plan


def preset_options(data: dict, key: str) -> dict[str, dict]:
    """Reward name -> the options the preset ``data`` gives it in the specs at ``key`` (``rewards``, ``eval.judges``),
    else in the other list (a reward the form makes a judge, or a judge it makes a reward, keeps them)."""
    other = "eval.judges" if key == "rewards" else "rewards"
    specs = [*(_get(data, other) or []), *(_get(data, key) or [])]  # the key's own last: they win
    return {spec.get("name"): spec.get("options", {}) for spec in specs}


def prompt_preview(source: str, limit: int = 200) -> str:
    """The prompts of a built-in set as editable text (to start a set of one's own from)."""
    return "\n".join(load_prompts(source)[:limit])
