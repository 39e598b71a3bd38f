"""The size of a reward's or judge's scoring model, for the memory plan and the judges' host-memory check.

The catalog (:mod:`.catalog`) holds the parameter count of each reward's default model. A spec whose
``options.model_id`` names another model (a larger CLIP for ``clip_score`` or ``pickscore``, Qwen2.5-VL-7B for
``vqa_score``) is counted from that model's own weights: the tensor shapes in its safetensors headers, which
safetensors' ``safe_open`` reads without the tensors, in a local folder or in the local Hub cache (the files
``model.safetensors.index.json`` lists, else ``model.safetensors``), plus the catalog's count of a second model the
reward loads beside it (``companion_params_m``: geneval's colour CLIP). A model not there yet (a Hub id not
downloaded, or saved in another format) is counted as the default model, and the plan says so.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .catalog import CPU_DTYPE, DTYPE_BYTES, reward_entry, reward_options

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class ScoringModelSize:
    """The parameters of the model a reward spec scores with (0: the reward has no model)."""

    params: float
    #: the ``options.model_id`` counted or stood in for; None for the reward's default model
    model_id: str | None = None
    #: False when ``model_id``'s weights were not found and the default model's count stands in
    counted: bool = True

    def bytes_in(self, dtype: str) -> float:
        return self.params * DTYPE_BYTES[dtype]

    @property
    def cpu_bytes(self) -> float:
        """Bytes of the model on the CPU (in :data:`~.catalog.CPU_DTYPE`)."""
        return self.bytes_in(CPU_DTYPE)

    def describe(self) -> str:
        """``986 M``, ``Qwen2.5-VL-7B-Instruct: 8292 M`` or ``3755 M as its default; MODEL not found locally``."""
        count = f"{self.params / 1e6:.0f} M"
        if self.model_id is None:
            return count
        if self.counted:
            return f"{Path(self.model_id).name}: {count}"
        return f"{count} as its default; {self.model_id} not found locally"


def scoring_model_size(name: str, options: dict) -> ScoringModelSize:
    """The size of reward ``name``'s scoring model under ``options`` (see the module docstring)."""
    entry = reward_entry(name)
    default = ScoringModelSize(entry.device_params_m * 1e6)
    model_id = getattr(reward_options(name, options), "model_id", None)
    if not default.params or model_id is None or model_id == entry.options.model_fields["model_id"].default:
        return default
    params = safetensors_params(model_folder(model_id))
    if params is None:
        return ScoringModelSize(default.params, model_id, counted=False)
    return ScoringModelSize(params + entry.companion_params_m * 1e6, model_id)


def model_folder(model_id: str) -> Path | None:
    """``model_id`` as a local folder, or its snapshot in the local Hub cache; None when neither has it."""
    if Path(model_id).is_dir():
        return Path(model_id)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


def safetensors_params(folder: Path | None) -> int | None:
    """Elements of every tensor in the model's safetensors files in ``folder`` (the shards its index lists, else
    ``model.safetensors``); None when they are not all there."""
    if folder is None:
        return None
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [SAFETENSORS_WEIGHTS]
    if not all((folder / name).is_file() for name in files):
        return None
    from safetensors import safe_open
    total = 0
    for name in files:
        with safe_open(folder / name, framework="pt") as weights:
            total += sum(math.prod(weights.get_slice(key).get_shape()) for key in weights.keys())
    return total
