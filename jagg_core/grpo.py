"""GRPO: per-prompt group advantages and the per-step policy loss (PPO's clip, GRPO-Guard's or DPPO's) with an
optional KL term.

Samples are ordered prompt-major: samples ``p*G .. p*G + G - 1`` share prompt ``p`` (G = group size).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampler import Trajectory
from .sde import STEPS


def groups(count: int, group_size: int, prompts: list[str] | None = None) -> list[torch.Tensor]:
    """The indices of each group of ``count`` samples: ``group_size`` consecutive samples (one prompt draw), or with
    ``prompts`` every sample whose prompt has the same text."""
    keys = prompts if prompts is not None else [k // group_size for k in range(count)]
    members: dict = {}
    for k, key in enumerate(keys):
        members.setdefault(key, []).append(k)
    return [torch.tensor(index) for index in members.values()]


def group_spread(scores: torch.Tensor, group_size: int, prompts: list[str] | None = None) -> float:
    """``mean_g std_g(scores)``: the scores' (population) standard deviation within each group, averaged over the
    groups: how far a reward tells a group's samples apart, the signal a group advantage is made of."""
    r = scores.float()
    return float(torch.stack([r[index].std(unbiased=False) for index in groups(len(r), group_size, prompts)]).mean())


def group_advantages(rewards: torch.Tensor, group_size: int, clip: float, prompts: list[str] | None = None,
                     global_std: bool = False) -> torch.Tensor:
    """``A = (r - mean_g(r)) / (std + 1e-4)``, clamped to ``[-clip, clip]``, where g is the sample's group: its
    ``group_size`` consecutive samples (one prompt draw), or with ``prompts`` every sample of the batch whose prompt
    has the same text (Flow-GRPO's per-prompt statistics: a prompt drawn twice is one group); and ``std`` is the
    group's (population) standard deviation, or with ``global_std`` the whole batch's (Flow-GRPO's global_std)."""
    r = rewards.float()
    mean, std = torch.empty_like(r), torch.empty_like(r)
    for index in groups(len(r), group_size, prompts):
        mean[index], std[index] = r[index].mean(), r[index].std(unbiased=False)
    if global_std:
        std = r.std(unbiased=False).expand_as(r)
    return ((r - mean) / (std + 1e-4)).clamp(-clip, clip)


def reward_advantages(parts: list[torch.Tensor], weights: list[float], group_size: int, clip: float,
                      prompts: list[str] | None = None, global_std: bool = False) -> torch.Tensor:
    """Several rewards' advantage, each reward's own (``grpo.multi_reward: per_reward``, DanceGRPO's)::

        A = clamp(sum_k w_k A_k / sum_k |w_k|, -clip, clip)

    with ``A_k`` the :func:`group_advantages` of reward ``k``'s scores alone (unclamped): the rewards' weights say
    what share of the advantage each moves, whatever the spread of its scores. One reward: its group advantage."""
    share = sum(abs(w) for w in weights)
    advantages = [w / share * group_advantages(r, group_size, float("inf"), prompts, global_std)
                  for r, w in zip(parts, weights)]
    return torch.stack(advantages).sum(0).clamp(-clip, clip)


@dataclass(frozen=True)
class LossSettings:
    clip_range: float
    kl_beta: float
    scale: float = 1.0   # multiplies every step loss: see loss_scale
    kl_form: str = "step"  # grpo.kl_form: see step_loss
    policy_loss: str = "clip"  # grpo.policy_loss: see step_loss
    kl_mask_threshold: float = 0.0  # grpo.kl_mask_threshold (policy_loss dppo): see step_loss


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
    there (needed when ``settings.kl_beta > 0``): the policy loss of ``settings.policy_loss`` plus ``beta * KL_i``,
    multiplied by ``settings.scale``. The step's mean and log p are those of the trajectory's ``sde_type``
    (:mod:`jagg_core.sde`); ``mean_old`` is the mean under the rollout's velocity (``batch.velocities``), ``std`` the
    step's transition std and ``mean_k`` a mean over the latent's elements::

        ratio = exp(log p_theta(z_{i+1} | z_i) - log p_old)

        clip   (PPO, Flow-GRPO)  L_i = mean_samples max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps))
        guard  (GRPO-Guard, arXiv 2510.22319)  the same with the normalized ratio (RatioNorm)
                   ratio~ = exp(mean_k (mean_theta - mean_old)_k (z_{i+1} - mean_old)_k / std),
               which is std log ratio + mean_k (mean_theta - mean_old)^2 / (2 std) for a Gaussian step: centred on
               1 at every step (the plain ratio's log has the negative mean -mean_k (mean_theta - mean_old)^2 /
               (2 std^2), so a positive-advantage sample seldom reaches 1 + eps) and of a spread that does not grow
               as std shrinks; and the step's loss weighted 1 / (N |dt|) (N = the schedule's steps, so 1 on a
               uniform schedule): the gradient reweighting that gives every noise level an equal share
        dppo   (DPPO's divergence trust region)  no clip; a sample's step whose
                   KL_old = mean_k (mean_theta - mean_old)^2 / (2 std^2)      (the exact Gaussian KL to the rollout's)
               is at least eps_KL = ``settings.kl_mask_threshold`` and whose update widens the gap (ratio > 1 with
               A > 0, ratio < 1 with A < 0) is dropped:
                   L_i = mean_samples -A ratio [not (KL_old >= eps_KL and widening)]
               (a mean over all samples, as PPO's clip zeroes a clipped sample's gradient without a new mean)

    On-policy (the first optimizer step on a rollout batch) ``mean_theta = mean_old``: both ratios are 1, nothing is
    clipped or dropped, and guard differs from clip only in each step's weight (std / (N |dt|) times clip's
    gradient). The KL to the base model's step takes one of two forms (``settings.kl_form``)::

        step:      KL_i = mean_samples mean_k (mean_theta - mean_ref)^2 / (2 std^2)
                   the Gaussian KL of the step's transition, whose std is std_t sqrt(|dt|) (cps: std_t)
        flow_grpo: KL_i = mean_samples mean_k (mean_theta - mean_ref)^2 / (2 std_t^2)
                   Flow-GRPO's, |dt| times the step form: on a 10-40 step schedule 15-100x smaller (cps: the same)

    Returns the scalar loss and detached statistics (``clip_frac``: the fraction of samples clipped, or dropped by
    dppo).
    """
    s, s_next, sd = float(batch.sigmas[step]), float(batch.sigmas[step + 1]), float(batch.std_t[step])
    z, z_next = batch.latents[step], batch.latents[step + 1]
    sde = STEPS[batch.sde_type]
    mean = sde.mean(z, v, s, s_next, sd)
    std = sde.std(s, s_next, sd)
    adv = advantages.to(mean.device)
    old_mean = None if settings.policy_loss == "clip" else sde.mean(z, batch.velocities[step].to(mean.device),
                                                                    s, s_next, sd)
    if settings.policy_loss == "guard":
        ratio = torch.exp(((mean - old_mean).flatten(1) * (z_next.float() - old_mean).flatten(1)).mean(dim=1) / std)
    else:
        ratio = torch.exp(sde.log_prob(z_next, mean, std) - batch.log_probs[step].to(mean.device))
    if settings.policy_loss == "dppo":
        kl_old = ((mean - old_mean) ** 2).flatten(1).mean(dim=1) / (2 * std ** 2)
        stopped = (kl_old >= settings.kl_mask_threshold) & (((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0)))
        policy_loss = (-adv * ratio * (~stopped)).mean()
    else:
        policy_loss, stopped = _clipped(ratio, adv, settings.clip_range)
    if settings.policy_loss == "guard":
        policy_loss = policy_loss / ((len(batch.sigmas) - 1) * (s - s_next))
    loss = policy_loss
    kl = torch.zeros((), device=v.device)
    if settings.kl_beta > 0:
        ref_mean = sde.mean(z, v_ref, s, s_next, sd)
        variance = std ** 2 if settings.kl_form == "step" else sd ** 2
        kl = (((mean - ref_mean) ** 2).flatten(1).mean(dim=1) / (2 * variance)).mean()
        loss = loss + settings.kl_beta * kl
    stats = {"kl": kl.detach(), "ratio": ratio.detach().mean(), "ratio_dev": (ratio.detach() - 1).abs().max(),
             "clip_frac": stopped.float().mean().detach()}
    return loss * settings.scale, stats


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's ``mean_samples max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps))`` and which samples lie outside the
    clip range."""
    clipped = torch.clamp(ratio, 1 - eps, 1 + eps)
    return torch.maximum(-adv * ratio, -adv * clipped).mean(), (ratio - 1).abs() > eps
