"""Every prompt's text-encoder output in one safetensors file, so a resumed run needs no text encoder.

The file holds, for prompt ``i`` and conditioning key ``k`` (``prompt_embeds``, ``negative/...``), the
tensor ``"{i}/{k}"``; its metadata holds the prompts in order and the fingerprint of the settings that
shape the embeddings (model, revision, dtype, text length, CFG and its negative prompt, the size an editing
row's input image is encoded at). A file whose
fingerprint differs, that lacks a prompt, or that does not read is ignored: the encoders run again.

The cache lives in host memory (each process of a run holds one) and in that file, so a run refuses, in one line,
a cache larger than the memory available or the run folder's free disk (:func:`check_cache_room`): before a Hub
model downloads (sized from its configs, :func:`jagg_core.memory_plan.check_text_cache_before_download`), at set-up
before a prompt is encoded, and on a resume before the file is read back. A FLUX prompt is 4.2 MB at 512 tokens,
and a prompt set of 25,000 would be 105 GB.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from ..config import ModelConfig
from ..download import amount
from ..errors import UserError
from ..host import available_memory, free_disk
from .base import Conditioning


def fingerprint(config: ModelConfig) -> str:
    """The settings the embeddings depend on, as a JSON string."""
    cfg = config.uses_cfg
    return json.dumps({"name": config.name, "revision": config.revision, "dtype": config.dtype,
                       "max_sequence_length": config.max_sequence_length, "cfg": cfg,
                       "condition_resolution": config.condition_resolution,  # an editing row's image latents
                       "negative_prompt": config.negative_prompt if cfg else None}, sort_keys=True)


def bytes_per_prompt(model) -> int:
    """Bytes of one prompt's cached conditioning: ``sum_k prod(shape_k) x bytes per element`` over the family's
    conditioning tensors (:meth:`~jagg_core.models.base.FlowModel.conditioning_shapes`, from the configs alone, so a
    plan's meta model gives the same), in ``model.dtype``, twice with CFG (the negative prompt's, kept per prompt).
    Qwen-Image's and Z-Image's token masks (8 bytes a token, against 5-7 kB of embedding) are left out."""
    shapes = model.conditioning_shapes().values()
    element = getattr(torch, model.config.dtype).itemsize
    return (2 if model.use_cfg else 1) * sum(math.prod(shape) for shape in shapes) * element


def check_cache_room(per_prompt: int, prompts: int, run_dir: Path, processes: int = 1, *,
                     written: bool = False) -> None:
    """Refuse, in one line, a cache of ``prompts`` prompts of ``per_prompt`` bytes that the host memory available
    (each of this machine's ``processes`` holds one) or the free disk of ``run_dir`` (one file, unless ``written``
    already) cannot hold."""
    size = per_prompt * prompts
    memory = available_memory()
    disk = math.inf if written else free_disk(run_dir)
    if size * processes <= memory and size <= disk:
        return
    each = f" in each of the {processes} processes" if processes > 1 else ""
    needs = f"of host memory{each}" + ("" if written else f" and of disk in {run_dir}")
    has = f"{amount(memory)} of memory available" + ("" if written else f" and {amount(disk)} of disk free there")
    raise UserError(f"the text-embedding cache of {prompts} prompts ({per_prompt / 1e6:.3g} MB each) takes "
                    f"{amount(size)} {needs}; this machine has {has}; set "
                    "model.cache_text_embeddings=false (the text encoders then stay on the device and encode each "
                    "batch), lower model.max_sequence_length, or train on fewer prompts (prompts.limit)")


def save_embeddings(path: Path, embeddings: dict[str, Conditioning], config: ModelConfig) -> None:
    """Write ``embeddings`` (prompt -> conditioning) atomically."""
    prompts = list(embeddings)
    tensors = {f"{i}/{key}": value.contiguous() for i, prompt in enumerate(prompts)
               for key, value in embeddings[prompt].items()}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"prompts": json.dumps(prompts), "fingerprint": fingerprint(config)})
    os.replace(tmp, path)


def load_embeddings(path: Path, prompts: list[str], config: ModelConfig,
                    processes: int = 1) -> dict[str, Conditioning] | None:
    """The saved embeddings of ``prompts``, or None when the file is missing, unreadable, made with other
    settings or lacking one of them. The whole file is read into the host memory of each of this machine's
    ``processes``: one that does not fit is refused in one line (:func:`check_cache_room`), as at set-up."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        saved = json.loads(metadata.get("prompts", "[]"))
        if metadata.get("fingerprint") != fingerprint(config) or not set(prompts) <= set(saved):
            return None
        per_prompt = math.ceil(path.stat().st_size / len(saved))
        check_cache_room(per_prompt, len(saved), path.parent, processes, written=True)
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError):
        return None
    embeddings: dict[str, Conditioning] = {prompt: {} for prompt in saved}
    for name, value in tensors.items():
        index, key = name.split("/", 1)
        embeddings[saved[int(index)]][key] = value
    return {prompt: embeddings[prompt] for prompt in dict.fromkeys(prompts)}
