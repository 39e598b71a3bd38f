"""A model's pipeline with every weight on the ``meta`` device, from its configs alone (sizes, no weights): what
the memory plan (:mod:`jagg_core.memory_plan`) measures. The model is looked up as the loader does
(:func:`jagg_core.models.load_flow_model`): a tiny or random-weight model is built, anything else is read from its
pipeline folder (embedded, local, a shipped arch's configs, or the Hub's config files) and its family's registry."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..archs import arch_folder, arch_for_model, is_random_model
from ..errors import UserError
from ..model_index import model_source, pipeline_settings
from .random_weights import build_random_model_pipeline
from .registry import TINY_BUILDERS, check_pipeline

META = torch.device("meta")


def _model_folder(name: str, revision: str | None) -> Path:
    """The pipeline folder whose configs describe ``model.name`` (embedded, local, shipped or the Hub's)."""
    source = Path(model_source(name)).expanduser()
    if source.is_dir():
        return source
    arch = arch_for_model(name)
    if arch is not None:
        return arch_folder(arch)
    return _hub_configs(name, revision)


def _hub_configs(name: str, revision: str | None) -> Path:
    """A Hub model's ``model_index.json`` and component ``config.json`` files (no weights); their snapshot folder."""
    from ..hubclient import download, is_repo_id
    if not is_repo_id(name):
        raise UserError(f"model '{name}' is neither a tiny model, a local pipeline folder nor a Hub id (owner/name); "
                        "a memory plan needs its configs")
    purpose = f"plan the memory of '{name}'"
    index_file = download(name, "model_index.json", purpose, revision=revision)
    index = json.loads(index_file.read_text())
    for component, value in index.items():
        if isinstance(value, list) and value[0] in ("diffusers", "transformers") and not component.startswith("sched"):
            if not _is_processor(component):
                download(name, f"{component}/config.json", purpose, revision=revision)
    return index_file.parent


def _is_processor(component: str) -> bool:
    """A component of files that are no model (a tokenizer, Qwen-Image-Edit's ``processor``, Wan 2.1 image-to-video's
    ``image_processor``): it holds no weights, and no ``config.json``."""
    return "tokenizer" in component or component.endswith("processor")


def _meta_component(folder: Path, component: str, library: str, class_name: str):
    """One pipeline component instantiated on the meta device from its config."""
    import importlib
    cls = getattr(importlib.import_module(library), class_name)
    path = folder / component
    with META:
        if library == "diffusers":
            return cls.from_config(cls.load_config(path))
        from transformers import AutoConfig
        return cls._from_config(AutoConfig.from_pretrained(path))


def meta_pipeline(name: str, revision: str | None = None):
    """The pipeline of ``model.name`` with every weight on the meta device (tokenizers where shipped)."""
    import diffusers
    if name in TINY_BUILDERS:
        with META:
            return TINY_BUILDERS[name]()
    if is_random_model(name):
        return build_random_model_pipeline(name, device=META)
    folder = _model_folder(name, revision)
    index = json.loads((folder / "model_index.json").read_text())
    check_pipeline(index["_class_name"], name)
    pipeline_class = getattr(diffusers, index["_class_name"])
    parts = {}
    for component, value in index.items():
        if component.startswith("_") or not isinstance(value, list):
            continue
        library, class_name = value
        if library is None:
            parts[component] = None
        elif component.startswith("scheduler"):
            parts[component] = diffusers.FlowMatchEulerDiscreteScheduler()
        elif _is_processor(component):
            parts[component] = _tokenizer(folder / component, library, class_name)
        else:
            parts[component] = _meta_component(folder, component, library, class_name)
    return pipeline_class(**parts, **pipeline_settings(index))


def _tokenizer(path: Path, library: str, class_name: str):
    """The component's tokenizer (or processor) when its files are in the folder (the embedded model, a shipped arch's
    image processor), else None."""
    if not path.is_dir() or not any(path.iterdir()) or library != "transformers":
        return None
    import transformers
    try:
        return getattr(transformers, class_name).from_pretrained(path)
    except (OSError, ValueError, TypeError):
        return None
