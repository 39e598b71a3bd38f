"""Rewards: a registry of ``(images, prompts) -> scores`` functions, combined with weights.

``build_rewards(config.rewards, device)`` gives a :class:`CombinedReward` whose call returns
``(sum_k w_k * r_k, {name_k: r_k})``. To add a reward, write a module in this package that
defines a :class:`~jagg_core.rewards.base.Reward` subclass decorated with
``@register("name")``, and import the module below (one line).
"""

from __future__ import annotations

import torch

from ..config import RewardSpec
from ..errors import UserError
from .base import REGISTRY, Reward, register

# Each import registers that module's rewards (one line per module).
from . import clip  # noqa: E402,F401  isort: skip
from . import jpeg  # noqa: E402,F401  isort: skip
from . import ocr  # noqa: E402,F401  isort: skip
from . import packaged  # noqa: E402,F401  isort: skip
from . import remote  # noqa: E402,F401  isort: skip
from . import shapes  # noqa: E402,F401  isort: skip

__all__ = ["CombinedReward", "Reward", "available_rewards", "build_reward", "build_rewards", "register"]


def available_rewards() -> list[str]:
    """The registered reward names, sorted."""
    return sorted(REGISTRY)


def build_reward(spec: RewardSpec, device: str | torch.device = "cpu") -> Reward:
    """One reward from its spec; unknown names and options raise :class:`UserError`."""
    cls = REGISTRY.get(spec.name)
    if cls is None:
        raise UserError(f"unknown reward '{spec.name}'; available: {', '.join(available_rewards())}")
    allowed = cls.option_names()
    unknown = sorted(set(spec.options) - set(allowed))
    if unknown:
        raise UserError(
            f"unknown option(s) {', '.join(unknown)} for reward '{spec.name}'; "
            f"allowed: {', '.join(allowed) or 'none'}"
        )
    return cls(device=device, **spec.options)


class CombinedReward:
    """The weighted sum of several rewards: ``r = sum_k w_k * r_k(images, prompts)``.

    ``names`` labels each term; a reward used twice gets ``name_2``, ``name_3``... .
    """

    def __init__(self, rewards: list[Reward], weights: list[float], names: list[str]):
        if not rewards:
            raise UserError("at least one reward is needed")
        self.rewards = rewards
        self.weights = weights
        self.names = names

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if images.ndim != 4 or images.shape[0] != len(prompts):
            raise ValueError(f"expected images [N,3,H,W] and N prompts, got {tuple(images.shape)} and {len(prompts)}")
        images = images.detach().float().cpu()
        total = torch.zeros(len(prompts), dtype=torch.float32)
        parts = {}
        for name, weight, reward in zip(self.names, self.weights, self.rewards):
            scores = torch.as_tensor(reward(images, list(prompts))).detach().float().cpu().reshape(-1)
            if scores.shape[0] != len(prompts):
                raise ValueError(f"reward '{name}' returned {scores.shape[0]} scores for {len(prompts)} images")
            parts[name] = scores
            total += weight * scores
        return total, parts


def build_rewards(specs: list[RewardSpec], device: str | torch.device = "cpu") -> CombinedReward:
    """A :class:`CombinedReward` from the config's ``rewards`` list."""
    names, seen = [], {}
    for spec in specs:
        seen[spec.name] = seen.get(spec.name, 0) + 1
        names.append(spec.name if seen[spec.name] == 1 else f"{spec.name}_{seen[spec.name]}")
    rewards = [build_reward(spec, device) for spec in specs]
    return CombinedReward(rewards, [spec.weight for spec in specs], names)
