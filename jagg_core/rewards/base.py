"""The reward registry and what every reward shares.

A reward is a class registered under a name with :func:`register`. It is built with the
``options`` of its :class:`~jagg_core.config.RewardSpec` as keyword arguments and the training
device, and called as ``reward(images, prompts) -> scores``:

* ``images``: float32 ``[N, 3, H, W]`` in ``[0, 1]`` (on the CPU),
* ``prompts``: ``N`` strings,
* ``scores``: float32 ``[N]`` on the CPU, higher is better.

Rewards that need a model load it lazily, on first call, once (``functools.cached_property``).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import numpy as np
import torch
from PIL import Image

from ..errors import UserError

REGISTRY: dict[str, type["Reward"]] = {}


def register(name: str):
    """Class decorator: make a :class:`Reward` subclass available as ``name`` in configs."""

    def decorate(cls):
        if name in REGISTRY:
            raise ValueError(f"reward '{name}' is registered twice")
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return decorate


class Reward:
    """Base class: ``__init__(device, **options)`` and ``__call__(images, prompts) -> [N]``."""

    name = "reward"

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def option_names(cls) -> list[str]:
        """The options this reward accepts (its keyword arguments other than ``device``)."""
        params = inspect.signature(cls.__init__).parameters
        return [p for p in params if p not in ("self", "device")]


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """``[N, 3, H, W]`` floats in ``[0, 1]`` -> ``N`` RGB PIL images (rounded to 8 bits)."""
    array = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return [Image.fromarray(np.ascontiguousarray(a.permute(1, 2, 0).cpu().numpy())) for a in array]


@contextmanager
def hub_model(model_id: str):
    """Turn a failure to fetch ``model_id`` (offline, not cached, gated, missing) into one line."""
    from huggingface_hub.errors import EntryNotFoundError

    try:
        yield
    except (OSError, EntryNotFoundError) as err:  # Hub HTTP errors and missing cache files are OSErrors
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"cannot load '{model_id}' ({reason[:200]}); it must be in the local Hugging Face cache "
            f"or the Hub must be reachable: run `hf download {model_id}` while online"
        ) from None
