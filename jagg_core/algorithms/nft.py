"""DiffusionNFT (Zheng et al., arXiv 2509.16117; reference code NVlabs/DiffusionNFT ``scripts/train_nft_sd3.py``,
``config/nft.py``): online RL on the forward process (``train.algorithm: nft``).

Rollout: ODE samples ``x0`` by the lagging *old* policy ``theta_old`` (CFG-free). Rewards -> group advantages ``A``
(the ``grpo`` section's groups, clamped to ``+-c``, ``c = grpo.adv_clip``) -> optimality weights::

    r = clip(A / c / 2 + 1/2, 0, 1)

Each sample is trained at ``K = int(T nft.timestep_fraction)`` of the ``T`` schedule steps, a random permutation's
first K (fresh noise each, :mod:`.forward_process`), cut in ``m = nft.updates_per_rollout`` parts in that order:
optimizer step ``s`` of the iteration trains every sample at its part ``s``. At a row, with ``v = v_theta(x_t)`` and
``v_old`` the old policy's velocity (no grad), the implicit positive and negative policies mix them with
``beta = nft.beta``::

    v+ = beta v + (1 - beta) v_old              v- = (1 + beta) v_old - beta v
    x0+ = x_t - sigma v+                        x0- = x_t - sigma v-
    L+ = mean_k (x0+ - x0)^2 / w+,  w+ = sg(mean_k |x0+ - x0|) clipped to >= 1e-5   (per row, in float64)
    L- likewise with its own w- (the adaptive weights are detached and computed per branch)
    L  = mean_rows[ c (r L+ + (1 - r) L-) / beta ] + nft.kl_beta mean_rows mean_k (v - v_ref)^2

``v_ref`` is the base model's velocity (adapter disabled). After each iteration ``k`` (its ``m`` optimizer steps) the
old policy becomes ``theta_old = d theta_old + (1 - d) theta`` with ``d = min(old_decay_max, old_decay_rate * max(0, s -
old_decay_delay))``, ``s = k m`` the optimizer steps so far: the reference code's ``decay_type`` 1 is (rate 0.001, max
0.5, delay 0), type 2 (0.0075, 0.999, 75).

Where this differs from the reference code: the rollout is our Euler ODE sampler (theirs a 2nd-order DPM solver;
the paper allows any sampler); all of a sample's rows are stacked into micro-batches of rows (theirs loops over the
timesteps, one backward each: the same gradient); with ``m > 1`` updates per rollout the batch is cut by each
sample's steps, so every update sees every group (theirs cuts it by samples); the reference's per-prompt
advantages with global std are ``grpo.group_by: prompt`` with ``grpo.global_std: true``; the EMA of the weights used
for its evals is ``train.ema_decay``.
"""

from __future__ import annotations

import torch

from .. import metrics
from ..errors import UserError
from .base import LaggingPolicy
from .forward_process import ForwardProcessAlgorithm, RowBatch, broadcast_rows, per_row_mean


def optimality_weights(advantages: torch.Tensor, adv_clip: float) -> torch.Tensor:
    """``r = clip(A / c / 2 + 1/2, 0, 1)`` of advantages already clamped to ``+-c``."""
    return ((advantages / adv_clip) / 2 + 0.5).clamp(0, 1)


def nft_policy_loss(v: torch.Tensor, v_old: torch.Tensor, rows: RowBatch, beta: float, adv_clip: float
                    ) -> torch.Tensor:
    """Each row's ``c (r L+ + (1 - r) L-) / beta`` (the module's formula), float64, [R]."""
    t = broadcast_rows(rows.sigmas, rows.x0)
    r = optimality_weights(rows.advantages.to(v.device).double(), adv_clip)

    def adaptive_loss(velocity: torch.Tensor) -> torch.Tensor:
        x0_pred = rows.x_t - t * velocity
        with torch.no_grad():
            weight = per_row_mean((x0_pred.double() - rows.x0.double()).abs()).clamp(min=1e-5)
        return per_row_mean((x0_pred - rows.x0) ** 2) / weight

    positive = beta * v + (1 - beta) * v_old
    negative = (1 + beta) * v_old - beta * v
    return adv_clip * (r * adaptive_loss(positive) + (1 - r) * adaptive_loss(negative)) / beta


class NftAlgorithm(ForwardProcessAlgorithm):
    name = "nft"

    state_key = "nft_old_policy"

    def lagging_policy(self) -> LaggingPolicy:
        """The old policy: the rollout samples with it, and the loss's implicit policies mix it in."""
        nft = self.config.nft
        return LaggingPolicy(self.ctx.params, nft.old_decay_rate, nft.old_decay_max, nft.old_decay_delay)

    def sampling_policy(self):
        return self.lag.swapped_in()

    @staticmethod
    def updates_per_rollout(config) -> int:
        return config.nft.updates_per_rollout

    @staticmethod
    def steps_per_sample(config) -> int:
        return config.nft_steps_per_sample()

    def draw_steps(self, samples: int, generator: torch.Generator) -> torch.Tensor:
        """A random permutation's first ``K`` of the ``T`` steps, per sample; of a two-expert model, of its trained
        expert's steps (:meth:`~jagg_core.models.base.FlowModel.trained_steps`), at most all of them."""
        steps = self.ctx.model.trained_steps(self.ctx.sigmas)
        count = min(self.steps_per_sample(self.config), len(steps))
        if count < self.optimizer_steps:
            raise UserError(f"nft.updates_per_rollout {self.optimizer_steps} must be at most the {count} steps the "
                            "trained expert denoises (model.expert): lower it or take more sampling.num_steps")
        return torch.stack([torch.randperm(len(steps), generator=generator)[:count] + steps.start
                            for _ in range(samples)])

    @staticmethod
    def companion_names(config) -> list[str]:
        return ["old", *(["reference"] if config.nft.kl_beta > 0 else [])]

    def policy(self, companion):
        return self.lag.swapped_in if companion == "old" else self.ctx.model.adapters_disabled

    def loss(self, v, others, rows):
        nft = self.config.nft
        policy = nft_policy_loss(v, others["old"], rows, nft.beta, self.config.grpo.adv_clip).mean()
        kl = per_row_mean((v - others["reference"]) ** 2).mean() if "reference" in others else torch.zeros(())
        stats = {metrics.POLICY_LOSS: float(policy.detach()), metrics.KL: float(kl.detach()),
                 metrics.LAG_DEVIATION: float(per_row_mean((v.detach() - others["old"]) ** 2).mean())}
        return policy + nft.kl_beta * kl, stats
