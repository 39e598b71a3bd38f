"""Every prompt's text-encoder output in one safetensors file, so a resumed run needs no text encoder.

The file holds, for prompt ``i`` and conditioning key ``k`` (``prompt_embeds``, ``negative/...``), the
tensor ``"{i}/{k}"``; its metadata holds the prompts in order and the fingerprint of the settings that
shape the embeddings (model, revision, dtype, text length, CFG and its negative prompt, the size an editing
row's input image is encoded at). A file whose
fingerprint differs, that lacks a prompt, or that does not read is ignored: the encoders run again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, safe_open, save_file

from ..config import ModelConfig
from .base import Conditioning


def fingerprint(config: ModelConfig) -> str:
    """The settings the embeddings depend on, as a JSON string."""
    cfg = config.guidance_scale > 1.0
    return json.dumps({"name": config.name, "revision": config.revision, "dtype": config.dtype,
                       "max_sequence_length": config.max_sequence_length, "cfg": cfg,
                       "condition_resolution": config.condition_resolution,  # an editing row's image latents
                       "negative_prompt": config.negative_prompt if cfg else None}, sort_keys=True)


def save_embeddings(path: Path, embeddings: dict[str, Conditioning], config: ModelConfig) -> None:
    """Write ``embeddings`` (prompt -> conditioning) atomically."""
    prompts = list(embeddings)
    tensors = {f"{i}/{key}": value.contiguous() for i, prompt in enumerate(prompts)
               for key, value in embeddings[prompt].items()}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"prompts": json.dumps(prompts), "fingerprint": fingerprint(config)})
    os.replace(tmp, path)


def load_embeddings(path: Path, prompts: list[str], config: ModelConfig) -> dict[str, Conditioning] | None:
    """The saved embeddings of ``prompts``, or None when the file is missing, unreadable, made with other
    settings or lacking one of them."""
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        saved = json.loads(metadata.get("prompts", "[]"))
        if metadata.get("fingerprint") != fingerprint(config) or not set(prompts) <= set(saved):
            return None
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError):
        return None
    embeddings: dict[str, Conditioning] = {prompt: {} for prompt in saved}
    for name, value in tensors.items():
        index, key = name.split("/", 1)
        embeddings[saved[int(index)]][key] = value
    return {prompt: embeddings[prompt] for prompt in dict.fromkeys(prompts)}
