"""GRPO: per-prompt group advantages and the per-step PPO-clip loss with an optional KL term.

Samples are ordered prompt-major: samples ``p*G .. p*G + G - 1`` share prompt ``p`` (G = group size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampler import Trajectory
from .sde import STEPS


def group_advantages(rewards: torch.Tensor, group_size: int, clip: float, prompts: list[str] | None = None,
                     global_std: bool = False) -> torch.Tensor:
    """``A = (r - mean_g(r)) / (std + 1e-4)``, clamped to ``[-clip, clip]``, where g is the sample's group: its
    ``group_size`` consecutive samples (one prompt draw), or with ``prompts`` every sample of the batch whose prompt
    has the same text (Flow-GRPO's per-prompt statistics: a prompt drawn twice is one group); and ``std`` is the
    group's (population) standard deviation, or with ``global_std`` the whole batch's (Flow-GRPO's global_std)."""
    r = rewards.float()
    keys = prompts if prompts is not None else [k // group_size for k in range(len(r))]
    members: dict = {}
    for k, key in enumerate(keys):
        members.setdefault(key, []).append(k)
    mean, std = torch.empty_like(r), torch.empty_like(r)
    for index in map(torch.tensor, members.values()):
        mean[index], std[index] = r[index].mean(), r[index].std(unbiased=False)
    if global_std:
        std = r.std(unbiased=False).expand_as(r)
    return ((r - mean) / (std + 1e-4)).clamp(-clip, clip)


@dataclass(frozen=True)
class LossSettings:
    clip_range: float
    kl_beta: float
    scale: float = 1.0   # multiplies every step loss: see loss_scale
    kl_form: str = "step"  # grpo.kl_form: see step_loss


def loss_scale(micro_batch: int, batch: int, trained_steps: int) -> float:
    """The scale of a micro-batch's step losses.

    The loss of a rollout batch of ``B`` samples over ``T`` trained steps is the mean
    ``L = 1/(B T) sum_b sum_j L_bj``. :func:`step_loss` averages over the ``m`` samples of its
    micro-batch, so each micro-batch's step losses are scaled by ``m / (B T)``: summed over the
    micro-batches and steps they give ``L``, and their gradients add up to ``dL/dtheta``.
    """
    return micro_batch / (batch * trained_steps)


def step_loss(v: torch.Tensor, step: int, batch: Trajectory, advantages: torch.Tensor, settings: LossSettings,
              v_ref: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss of step ``i`` as a function of the velocity ``v`` used there, with the base model's velocity ``v_ref``
    there (needed when ``settings.kl_beta > 0``)::

        ratio = exp(log p_theta(z_{i+1} | z_i) - log p_old)
        L_i   = mean_samples max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps)) + beta * KL_i

    multiplied by ``settings.scale``, with the step's mean and log p of the trajectory's ``sde_type``
    (:mod:`jagg_core.sde`) and the KL to the base model's step in one of two forms (``settings.kl_form``),
    ``mean_k`` over the latent's elements::

        step:      KL_i = mean_samples mean_k (mean_theta - mean_ref)^2 / (2 std^2)
                   the Gaussian KL of the step's transition, whose std is std_t sqrt(|dt|) (cps: std_t)
        flow_grpo: KL_i = mean_samples mean_k (mean_theta - mean_ref)^2 / (2 std_t^2)
                   Flow-GRPO's, |dt| times the step form: on a 10-40 step schedule 15-100x smaller (cps: the same)

    Returns the scalar loss and detached statistics.
    """
    s, s_next, sd = float(batch.sigmas[step]), float(batch.sigmas[step + 1]), float(batch.std_t[step])
    z, z_next = batch.latents[step], batch.latents[step + 1]
    sde = STEPS[batch.sde_type]
    mean = sde.mean(z, v, s, s_next, sd)
    std = sde.std(s, s_next, sd)
    log_prob = sde.log_prob(z_next, mean, std)
    ratio = torch.exp(log_prob - batch.log_probs[step].to(log_prob.device))
    adv = advantages.to(ratio.device)
    clipped = torch.clamp(ratio, 1 - settings.clip_range, 1 + settings.clip_range)
    policy_loss = torch.maximum(-adv * ratio, -adv * clipped).mean()
    loss = policy_loss
    kl = torch.zeros((), device=v.device)
    if settings.kl_beta > 0:
        ref_mean = sde.mean(z, v_ref, s, s_next, sd)
        variance = std ** 2 if settings.kl_form == "step" else sd ** 2
        kl = (((mean - ref_mean) ** 2).flatten(1).mean(dim=1) / (2 * variance)).mean()
        loss = loss + settings.kl_beta * kl
    stats = {"kl": kl.detach(), "ratio": ratio.detach().mean(), "ratio_dev": (ratio.detach() - 1).abs().max(),
             "clip_frac": ((ratio - 1).abs() > settings.clip_range).float().mean().detach()}
    return loss * settings.scale, stats
