"""Rewards: ``(images, prompts) -> scores`` functions, combined with weights.

``build_rewards(config.rewards, device)`` gives a :class:`CombinedReward` whose call returns
``(sum_k w_k * r_k, {name_k: r_k})``. The rewards, their options and their modules are listed in
:mod:`.catalog`; a reward's module is imported only when the reward is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import RewardSpec, SamplingConfig, term_names
from ..errors import UserError
from ..image_size import ImageSize
from .catalog import available_rewards, reward_entry, reward_options

if TYPE_CHECKING:
    import torch

    from .base import Reward

__all__ = ["CombinedReward", "available_rewards", "build_reward", "build_rewards"]


def build_reward(spec: RewardSpec, device: str | torch.device = "cpu") -> Reward:
    """One reward from its spec; unknown names and bad options raise :class:`UserError`."""
    options = reward_options(spec.name, spec.options)
    return reward_entry(spec.name).load_class()(device=device, options=options)


class CombinedReward:
    """The weighted sum of several rewards: ``r = sum_k w_k * r_k(images, prompts)``.

    ``names`` labels each term; a reward used twice gets ``name_2``, ``name_3``... . Videos ``[N, F, 3, H, W]`` are
    scored as :mod:`.frames` says: an image reward on ``reward_frames`` of each video's frames, averaged. An editing
    reward (``takes_inputs``) is also given the prompt rows' input images (:meth:`input_images`), each frame of an
    image-to-video run's videos its row's.
    """

    def __init__(self, rewards: list[Reward], weights: list[float], names: list[str],
                 reward_frames: int = SamplingConfig.model_fields["reward_frames"].default):
        if not rewards:
            raise UserError("at least one reward is needed")
        self.rewards = rewards
        self.weights = weights
        self.names = names
        self.reward_frames = reward_frames

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        import torch

        from .frames import score_samples

        if images.ndim not in (4, 5) or images.shape[0] != len(prompts):
            raise ValueError(f"expected images [N,3,H,W] or videos [N,F,3,H,W] and N prompts, got "
                             f"{tuple(images.shape)} and {len(prompts)}")
        images = images.detach().float().cpu()
        inputs = self.input_images(images, prompts)
        total = torch.zeros(len(prompts), dtype=torch.float32)
        parts = {}
        for name, weight, reward in zip(self.names, self.weights, self.rewards):
            scores = score_samples(reward, images, list(prompts), self.reward_frames,
                                   inputs if reward.takes_inputs else None)
            if scores.shape[0] != len(prompts):
                raise ValueError(f"reward '{name}' returned {scores.shape[0]} scores for {len(prompts)} images")
            parts[name] = scores
            total += weight * scores
        return total, parts

    def input_images(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor | None:
        """The editing rows' input images [N, 3, H, W] at the size of ``images`` (or of their frames) when a reward
        takes them (``takes_inputs``); None for text prompts, or when no reward takes them."""
        if not any(reward.takes_inputs for reward in self.rewards):
            return None
        from ..edit_prompts import input_images  # numpy and PIL: loaded on first use
        return input_images(prompts, ImageSize(*images.shape[-2:]))


def build_rewards(specs: list[RewardSpec], device: str | torch.device = "cpu",
                  reward_frames: int = SamplingConfig.model_fields["reward_frames"].default) -> CombinedReward:
    """A :class:`CombinedReward` from the config's ``rewards`` list (``reward_frames``: ``sampling.reward_frames``)."""
    rewards = [build_reward(spec, device) for spec in specs]
    return CombinedReward(rewards, [spec.weight for spec in specs], term_names([spec.name for spec in specs]),
                          reward_frames)
