"""SDE rollouts with log-probabilities, and ODE sampling for evaluation (Flow-GRPO conventions).

Step i goes from sigma ``s = sigma_i`` to ``s' = sigma_{i+1}``, ``dt = s' - s < 0``, with the velocity
``v = v_theta(z_i, s, c)`` and noise level ``a``::

    std_t  = a * sqrt(s / (1 - s))                  (s = 1 uses sigma_1 in the denominator)
    mean   = z + [v + std_t^2 / (2 s) * (z + (1 - s) v)] dt
    z'     = mean + std_t * sqrt(-dt) * eps

``log p(z' | z)`` is the Gaussian log-density averaged over elements, in fp32. ``a = 0`` is the
Euler ODE step ``z' = z + v dt``.

A rollout may inject noise only at the steps ``sde_steps`` and take the ODE step at the others (as
Flow-GRPO-Fast and MixGRPO, with the trained steps): then every difference between the samples of a
group comes from the steps that are trained, and the group's rewards carry less noise from steps whose
policy is not updated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .models.base import Conditioning, FlowModel


#: eval samples denoised together when ``sampling.rollout_batch_size`` is not set
EVAL_BATCH = 16


def step_noise_std(sigmas: torch.Tensor, noise_level: float) -> torch.Tensor:
    """``std_t = a sqrt(s / (1 - s))`` for every step; the step at s = 1 uses sigma_1 instead."""
    s = sigmas[:-1].double()
    denominator = 1 - torch.where(s >= 1, sigmas[1].double(), s)
    return (noise_level * torch.sqrt(s / denominator)).float()


def sde_step_mean(z: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float, std_t: float) -> torch.Tensor:
    """``mean = z + [v + std_t^2 / (2 s) (z + (1 - s) v)] dt`` in fp32."""
    z, v = z.float(), v.float()
    dt = sigma_next - sigma
    return z + (v + std_t ** 2 / (2 * sigma) * (z + (1 - sigma) * v)) * dt


def step_std(sigma: float, sigma_next: float, std_t: float) -> float:
    """Standard deviation of ``z'`` given ``z``: ``std_t sqrt(-dt)``."""
    return std_t * math.sqrt(sigma - sigma_next)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """Per-sample Gaussian log-density of ``x`` averaged over elements, fp32:
    ``mean_k[ -(x_k - mu_k)^2 / (2 std^2) - log std - log sqrt(2 pi) ]``."""
    x, mean = x.float(), mean.float()
    log_density = -((x - mean) ** 2) / (2 * std ** 2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return log_density.flatten(1).mean(dim=1)


@dataclass
class Trajectory:
    """One rollout batch: ``latents[i]`` is z_i (``latents[0]`` the noise), ``velocities[i]`` the
    velocity used at step i, ``log_probs[i]`` log p(z_{i+1} | z_i) under the rollout policy (0 for
    an ODE step, whose ``std_t`` is 0)."""

    latents: torch.Tensor          # [T + 1, B, *latent]
    velocities: torch.Tensor       # [T, B, *latent]
    log_probs: torch.Tensor        # [T, B] fp32
    sigmas: torch.Tensor           # [T + 1]
    std_t: torch.Tensor            # [T]
    ref_velocities: torch.Tensor | None = None  # [S, B, *latent]: the S noisy steps' in order, adapters disabled
    #                                             (grpo.kl_reference: rollout; else the training pass computes them)

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
        return Trajectory(self.latents[:, index], self.velocities[:, index], self.log_probs[:, index],
                          self.sigmas, self.std_t, ref)


def initial_noise(model: FlowModel, batch: int, resolution: int, generator: torch.Generator) -> torch.Tensor:
    shape = (batch, *model.latent_shape(resolution))
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(model.device)


def select_conditioning(cond: Conditioning, index: torch.Tensor | slice) -> Conditioning:
    """The conditioning of the samples ``index``."""
    return {key: value[index] for key, value in cond.items()}


@torch.no_grad()
def sde_rollout(model: FlowModel, cond: Conditioning, sigmas: torch.Tensor, noise_level: float,
                z0: torch.Tensor, generator: torch.Generator, with_reference: bool = False,
                sde_steps: Sequence[int] | None = None, chunk_size: int | None = None,
                group_size: int = 1) -> Trajectory:
    """Sample ``z_0 -> z_T`` recording latents, velocities and log-probs: the SDE step at the steps
    ``sde_steps`` (default: all), the Euler ODE step at the others.

    The noise of every SDE step is drawn first, step by step for the whole batch (the order of drawing
    one batch step by step), then the batch is denoised ``chunk_size`` samples at a time (default: all
    at once): a rollout in chunks holds the activations of one chunk and samples exactly what one batch
    would.

    ``group_size = G > 1``: every G consecutive samples share their conditioning and initial noise (rows of
    ``z0`` repeated G times), so their paths agree up to the first SDE step ``p``: the ODE steps ``0..p-1`` are
    taken once per group, by the group's first sample, and copied to the others (shared prefix). The trajectory
    is that of the unshared rollout of the same ``z0``."""
    num_steps = len(sigmas) - 1
    noisy = torch.zeros(num_steps, dtype=torch.bool)
    noisy[list(range(num_steps) if sde_steps is None else sde_steps)] = True
    std_t = step_noise_std(sigmas, noise_level) * noisy
    noise = torch.zeros((num_steps, *z0.shape))
    for i in noisy.nonzero().flatten().tolist():
        noise[i] = torch.randn(z0.shape, generator=generator, dtype=torch.float32)
    prefix = int(noisy.int().argmax()) if group_size > 1 and noisy.any() else 0
    if prefix == 0:
        return _rollout(model, cond, sigmas, std_t, z0, noise, with_reference, chunk_size)
    heads = torch.arange(0, z0.shape[0], group_size)
    if not torch.equal(z0, z0[heads].repeat_interleave(group_size, dim=0)):
        raise ValueError(f"a shared-prefix rollout needs the same initial noise within each group of {group_size}")
    shared = _rollout(model, select_conditioning(cond, heads), sigmas[:prefix + 1], std_t[:prefix], z0[heads],
                      noise[:prefix, heads], False, chunk_size)
    branched = _rollout(model, cond, sigmas[prefix:], std_t[prefix:],
                        shared.latents[-1].repeat_interleave(group_size, dim=0), noise[prefix:], with_reference,
                        chunk_size)
    copied = shared.select(torch.arange(len(heads)).repeat_interleave(group_size))
    return Trajectory(torch.cat([copied.latents[:-1], branched.latents]),
                      torch.cat([copied.velocities, branched.velocities]),
                      torch.cat([copied.log_probs, branched.log_probs]), sigmas, std_t, branched.ref_velocities)


def _rollout(model: FlowModel, cond: Conditioning, sigmas: torch.Tensor, std_t: torch.Tensor, z0: torch.Tensor,
             noise: torch.Tensor, with_reference: bool, chunk_size: int | None) -> Trajectory:
    """The rollout of ``z0`` through ``sigmas`` given each step's noise, ``chunk_size`` samples at a time."""
    chunks = torch.arange(z0.shape[0]).split(chunk_size or z0.shape[0])
    parts = [_rollout_chunk(model, select_conditioning(cond, index), sigmas, std_t, z0[index], noise[:, index],
                            with_reference) for index in chunks]
    refs = [part.ref_velocities for part in parts]
    return Trajectory(torch.cat([part.latents for part in parts], dim=1),
                      torch.cat([part.velocities for part in parts], dim=1),
                      torch.cat([part.log_probs for part in parts], dim=1), sigmas, std_t,
                      torch.cat(refs, dim=1) if with_reference else None)


def _rollout_chunk(model: FlowModel, cond: Conditioning, sigmas: torch.Tensor, std_t: torch.Tensor, z0: torch.Tensor,
                   noise: torch.Tensor, with_reference: bool) -> Trajectory:
    """The rollout of one chunk of samples, given the noise ``noise[i]`` of each step ``i`` (the SDE steps are those
    with ``std_t > 0``)."""
    latents, velocities, log_probs, refs = [z0.float()], [], [], []
    z = z0.float()
    for i in range(len(sigmas) - 1):
        s, s_next, sd = float(sigmas[i]), float(sigmas[i + 1]), float(std_t[i])
        v = model.velocity(z, sigmas[i].to(z.device), cond).float()
        velocities.append(v)
        if sd == 0:
            z = z + v * (s_next - s)
            latents.append(z)
            log_probs.append(torch.zeros(z.shape[0], device=z.device))
            continue
        if with_reference:
            with model.adapters_disabled():
                refs.append(model.velocity(z, sigmas[i].to(z.device), cond).float())
        mean = sde_step_mean(z, v, s, s_next, sd)
        std = step_std(s, s_next, sd)
        z = mean + std * noise[i].to(z.device)
        latents.append(z)
        log_probs.append(gaussian_log_prob(z, mean, std))
    return Trajectory(torch.stack(latents), torch.stack(velocities), torch.stack(log_probs), sigmas, std_t,
                      torch.stack(refs) if with_reference else None)


@torch.no_grad()
def ode_sample(model: FlowModel, cond: Conditioning, sigmas: torch.Tensor, z0: torch.Tensor) -> torch.Tensor:
    """Deterministic Euler sampling ``z' = z + v dt`` (the SDE with a = 0); returns the final latents."""
    z = z0.float()
    for i in range(len(sigmas) - 1):
        v = model.velocity(z, sigmas[i].to(z.device), cond).float()
        z = z + v * float(sigmas[i + 1] - sigmas[i])
    return z
