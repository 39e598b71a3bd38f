"""The frozen base transformer in fewer bits, through diffusers' quantizers; the LoRA on top stays float32.

- ``nf4``: 4-bit NormalFloat with double quantization (bitsandbytes, QLoRA): about 0.53 bytes per weight of
  the linear layers, bf16 compute. diffusers' bitsandbytes quantizer needs a CUDA GPU.
- ``int8``: 8-bit weight-only with per-channel scales (torchao ``Int8WeightOnlyConfig``): about 1 byte per
  weight of the linear layers; the activations stay in the compute dtype, so there is no outlier
  decomposition (bitsandbytes LLM.int8's slow path) and the same code runs on a CPU (tested there) and a
  GPU. peft adds LoRA to both kinds of layers.

Models loaded from a folder or the Hub are quantized while loading (``PipelineQuantizationConfig``);
a pipeline built in memory (tiny and random-weight models) has its transformer saved to a temporary
folder and loaded back the same way, so every model goes through the one diffusers path.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import torch

from ..download import amount
from ..errors import UserError
from ..host import free_disk

QUANTIZATIONS = ("nf4", "int8")


def check_quantization(kind: str, device: torch.device) -> None:
    """One-line errors for a quantization this machine cannot run (``load_flow_model`` asks first, before anything
    is loaded or quantized)."""
    if kind == "nf4" and device.type != "cuda":
        raise UserError("model.quantize=nf4 needs a CUDA GPU (bitsandbytes NF4); on a CPU use model.quantize=int8 "
                        "or none")
    if kind == "nf4" and importlib.util.find_spec("bitsandbytes") is None:
        raise UserError("model.quantize=nf4 needs bitsandbytes: pip install bitsandbytes")
    if kind == "int8" and importlib.util.find_spec("torchao") is None:
        raise UserError("model.quantize=int8 needs torchao: pip install torchao")


def transformer_dtype(kind: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the transformer's unquantized weights and compute: ``model.dtype``, bfloat16 when quantized
    (the dtype both quantizers compute in)."""
    return dtype if kind == "none" else torch.bfloat16


def transformer_quantization(kind: str):
    """The diffusers quantization config of the transformer for ``kind`` (``nf4`` | ``int8``)."""
    if kind == "nf4":
        from diffusers import BitsAndBytesConfig
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.bfloat16)
    from diffusers import TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig
    return TorchAoConfig(Int8WeightOnlyConfig())


#: the pipeline components quantized: the transformer, and a two-expert model's second (Wan 2.2 A14B's)
DENOISER_COMPONENTS = ("transformer", "transformer_2")


def pipeline_quantization(kind: str):
    """``quantization_config`` for ``Pipeline.from_pretrained``: the transformers only, or None for ``none``."""
    if kind == "none":
        return None
    from diffusers import PipelineQuantizationConfig
    return PipelineQuantizationConfig(quant_mapping={name: transformer_quantization(kind)
                                                     for name in DENOISER_COMPONENTS})


def quantize_in_memory(pipe, kind: str, device: torch.device, dtype: torch.dtype) -> None:
    """Replace ``pipe.transformer`` (and a two-expert model's ``transformer_2``), built in memory, by its quantized
    reload, on ``device``; refused in one line, before anything is written, when the temporary folder's disk cannot
    hold a transformer's weights (a random Qwen-Image is 41 GB in bf16)."""
    if kind == "none":
        return
    for name in DENOISER_COMPONENTS:
        if getattr(pipe, name, None) is not None:
            setattr(pipe, name, _quantized_reload(getattr(pipe, name), kind, device, dtype))


def _quantized_reload(transformer: torch.nn.Module, kind: str, device: torch.device, dtype: torch.dtype):
    """``transformer`` saved to a temporary folder and loaded back quantized (see :func:`quantize_in_memory`)."""
    with tempfile.TemporaryDirectory() as folder:
        weights = sum(t.numel() * t.element_size() for t in [*transformer.parameters(), *transformer.buffers()])
        if weights > (free := free_disk(folder)):
            raise UserError(f"model.quantize={kind} on a model built in memory saves its transformer "
                            f"({amount(weights)}) to {Path(folder).parent} first, which has {amount(free)} free: set "
                            "TMPDIR to a folder on a disk with room")
        transformer.save_pretrained(folder)
        kwargs = {"device_map": str(device)} if device.type == "cuda" else {}
        return type(transformer).from_pretrained(
            folder, quantization_config=transformer_quantization(kind), torch_dtype=transformer_dtype(kind, dtype),
            **kwargs)


def is_quantized(module: torch.nn.Module) -> bool:
    """Whether diffusers loaded ``module`` through a quantizer (it can then not change dtype or device)."""
    return getattr(module, "hf_quantizer", None) is not None or bool(getattr(module, "is_quantized", False))
