"""What every reward shares.

A reward is a :class:`Reward` subclass listed in :mod:`jagg_core.rewards.catalog` with its options
schema. It is built with its validated options and the training device, and called as
``reward(images, prompts) -> scores``:

* ``images``: float32 ``[N, 3, H, W]`` in ``[0, 1]`` (on the CPU),
* ``prompts``: ``N`` strings,
* ``scores``: float32 ``[N]`` on the CPU, higher is better.

Rewards that need a model load it lazily, on first call, once (``functools.cached_property``).
"""

from __future__ import annotations

import torch

from .catalog import RewardOptions, reward_options


class Reward:
    """Base class: ``__init__(device, options)`` and ``__call__(images, prompts) -> [N]``.

    ``name`` is the reward's catalog name; ``options`` default to the catalog schema's defaults.
    """

    name = "reward"

    def __init__(self, device: str | torch.device = "cpu", options: RewardOptions | None = None):
        self.device = torch.device(device)
        self.options = options if options is not None else reward_options(self.name, {})

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        raise NotImplementedError
