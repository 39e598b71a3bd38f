"""The run configuration: typed schema, presets, ``--set a.b=c`` overrides, one-line errors.

A run is described by one YAML document with the sections below. Presets live in
``presets/NAME.yaml``; ``load_config`` merges a preset or file with overrides and validates the
result. Every unknown key or bad value raises :class:`~jagg_core.errors.UserError` naming the key
and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import UserError

PRESETS_DIR = Path(__file__).resolve().parent.parent / "presets"
DEFAULT_PRESET = "shapes"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """The base flow model and how it is called."""

    name: str = Field("jagg-shapes", description="tiny-sd3 | tiny-flux | tiny-qwen | embedded name | Hub id | local folder")
    revision: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    guidance_scale: float = Field(1.0, ge=0.0, description="classifier-free guidance; 1 disables CFG")
    negative_prompt: str = ""
    flux_guidance: float = Field(3.5, ge=0.0, description="FLUX guidance embedding (dev models)")
    max_sequence_length: int = Field(77, ge=8, le=1024)
    quantize_4bit: bool = Field(False, description="load the transformer in 4-bit NF4 (bitsandbytes, GPU only)")


class LoraConfig(_Section):
    rank: int = Field(8, ge=1, le=512)
    alpha: float = Field(8.0, gt=0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | None = Field(None, description="default: the family's attention projections")
    init_lora: str | None = Field(None, description="start from this diffusers LoRA (Hub repo or local folder)")


class SamplingConfig(_Section):
    resolution: int = Field(64, ge=16, le=2048)
    num_steps: int = Field(10, ge=2, le=200)
    eval_num_steps: int | None = Field(None, ge=2, le=200, description="ODE steps for eval samples; default num_steps")
    noise_level: float = Field(0.7, gt=0.0, le=2.0, description="SDE noise level a")

    @model_validator(mode="after")
    def _resolution_multiple(self):
        if self.resolution % 16:
            raise ValueError(f"resolution must be a multiple of 16, got {self.resolution}")
        return self


class GrpoConfig(_Section):
    num_generations: int = Field(4, ge=2, description="group size: images per prompt")
    prompts_per_iteration: int = Field(2, ge=1)
    clip_range: float = Field(1e-4, gt=0.0)
    adv_clip: float = Field(5.0, gt=0.0)
    kl_beta: float = Field(0.0, ge=0.0)
    timestep_fraction: float = Field(1.0, gt=0.0, le=1.0, description="train the first fraction of the steps")
    ode_after_trained: bool = Field(False, description="rollouts take the ODE step after the trained steps, so "
                                                       "only trained steps inject noise (Flow-GRPO-Fast)")
    inner_epochs: int = Field(1, ge=1, description="optimizer steps on each rollout batch")


class BackwardConfig(_Section):
    mode: Literal["exact", "jagg"] = "jagg"
    window: int = Field(5, ge=1)
    velocities: Literal["cached", "forward"] = "cached"
    frac: float = Field(1.0, ge=0.0, le=1.0, description="fraction of windows (by linearity) that use JAGG")
    joint: bool = Field(True, description="forward/backward both endpoints as one stacked batch")
    shared_knots: bool = False


class RewardSpec(_Section):
    name: str
    weight: float = 1.0
    options: dict[str, Any] = Field(default_factory=dict)


class PromptsConfig(_Section):
    source: str = Field("shapes", description="built-in set name, a .txt/.csv/.jsonl file, or hf://DATASET[:COLUMN]")
    eval_count: int = Field(8, ge=1, description="held-out prompts for fixed-seed eval samples")
    split_seed: int = 0


class TrainConfig(_Section):
    iterations: int = Field(10, ge=1)
    learning_rate: float = Field(1e-4, gt=0)
    weight_decay: float = Field(1e-4, ge=0)
    optimizer: Literal["adamw", "adamw8bit"] = "adamw"
    max_grad_norm: float = Field(1.0, gt=0)
    gradient_accumulation_steps: int = Field(1, ge=1, description="micro-batches the rollout batch is split into")
    mixed_precision: Literal["no", "fp16", "bf16"] = "no"
    gradient_checkpointing: bool = False
    seed: int = 0
    sample_every: int = Field(5, ge=1)
    checkpoint_every: int = Field(5, ge=1)
    keep_checkpoints: int = Field(3, ge=1)
    eval_seed: int = 1234


class HubConfig(_Section):
    push: bool = False
    repo_id: str | None = None
    private: bool = False


class RunConfig(_Section):
    """A whole run."""

    name: str = "run"
    description: str = ""
    output_dir: str | None = None
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    grpo: GrpoConfig = Field(default_factory=GrpoConfig)
    backward: BackwardConfig = Field(default_factory=BackwardConfig)
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="shapes")])
    prompts: PromptsConfig = Field(default_factory=PromptsConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    hub: HubConfig = Field(default_factory=HubConfig)

    @model_validator(mode="after")
    def _consistent(self):
        if not self.rewards:
            raise ValueError("at least one reward is needed")
        if self.hub.push and not self.hub.repo_id:
            raise ValueError("hub.push is true but hub.repo_id is not set")
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def list_presets() -> dict[str, str]:
    """Preset name -> its one-line description."""
    presets = {}
    for path in sorted(PRESETS_DIR.glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        presets[path.stem] = str(data.get("description", "")).strip().splitlines()[0] if data.get("description") else ""
    return presets


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"{path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a mapping of config sections, got {type(data).__name__}")
    return data


def preset_path(name: str) -> Path:
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"unknown preset '{name}'; available: {', '.join(list_presets()) or 'none'}")
    return path


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=c`` -> (["a", "b"], value); the value is parsed as YAML (numbers, booleans, lists)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise UserError(f"override '{text}' must look like section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def _known_keys(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def apply_override(data: dict, keys: list[str], value: Any) -> None:
    """Set ``data[k1][k2]... = value`` after checking every key exists in the schema."""
    schema: type[BaseModel] | None = RunConfig
    node = data
    for depth, key in enumerate(keys):
        path = ".".join(keys[: depth + 1])
        if schema is None or key not in schema.model_fields:
            allowed = ", ".join(_known_keys(schema)) if schema else "none (not a section)"
            raise UserError(f"unknown config key '{path}'; allowed here: {allowed}")
        if depth == len(keys) - 1:
            node[key] = value
            return
        annotation = schema.model_fields[key].annotation
        schema = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise UserError(f"config key '{path}' is not a section")


def _format_validation_error(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "config"
    if first["type"] == "extra_forbidden":
        parent = _schema_at(list(first["loc"])[:-1])
        allowed = ", ".join(_known_keys(parent)) if parent else ""
        return f"unknown config key '{where}'; allowed here: {allowed}"
    message = first["msg"]
    if first["type"] == "literal_error":
        return f"bad value {first.get('input')!r} for '{where}': {message}"
    value = first.get("input")
    shown = f" {value!r}" if value is not None and not isinstance(value, dict) else ""
    return f"bad value{shown} for '{where}': {message}"


def _schema_at(loc: list) -> type[BaseModel] | None:
    schema: Any = RunConfig
    for key in loc:
        if isinstance(key, int):
            continue
        field = schema.model_fields.get(key) if schema else None
        if field is None:
            return None
        annotation = field.annotation
        if getattr(annotation, "__origin__", None) is list:
            annotation = annotation.__args__[0]
        schema = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return schema


def validate_config(data: dict) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise UserError(_format_validation_error(err)) from None


def load_config(preset: str | None = None, config_file: str | Path | None = None,
                overrides: list[str] = ()) -> RunConfig:
    """Resolve a run config: a preset (default ``DEFAULT_PRESET``) or a file, then overrides."""
    if preset and config_file:
        raise UserError("give either --preset or --config, not both")
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            raise UserError(f"config file '{config_file}' does not exist")
        data = _read_yaml(path)
    else:
        data = _read_yaml(preset_path(preset or DEFAULT_PRESET))
    for text in overrides:
        apply_override(data, *parse_override(text))
    return validate_config(data)
