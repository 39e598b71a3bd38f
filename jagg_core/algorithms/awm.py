"""Advantage Weighted Matching (Xue et al., arXiv 2509.25050; reference code scxue/advantage_weighted_matching
``scripts/train_sd3_awm.py``, ``config/dgx_awm.py``): the flow-matching loss of the rollout's clean samples weighted
by their advantages (``train.algorithm: awm``).

Rollout: on-policy ODE samples ``x0`` (CFG-free). Rewards -> group advantages ``A`` (the ``grpo`` section's groups,
clamped to ``+-c``, ``c = grpo.adv_clip``), rescaled ``A' = A / c * awm.advantage_max``. Each sample is trained at
``K = awm.train_timesteps`` schedule steps drawn stratified from ``1 .. n`` with ``n = int(T awm.timestep_fraction)``
(by default ``K = min(6, n)``: the paper's 6, or every step of a shorter schedule; the reference's
``discrete_wo_init``: with ``b = linspace(1, n, K + 1)``, step ``i`` is uniform in ``[int(b_i), int(b_{i+1}))``, or
``int(b_i)`` when that range is empty), fresh noise each (:mod:`.forward_process`).
At a row, ``e = mean_k (v_theta(x_t) - (eps - x0))^2`` (float64) gives the per-row log-likelihood surrogate::

    ghuber:   l = -((e + 1e-10)^p - (1e-10)^p) sigma / p         (p = awm.ghuber_power, the paper's default)
    uniform:  l = -e

and the loss (one optimizer step per rollout, so the ratio ``exp(l - sg(l))`` is 1 and its PPO clip never acts)::

    L = mean_rows[ -A' exp(l - sg(l)) ] + awm.kl_beta mean_rows mean_k (v - v_ref)^2
                                         + awm.ema_kl_beta mean_rows mean_k (v - v_ema)^2

``v_ref``: the base model (adapter disabled); ``v_ema``: a lagging copy of the LoRA, after each iteration ``k``
``theta_ema = d theta_ema + (1 - d) theta`` with ``d = min(ema_kl_decay_max, ema_kl_decay_rate k)`` (the reference's
``kl_ema_decay_type: linear``).

Where this differs from the reference code: the rollout is our Euler ODE sampler (theirs an SA-solver with its SDE
fraction 0, deterministic); each sample draws its own steps (theirs one draw per training micro-batch of 3
samples); the reference's per-prompt advantages with global std are ``grpo.group_by: prompt`` with
``grpo.global_std: true``; the EMA of the weights used for its evals is ``train.ema_decay``.
"""

from __future__ import annotations

import torch

from .. import metrics
from ..errors import UserError
from .base import LaggingPolicy
from .forward_process import ForwardProcessAlgorithm, RowBatch, per_row_mean

#: the offset that keeps the generalized Huber weighting's gradient finite at e = 0
GHUBER_EPS = 1e-10


def stratified_steps(count: int, last: int, samples: int, generator: torch.Generator, first: int = 1) -> torch.Tensor:
    """[samples, count] steps, each row one stratified draw from ``first .. last`` (the module's
    ``discrete_wo_init``, from 1)."""
    bounds = torch.linspace(first, last, count + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    u = torch.rand((samples, count), generator=generator)
    return lower + (u * (upper - lower)).long()


def awm_log_likelihood(v: torch.Tensor, rows: RowBatch, weighting: str, power: float) -> torch.Tensor:
    """Each row's ``l`` (the module's formula), float64, [R]."""
    error = per_row_mean((v.double() - (rows.noise.double() - rows.x0.double())) ** 2)
    if weighting == "uniform":
        return -error
    return -((error + GHUBER_EPS) ** power - GHUBER_EPS ** power) * rows.sigmas.double() / power


class AwmAlgorithm(ForwardProcessAlgorithm):
    name = "awm"

    state_key = "awm_ema_policy"

    def lagging_policy(self) -> LaggingPolicy:
        """The EMA the loss regularizes towards."""
        awm = self.config.awm
        return LaggingPolicy(self.ctx.params, awm.ema_kl_decay_rate, awm.ema_kl_decay_max)

    @staticmethod
    def steps_per_sample(config) -> int:
        return config.awm.steps_per_sample(config.sampling.num_steps)

    def draw_steps(self, samples: int, generator: torch.Generator) -> torch.Tensor:
        """Stratified from ``[1, n)`` (the module's strata); of a two-expert model, from those of its trained
        expert's steps ``[start, stop)`` (:meth:`~jagg_core.models.base.FlowModel.trained_steps`): from
        ``[max(1, start), min(n, stop))``, refused in one line when that is empty."""
        awm, num_steps = self.config.awm, self.config.sampling.num_steps
        expert = self.ctx.model.trained_steps(self.ctx.sigmas)
        first, last = max(1, expert.start), min(awm.trainable_steps(num_steps), expert.stop)
        if last <= first:
            raise UserError(f"AWM's steps, 1 to n - 1 with n = int(sampling.num_steps x awm.timestep_fraction) = "
                            f"{awm.trainable_steps(num_steps)}, include none of the trained expert's ({expert.start} "
                            f".. {expert.stop - 1}): raise awm.timestep_fraction or train the other expert "
                            "(model.expert)")
        return stratified_steps(awm.steps_per_sample(num_steps), last, samples, generator, first)

    @staticmethod
    def companion_names(config) -> list[str]:
        awm = config.awm
        return [*(["reference"] if awm.kl_beta > 0 else []), *(["ema"] if awm.ema_kl_beta > 0 else [])]

    def policy(self, companion):
        return self.lag.swapped_in if companion == "ema" else self.ctx.model.adapters_disabled

    def loss(self, v, others, rows):
        awm = self.config.awm
        weights = rows.advantages.to(v.device).double() / self.config.grpo.adv_clip * awm.advantage_max
        log_likelihood = awm_log_likelihood(v, rows, awm.weighting, awm.ghuber_power)
        policy = (-weights * torch.exp(log_likelihood - log_likelihood.detach())).mean()
        loss, stats = policy, {metrics.POLICY_LOSS: float(policy.detach())}
        for name, beta, key in (("reference", awm.kl_beta, metrics.KL), ("ema", awm.ema_kl_beta, metrics.LAG_DEVIATION)):
            if name in others:
                distance = per_row_mean((v.double() - others[name].double()) ** 2).mean()
                loss = loss + beta * distance
                stats[key] = float(distance.detach())
        return loss, stats
