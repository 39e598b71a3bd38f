"""The real model architectures, as configs only: one diffusers pipeline folder per arch, without weights.

``jagg_core/archs/<arch>/`` holds what the Hub repo of the arch holds besides its weights and tokenizer
files: ``model_index.json``, ``transformer/config.json``, ``vae/config.json``,
``scheduler/scheduler_config.json`` and each text encoder's ``text_encoder*/config.json`` (transformers
configs). They are read by the random-weight models (``model.name = random:<arch>[@<layers>]``, see
:mod:`jagg_core.models.random_weights`) and by anything that needs a model's sizes without its
weights. This module loads no deep-learning library.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import UserError
from ..family_names import DEFAULT_DEPTH_KEY, declared_hub_ids, other_depth_keys

ARCHS_DIR = Path(__file__).resolve().parent
#: arch -> the Hub id whose configs the folder holds (declared by its family, :mod:`jagg_core.family_names`)
HUB_IDS = declared_hub_ids()
#: ``model.name`` of a random-weight model: ``random:<arch>`` (the real depth) or ``random:<arch>@<layers>``
RANDOM_PREFIX = "random:"
_RANDOM_NAME = re.compile(r"random:(?P<arch>[A-Za-z0-9._-]+)(?:@(?P<layers>\d+))?")


def arch_names() -> list[str]:
    """Every shipped arch, e.g. ``sd35-medium``."""
    return list(HUB_IDS)


def _check(arch: str) -> str:
    if arch not in HUB_IDS:
        raise UserError(f"unknown arch '{arch}'; available: {', '.join(arch_names())}")
    return arch


def arch_folder(arch: str) -> Path:
    """The shipped pipeline folder (configs only) of ``arch``."""
    return ARCHS_DIR / _check(arch)


def hub_id(arch: str) -> str:
    """The Hub repo whose configs ``arch`` ships."""
    return HUB_IDS[_check(arch)]


def is_random_model(name: str) -> bool:
    """Whether ``model.name`` asks for a random-weight model (``random:...``)."""
    return name.startswith(RANDOM_PREFIX)


def parse_random_model(name: str) -> tuple[str, int | None]:
    """``random:<arch>[@<layers>]`` -> ``(arch, layers or None)``; a malformed name or an unknown arch is a
    :class:`UserError`."""
    match = _RANDOM_NAME.fullmatch(name)
    if not match:
        raise UserError(f"model '{name}' is not random:<arch> or random:<arch>@<layers>; "
                        f"archs: {', '.join(arch_names())}")
    arch, layers = _check(match["arch"]), match["layers"]
    if layers is None:
        return arch, None
    depth = transformer_depth(transformer_config(arch))
    if not 1 <= int(layers) <= depth:
        raise UserError(f"model '{name}': {arch} has {depth} transformer blocks; give 1 to {depth} layers")
    return arch, int(layers)


def transformer_config(arch: str) -> dict:
    """The arch's ``transformer/config.json``."""
    return json.loads((arch_folder(arch) / "transformer" / "config.json").read_text())


def _depth_key(config: dict) -> str:
    """The key of a transformer config's block count: ``num_layers``, or another a family declares that the config
    has (Z-Image's ``n_layers``: its main blocks; the two noise and two caption refiner blocks stay)."""
    return next((key for key in other_depth_keys() if key in config), DEFAULT_DEPTH_KEY)


def transformer_depth(config: dict) -> int:
    """Transformer blocks of a transformer config (FLUX: double- plus single-stream blocks)."""
    return config[_depth_key(config)] + config.get("num_single_layers", 0)


def with_depth(config: dict, layers: int) -> dict:
    """``config`` with ``layers`` transformer blocks. FLUX splits them between double- and single-stream blocks in
    the real proportion, at least one of each (so fewer than 2 layers give 2); SD3.5 keeps the real share of
    dual-attention blocks, the first ones as in the real model."""
    config = dict(config)
    if "num_single_layers" in config:
        double = max(1, round(config["num_layers"] * layers / transformer_depth(config)))
        config.update(num_layers=double, num_single_layers=max(1, layers - double))
        return config
    dual = sorted(config.get("dual_attention_layers") or ())
    if dual:
        config["dual_attention_layers"] = dual[:round(len(dual) * layers / config["num_layers"])]
    config[_depth_key(config)] = layers
    return config


def arch_for_model(name: str) -> str | None:
    """The arch of ``model.name``: a Hub id of :data:`HUB_IDS` (any case), an arch name, or a
    ``random:<arch>[@<layers>]`` name; None for anything else (tiny, embedded, other models)."""
    if is_random_model(name):
        match = _RANDOM_NAME.fullmatch(name)
        return match["arch"] if match and match["arch"] in HUB_IDS else None
    if name in HUB_IDS:
        return name
    by_hub_id = {repo.lower(): arch for arch, repo in HUB_IDS.items()}
    return by_hub_id.get(name.strip().lower())
