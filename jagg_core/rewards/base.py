"""What every reward shares.

A reward is a :class:`Reward` subclass listed in :mod:`jagg_core.rewards.catalog` with its options
schema. It is built with its validated options and the training device, and called as
``reward(images, prompts) -> scores``:

* ``images``: float32 ``[N, 3, H, W]`` in ``[0, 1]`` (on the CPU),
* ``prompts``: ``N`` strings,
* ``scores``: float32 ``[N]`` on the CPU, higher is better.

An editing reward (``takes_inputs``) is called as ``reward(images, prompts, inputs)``: ``inputs`` are the prompt
rows' input images, centre-cropped and resized to the output's size, float32 ``[N, 3, H, W]`` in ``[0, 1]`` (see
:func:`jagg_core.edit_prompts.input_images`), or None for text-to-image prompts. Other rewards keep the
two-argument call.

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
    #: a video reward is called with whole videos ``[N, F, 3, H, W]``; any other reward scores a video's frames
    #: (:func:`jagg_core.rewards.frames.score_samples`)
    takes_videos = False
    #: an editing reward is called with the input images too: ``reward(images, prompts, inputs)``
    takes_inputs = False

    def __init__(self, device: str | torch.device = "cpu", options: RewardOptions | None = None):
        self.device = torch.device(device)
        self.options = options if options is not None else reward_options(self.name, {})

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        raise NotImplementedError
