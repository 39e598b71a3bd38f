"""Where a base model's pipeline is and what its ``model_index.json`` says, without loading torch: the embedded
models of ``jagg_core/assets``, a local pipeline folder, or a Hub id (its index fetched alone, no weights).
Used by the loader (:mod:`jagg_core.models`) and, before anything is launched, by :mod:`jagg_core.preflight`."""

from __future__ import annotations

import json
from pathlib import Path

from .archs import RANDOM_PREFIX, arch_names
from .errors import UserError
from .family_names import tiny_model_names
from .hubclient import download, is_repo_id

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
#: a checkpoint in one file (ComfyUI's, A1111's), not a diffusers pipeline
SINGLE_FILE_SUFFIXES = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".bin", ".gguf")


def embedded_models() -> list[str]:
    """Names of the pipeline folders shipped in ``jagg_core/assets``."""
    return sorted(p.name for p in ASSETS_DIR.glob("*") if (p / "model_index.json").is_file())


def absent_components(index: dict) -> list[str]:
    """The components a ``model_index.json`` lists as ``[null, null]`` (an SD3 saved without T5): diffusers'
    ``from_pretrained`` of its folder must be given each as None."""
    return [name for name, value in index.items() if value == [None, None]]


def tiny_models() -> list[str]:
    """The names of the tiny models built in memory (as their families declare them; no torch)."""
    return tiny_model_names()


def model_source(name: str) -> str:
    """The folder of an embedded model, else ``name`` itself (a local folder or a Hub id)."""
    return str(ASSETS_DIR / name) if name in embedded_models() else name


def read_model_index(name: str, revision: str | None) -> dict:
    """The ``model_index.json`` of a pipeline folder or Hub id (from the cache when offline); a one-line
    :class:`UserError` when there is none."""
    local = Path(name).expanduser()
    if local.is_dir():
        index = local / "model_index.json"
        if not index.is_file():
            raise UserError(f"'{name}' is a folder without model_index.json; point model.name at a diffusers pipeline folder")
        return _parse_model_index(index)
    if local.suffix.lower() in SINGLE_FILE_SUFFIXES:
        raise UserError(f"model '{name}' is a single weights file; point model.name at a diffusers pipeline: a folder "
                        "with model_index.json, or a Hub id such as black-forest-labs/FLUX.1-dev")
    if not is_repo_id(name):
        raise UserError(f"model '{name}' is neither a local pipeline folder nor a Hub id (owner/name); "
                        f"tiny models: {', '.join(tiny_models())}; embedded: {', '.join(embedded_models()) or 'none'}"
                        f"; random weights: {RANDOM_PREFIX}<arch>[@<layers>], arch one of {', '.join(arch_names())}")
    return _parse_model_index(download(name, "model_index.json", f"load model '{name}'", revision=revision))


def _parse_model_index(path: Path) -> dict:
    """The pipeline index as a dict; anything else is a one-line error."""
    try:
        index = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError):
        raise UserError(f"{path} is not valid JSON; a diffusers pipeline folder needs its model_index.json") from None
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise UserError(f"{path} is not a diffusers model_index.json (an object with a _class_name)")
    return index


def pipeline_settings(index: dict) -> dict:
    """A ``model_index.json``'s pipeline settings, the entries that name no component (FLUX.2's ``is_distilled``, Wan
    2.2's ``expand_timesteps``), as ``from_pretrained`` passes them to the pipeline."""
    return {key: value for key, value in index.items() if not key.startswith("_") and not isinstance(value, list)}
