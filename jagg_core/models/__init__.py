"""Load a base flow model by name: a tiny in-memory one, a real architecture with random weights
(``random:<arch>[@<layers>]``, :mod:`.random_weights`), an embedded one, a local folder or a Hub id.

The family is read from the pipeline's ``model_index.json`` (``_class_name``); each family declares itself in its
own file (:mod:`.family`), the tables here (:mod:`.registry`) are derived from those declarations.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from ..archs import is_random_model
from ..config import ModelConfig
from ..errors import UserError
from ..hubclient import hub_offline
from ..model_index import (absent_components, embedded_models,  # noqa: F401 (embedded_models re-exported)
                           model_source, read_model_index)
from .base import PROMPT_ENCODERS, FlowModel, drop_text_encoders
from ..kernels import apply_kernel_settings, settle_cpu_math
from .quantize import (DENOISER_COMPONENTS, check_quantization, pipeline_quantization, quantize_in_memory,
                       transformer_dtype, transformer_quantization)
from .random_weights import build_random_model_pipeline
from .registry import (FAMILIES, TINY_BUILDERS, build_tiny_pipeline, check_pipeline,  # noqa: F401 (re-exported)
                       family_for)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_flow_model(config: ModelConfig, device: torch.device | str = "cpu", seed: int = 0, *,
                    text_encoders: bool = True, place_transformer: bool = True, num_frames: int = 1) -> FlowModel:
    """Build the :class:`FlowModel` for ``config.name`` on ``device``; without ``text_encoders`` the pipeline has
    none (the prompts' embeddings come from a cache). With ``model.cache_text_embeddings`` and the encoders, the
    transformer (quantized then, if asked) and the VAE come to the device only at
    :meth:`FlowModel.release_text_encoders`, so the encoders and the transformer never share it. Without
    ``place_transformer`` the transformer stays on the host (sharding places each process's part). ``num_frames``:
    ``sampling.num_frames`` (a video family's frames per sample; 1 for an image family). The process's CUDA kernel
    switches are set from ``config`` first, and its CPU math library settled (:mod:`jagg_core.kernels`)."""
    device = torch.device(device)
    dtype = DTYPES[config.dtype]
    settle_cpu_math()
    apply_kernel_settings(config)
    if config.quantize != "none":
        check_quantization(config.quantize, device)  # before any loading, though it may quantize later
    defer = text_encoders and config.cache_text_embeddings
    if config.name in TINY_BUILDERS or is_random_model(config.name):
        if is_random_model(config.name):  # weights made in their dtype: a 20B model never exists in float32
            pipe = build_random_model_pipeline(config.name, seed=seed, dtype=dtype)
        else:
            pipe = build_tiny_pipeline(config.name, seed=seed)
            pipe = pipe.to(dtype=dtype) if dtype != torch.float32 else pipe
        if not text_encoders:
            drop_text_encoders(pipe)
        prepare = partial(quantize_in_memory, pipe, config.quantize, device, dtype)
    else:
        source = model_source(config.name)
        index = read_model_index(source, config.revision)
        later = defer and config.quantize != "none"  # a quantizer places the weights while loading them
        pipe = _load_pipeline(config, source, index, dtype, text_encoders, transformer=not later)
        prepare = partial(_load_quantized_transformers, pipe, config, source, index) if later else None
    family = family_for(type(pipe).__name__, config)
    return family(pipe, config, device, defer_denoiser=defer, prepare_transformer=prepare,
                  place_transformer=place_transformer, num_frames=num_frames)


def _load_pipeline(config: ModelConfig, source: str, index: dict, dtype: torch.dtype, text_encoders: bool,
                   transformer: bool):
    """A pipeline from an embedded folder, a local folder or the Hub (``index``: its model_index.json), with only
    the components asked for."""
    check_pipeline(index.get("_class_name", "unknown"), config.name)
    import diffusers
    pipeline_class = getattr(diffusers, index["_class_name"])
    saved_without = absent_components(index)
    absent = {key: None for key in index if key in saved_without
              or (not text_encoders and key in PROMPT_ENCODERS) or (not transformer and key in DENOISER_COMPONENTS)}
    dtypes = {**dict.fromkeys(DENOISER_COMPONENTS, transformer_dtype(config.quantize, dtype)), "default": dtype}
    quantization = pipeline_quantization(config.quantize) if transformer else None
    with _loading_errors(config.name):
        return pipeline_class.from_pretrained(source, revision=config.revision, torch_dtype=dtypes,
                                              local_files_only=Path(source).is_dir() or hub_offline(),
                                              quantization_config=quantization, **absent)


def _load_quantized_transformers(pipe, config: ModelConfig, source: str, index: dict) -> None:
    """Load the pipeline's transformer (and a two-expert model's ``transformer_2``) quantized, after the text encoders
    are gone; ``index``: the model_index.json, whose ``[library, class]`` entries name their classes."""
    import importlib
    for name in DENOISER_COMPONENTS:
        library, class_name = index.get(name) or (None, None)
        if library is None:
            continue
        cls = getattr(importlib.import_module(library), class_name)
        with _loading_errors(config.name):
            setattr(pipe, name, cls.from_pretrained(
                source, subfolder=name, revision=config.revision,
                torch_dtype=transformer_dtype(config.quantize, DTYPES[config.dtype]),
                local_files_only=Path(source).is_dir() or hub_offline(),
                quantization_config=transformer_quantization(config.quantize)))


@contextmanager
def _loading_errors(name: str):
    try:
        yield
    except (OSError, ValueError) as err:
        raise UserError(f"could not load model '{name}': {str(err).splitlines()[0]}") from None
