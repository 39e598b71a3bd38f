"""Load a base flow model by name: a tiny in-memory one, an embedded one, a local folder or a Hub id.

The family is read from the pipeline's ``model_index.json`` (``_class_name``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import UserError
from ..hubclient import download, hub_offline
from .base import FlowModel
from .flux import FluxModel
from .qwen_image import QwenImageModel
from .sd3 import SD3Model
from .tiny import TINY_BUILDERS, build_tiny_pipeline

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
FAMILIES: dict[str, type[FlowModel]] = {"StableDiffusion3Pipeline": SD3Model, "FluxPipeline": FluxModel,
                                         "QwenImagePipeline": QwenImageModel}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def embedded_models() -> list[str]:
    """Names of the pipeline folders shipped in ``jagg_core/assets``."""
    return sorted(p.name for p in ASSETS_DIR.glob("*") if (p / "model_index.json").is_file())


def _family_for(pipeline_class: str, name: str) -> type[FlowModel]:
    if pipeline_class not in FAMILIES:
        supported = ", ".join(sorted(FAMILIES))
        raise UserError(f"model '{name}' is a {pipeline_class}; supported pipelines: {supported}")
    return FAMILIES[pipeline_class]


def _read_model_index(name: str, revision: str | None) -> dict:
    local = Path(name).expanduser()
    if local.is_dir():
        index = local / "model_index.json"
        if not index.is_file():
            raise UserError(f"'{name}' is a folder without model_index.json; point model.name at a diffusers pipeline folder")
        return _parse_model_index(index)
    if local.suffix or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise UserError(f"model '{name}' is neither a local pipeline folder nor a Hub id (owner/name); "
                        f"tiny models: {', '.join(TINY_BUILDERS)}; embedded: {', '.join(embedded_models()) or 'none'}")
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


def _quantization(config: ModelConfig, device: torch.device):
    if not config.quantize_4bit:
        return None
    if device.type != "cuda":
        raise UserError("model.quantize_4bit needs a CUDA GPU (bitsandbytes NF4); set model.quantize_4bit=false on CPU")
    from diffusers import PipelineQuantizationConfig
    return PipelineQuantizationConfig(
        quant_backend="bitsandbytes_4bit", components_to_quantize=["transformer"],
        quant_kwargs={"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": torch.bfloat16})


def load_flow_model(config: ModelConfig, device: torch.device | str = "cpu", seed: int = 0) -> FlowModel:
    """Build the :class:`FlowModel` for ``config.name`` on ``device``."""
    device = torch.device(device)
    dtype = DTYPES[config.dtype]
    if config.name in TINY_BUILDERS:
        pipe = build_tiny_pipeline(config.name, seed=seed)
        if dtype != torch.float32:
            pipe = pipe.to(dtype=dtype)
        return _family_for(type(pipe).__name__, config.name)(pipe, config, device)
    source = str(ASSETS_DIR / config.name) if config.name in embedded_models() else config.name
    index = _read_model_index(source, config.revision)
    family = _family_for(index.get("_class_name", "unknown"), config.name)
    import diffusers
    pipeline_class = getattr(diffusers, index["_class_name"])
    # components saved as [null, null] (e.g. an SD3 without T5) must be passed as None explicitly
    absent = {key: None for key, value in index.items() if value == [None, None]}
    try:
        pipe = pipeline_class.from_pretrained(source, revision=config.revision, torch_dtype=dtype,
                                              local_files_only=Path(source).is_dir() or hub_offline(),
                                              quantization_config=_quantization(config, device), **absent)
    except (OSError, ValueError) as err:
        raise UserError(f"could not load model '{config.name}': {str(err).splitlines()[0]}") from None
    return family(pipe, config, device)
