"""SDE rollouts with log-probabilities, and ODE sampling for evaluation (Flow-GRPO conventions).

Step i goes from sigma ``s = sigma_i`` to ``s' = sigma_{i+1}``, ``dt = s' - s < 0``, with the velocity
``v = v_theta(z_i, s, c)``; a stochastic step (:mod:`jagg_core.sde`, ``sampling.sde_type``: Flow-GRPO's by default)
draws ``z' = mean + std eps`` and records ``log p(z' | z)``; an ODE step is the Euler step ``z' = z + v dt``.

A rollout may inject noise only at the steps ``sde_steps`` and take the ODE step at the others (as
Flow-GRPO-Fast and MixGRPO, with the trained steps): then every difference between the samples of a
group comes from the steps that are trained, and the group's rewards carry less noise from steps whose
policy is not updated.

A group rollout (``group_size``) starts the G samples of a prompt from one initial noise and grows a tree: the
shared prefix (one split into G at the first SDE step) or BranchGRPO-style branching (``splits``: a factor at each
of several SDE steps). Samples on one node of the tree hold the same latent, so its velocity is computed once, in
the rollout and, through ``Trajectory.node_ids``, in the training pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from .image_size import ImageSize
from .models.base import Conditioning, FlowModel
from .sde import STEPS


@dataclass
class Trajectory:
    """One rollout batch: ``latents[i]`` is z_i (``latents[0]`` the noise), ``velocities[i]`` the
    velocity used at step i, ``log_probs[i]`` log p(z_{i+1} | z_i) under the rollout policy (0 for
    an ODE step, whose ``std_t`` is 0), with the steps of ``sde_type`` (:data:`jagg_core.sde.STEPS`)."""

    latents: torch.Tensor          # [T + 1, B, *latent]
    velocities: torch.Tensor       # [T, B, *latent]
    log_probs: torch.Tensor        # [T, B] fp32
    sigmas: torch.Tensor           # [T + 1]
    std_t: torch.Tensor            # [T]
    ref_velocities: torch.Tensor | None = None  # [S, B, *latent]: the S noisy steps' in order, adapters disabled
    #                                             (grpo.kl_reference: rollout; else the training pass computes them)
    node_ids: torch.Tensor | None = None        # [T + 1, B]: samples of a group rollout with the same id at level i
    #                                             hold the same z_i (group_node_ids); None: all distinct
    sde_type: str = "flow_grpo"

    @property
    def num_steps(self) -> int:
        return self.velocities.shape[0]

    @property
    def batch_size(self) -> int:
        return self.latents.shape[1]

    def reference_velocity(self, step: int) -> torch.Tensor:
        """The reference velocity of the noisy step ``step``: row ``#{noisy steps before it}`` of ``ref_velocities``."""
        return self.ref_velocities[int((self.std_t[:step] > 0).sum())]

    def select(self, index: torch.Tensor | slice) -> "Trajectory":
        """The sub-batch of samples ``index``."""
        ref = self.ref_velocities[:, index] if self.ref_velocities is not None else None
        nodes = self.node_ids[:, index] if self.node_ids is not None else None
        return Trajectory(self.latents[:, index], self.velocities[:, index], self.log_probs[:, index],
                          self.sigmas, self.std_t, ref, nodes, self.sde_type)


def initial_noise(model: FlowModel, batch: int, size: ImageSize, generator: torch.Generator) -> torch.Tensor:
    """Standard normal latents of ``batch`` samples of ``size``, drawn on the CPU from ``generator``."""
    shape = (batch, *model.latent_shape(size))
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(model.device)


def select_conditioning(cond: Conditioning, index: torch.Tensor | slice) -> Conditioning:
    """The conditioning of the samples ``index``."""
    return {key: value[index] for key, value in cond.items()}


def group_node_ids(batch: int, group_size: int, splits: Mapping[int, int], num_steps: int) -> torch.Tensor:
    """``[T + 1, B]``: the node of every sample at every level ``i`` (the latent ``z_i``) of its group's tree; samples
    with the same id hold the same ``z_i``. Every ``G = group_size`` consecutive samples are one group, which starts
    as one node (shared initial noise); step ``i`` splits every node into ``splits[i]`` children (1 if absent), so at
    level ``i`` a group has ``m_i = prod_{s < i} splits[s]`` nodes and its sample ``k`` is at node
    ``floor(k / (G / m_i))``. The id is ``group * G + node``."""
    sample = torch.arange(batch)
    levels, nodes = [], 1
    for i in range(num_steps + 1):
        levels.append(sample // group_size * group_size + sample % group_size // (group_size // nodes))
        nodes *= splits.get(i, 1)
    return torch.stack(levels)


def distinct_rows(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``first, inverse``: the first row of every distinct id (in the order of ``torch.unique``), and for every row
    the index of its id in ``first``, so ``x[first][inverse]`` is ``x`` whenever rows with the same id are equal."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    rows = torch.arange(len(ids))
    first = torch.full((len(unique),), len(ids)).scatter_reduce(0, inverse, rows, "amin")
    return first, inverse


def shared_velocity(model: FlowModel, z: torch.Tensor, sigma: torch.Tensor, cond: Conditioning,
                    node_ids: torch.Tensor | None, chunk_size: int | None = None) -> torch.Tensor:
    """``model.velocity`` of the batch, computed once per distinct node id (rows with one id hold the same latent,
    sigma and conditioning) and copied to the others, ``chunk_size`` distinct rows per call (default: all); under
    autograd the copies' gradients add up at their node. ``node_ids`` None: every row is its own."""
    if node_ids is None and not chunk_size:
        return model.velocity(z, sigma, cond)
    first, inverse = distinct_rows(node_ids) if node_ids is not None else (torch.arange(len(z)), None)
    first = first.to(z.device)
    parts = [model.velocity(z[rows], sigma if sigma.dim() == 0 else sigma[rows], select_conditioning(cond, rows))
             for rows in first.split(chunk_size or len(first))]
    v = parts[0] if len(parts) == 1 else torch.cat(parts)
    return v if inverse is None else v[inverse.to(z.device)]


@torch.no_grad()
def sde_rollout(model: FlowModel, cond: Conditioning, sigmas: torch.Tensor, noise_level: float,
                z0: torch.Tensor, generator: torch.Generator, with_reference: bool = False,
                sde_steps: Sequence[int] | None = None, chunk_size: int | None = None,
                group_size: int = 1, splits: Mapping[int, int] | None = None,
                sde_type: str = "flow_grpo") -> Trajectory:
    """Sample ``z_0 -> z_T`` recording latents, velocities and log-probs: the stochastic step of ``sde_type`` at
    the steps ``sde_steps`` (default: all), the Euler ODE step at the others (and where its noise is 0).

    The noise of every SDE step is drawn first, step by step for the whole batch, then the batch is
    denoised step by step, ``chunk_size`` samples per transformer call (default: all at once): a rollout in
    chunks holds the activations of one chunk and samples exactly what one call would.

    ``group_size = G > 1``: every G consecutive samples share their conditioning and initial noise (rows of
    ``z0`` repeated G times) and form a tree (:func:`group_node_ids`): step ``i`` splits each node into
    ``splits[i]`` children, which draw their own noise from step ``i`` on, and before a split the children's paths
    are one. Default ``{first SDE step: G}``: the shared prefix, ODE steps taken once per group, then G branches;
    tree rollouts (:func:`~jagg_core.placement.branch_splits`) split at several SDE steps. Every step's velocity
    (and reference) is computed once per node. The trajectory is that of the unshared rollout of the same initial noise with the
    noise of each step drawn once per node; ``Trajectory.node_ids`` records the tree."""
    num_steps = len(sigmas) - 1
    noisy = torch.zeros(num_steps, dtype=torch.bool)
    noisy[list(range(num_steps) if sde_steps is None else sde_steps)] = True
    std_t = STEPS[sde_type].noise(sigmas, noise_level) * noisy
    noisy &= std_t > 0
    noise = torch.zeros((num_steps, *z0.shape))
    for i in noisy.nonzero().flatten().tolist():
        noise[i] = torch.randn(z0.shape, generator=generator, dtype=torch.float32)
    node_ids = None
    if group_size > 1:
        heads = torch.arange(0, z0.shape[0], group_size)
        if not torch.equal(z0, z0[heads].repeat_interleave(group_size, dim=0)):
            raise ValueError(f"a group rollout needs the same initial noise within each group of {group_size}")
        if splits is None:
            splits = {int(noisy.int().argmax()): group_size}
        elif math.prod(splits.values()) != group_size or not all(noisy[step] for step in splits):
            raise ValueError(f"splits {dict(splits)} must be at SDE steps and multiply to the group size {group_size}")
        node_ids = group_node_ids(z0.shape[0], group_size, splits, num_steps)
        for i in noisy.nonzero().flatten().tolist():
            first, inverse = distinct_rows(node_ids[i + 1])
            noise[i] = noise[i][first[inverse]]  # one draw per node of level i + 1
    return _rollout(model, cond, sigmas, std_t, z0, noise, with_reference, chunk_size, node_ids, sde_type)


def _rollout(model: FlowModel, cond: Conditioning, sigmas: torch.Tensor, std_t: torch.Tensor, z0: torch.Tensor,
             noise: torch.Tensor, with_reference: bool, chunk_size: int | None,
             node_ids: torch.Tensor | None, sde_type: str) -> Trajectory:
    """The rollout of ``z0`` through ``sigmas`` given the noise ``noise[i]`` of each step ``i`` (the stochastic steps
    of ``sde_type`` are those with ``std_t > 0``), each step's velocities computed once per node of ``node_ids``,
    ``chunk_size`` of them per transformer call."""
    step = STEPS[sde_type]
    latents, velocities, log_probs, refs = [z0.float()], [], [], []
    z = z0.float()
    for i in range(len(sigmas) - 1):
        s, s_next, sd = float(sigmas[i]), float(sigmas[i + 1]), float(std_t[i])
        ids = node_ids[i] if node_ids is not None else None
        v = shared_velocity(model, z, sigmas[i].to(z.device), cond, ids, chunk_size).float()
        velocities.append(v)
        if sd == 0:
            z = z + v * (s_next - s)
            latents.append(z)
            log_probs.append(torch.zeros(z.shape[0], device=z.device))
            continue
        if with_reference:
            with model.adapters_disabled():
                refs.append(shared_velocity(model, z, sigmas[i].to(z.device), cond, ids, chunk_size).float())
        mean = step.mean(z, v, s, s_next, sd)
        std = step.std(s, s_next, sd)
        z = mean + std * noise[i].to(z.device)
        latents.append(z)
        log_probs.append(step.log_prob(z, mean, std))
    return Trajectory(torch.stack(latents), torch.stack(velocities), torch.stack(log_probs), sigmas, std_t,
                      torch.stack(refs) if with_reference else None, node_ids, sde_type)


@torch.no_grad()
def ode_sample(model: FlowModel, cond: Conditioning, sigmas: torch.Tensor, z0: torch.Tensor,
               chunk_size: int | None = None) -> torch.Tensor:
    """Deterministic Euler sampling ``z' = z + v dt`` (the SDE with a = 0); returns the final latents. ``chunk_size``
    samples are denoised together (None: all)."""
    chunk = chunk_size or z0.shape[0]
    finals = []
    for first in range(0, z0.shape[0], chunk):
        z = z0[first:first + chunk].float()
        part = select_conditioning(cond, slice(first, first + chunk))
        for i in range(len(sigmas) - 1):
            v = model.velocity(z, sigmas[i].to(z.device), part).float()
            z = z + v * float(sigmas[i + 1] - sigmas[i])
        finals.append(z)
    return torch.cat(finals)
