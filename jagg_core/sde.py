"""The stochastic step of a GRPO rollout (``sampling.sde_type``): its noise, mean, spread and log-probability.

Step i goes from sigma ``s = sigma_i`` to ``s' = sigma_{i+1}``, ``dt = s' - s < 0``, with the velocity ``v`` and the
noise level ``a``; ``x0 = z - s v`` is the image the step predicts and ``x1 = z + (1 - s) v`` the noise. Each type
gives every step a noise coefficient ``std_t`` (0: the Euler ODE step ``z' = z + v dt``, whose log p is 0)::

    flow_grpo (Flow-GRPO)   std_t = a sqrt(s / (1 - s))            (s = 1 uses sigma_1 in the denominator)
                            mean  = z + [v + std_t^2 / (2 s) (z + (1 - s) v)] dt,   z' = mean + std_t sqrt(-dt) eps
                            log p = the Gaussian log-density of z', averaged over elements
    dance_grpo (DanceGRPO)  std_t = a, every step: the same mean, transition and log p
    cps (Flow-CPS)          std_t = s' sin(a pi / 2), the transition's standard deviation itself
                            mean  = (1 - s') x0 + sqrt(s'^2 - std_t^2) x1,          z' = mean + std_t eps
                            log p = -mean_k (z'_k - mean_k)^2   (the reference code's: no 1 / (2 std_t^2), no constants)

Flow-GRPO's and DanceGRPO's steps discretize the reverse SDE, so a sample keeps some of the injected noise
(more at a higher ``a``); the coefficients-preserving step (CPS, arXiv 2509.05952) gives ``z'`` exactly the noise
coefficient ``s'`` of the schedule (``(s'^2 - std_t^2) + std_t^2 = s'^2``), so the final samples the rewards score
are clean at any ``a`` in (0, 1]. Its last step (``s' = 0``) adds no noise: it is the ODE step and cannot be
trained (:meth:`jagg_core.config.RunConfig.trainable_steps`). All steps compute in float32.
"""

from __future__ import annotations

import math

import torch


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    """Per-sample Gaussian log-density of ``x`` averaged over elements, fp32:
    ``mean_k[ -(x_k - mu_k)^2 / (2 std^2) - log std - log sqrt(2 pi) ]``."""
    x, mean = x.float(), mean.float()
    log_density = -((x - mean) ** 2) / (2 * std ** 2) - math.log(std) - 0.5 * math.log(2 * math.pi)
    return log_density.flatten(1).mean(dim=1)


class FlowGrpoStep:
    """Flow-GRPO's SDE step (the module's formulas)."""

    name = "flow_grpo"

    def noise(self, sigmas: torch.Tensor, noise_level: float) -> torch.Tensor:
        """``std_t = a sqrt(s / (1 - s))`` for every step; the step at s = 1 uses sigma_1 instead."""
        s = sigmas[:-1].double()
        denominator = 1 - torch.where(s >= 1, sigmas[1].double(), s)
        return (noise_level * torch.sqrt(s / denominator)).float()

    def mean(self, z: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float, std_t: float) -> torch.Tensor:
        """``mean = z + [v + std_t^2 / (2 s) (z + (1 - s) v)] dt``."""
        z, v = z.float(), v.float()
        return z + (v + std_t ** 2 / (2 * sigma) * (z + (1 - sigma) * v)) * (sigma_next - sigma)

    def std(self, sigma: float, sigma_next: float, std_t: float) -> float:
        """The transition's standard deviation ``std_t sqrt(-dt)``."""
        return std_t * math.sqrt(sigma - sigma_next)

    def log_prob(self, x: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
        return gaussian_log_prob(x, mean, std)


class DanceGrpoStep(FlowGrpoStep):
    """DanceGRPO's step: Flow-GRPO's with the constant coefficient ``std_t = a``."""

    name = "dance_grpo"

    def noise(self, sigmas: torch.Tensor, noise_level: float) -> torch.Tensor:
        return torch.full((len(sigmas) - 1,), float(noise_level))


class CpsStep:
    """The coefficients-preserving step of Flow-CPS (the module's formulas)."""

    name = "cps"

    def noise(self, sigmas: torch.Tensor, noise_level: float) -> torch.Tensor:
        """``std_t = s' sin(a pi / 2)``: 0 at the last step, whose ``s'`` is 0."""
        return (sigmas[1:].double() * math.sin(noise_level * math.pi / 2)).float()

    def mean(self, z: torch.Tensor, v: torch.Tensor, sigma: float, sigma_next: float, std_t: float) -> torch.Tensor:
        """``mean = (1 - s') x0 + sqrt(s'^2 - std_t^2) x1`` with ``x0 = z - s v``, ``x1 = z + (1 - s) v``."""
        z, v = z.float(), v.float()
        x0, x1 = z - sigma * v, z + (1 - sigma) * v
        return (1 - sigma_next) * x0 + math.sqrt(max(sigma_next ** 2 - std_t ** 2, 0.0)) * x1

    def std(self, sigma: float, sigma_next: float, std_t: float) -> float:
        return std_t

    def log_prob(self, x: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
        """``-mean_k (x_k - mean_k)^2``."""
        return -((x.float() - mean.float()) ** 2).flatten(1).mean(dim=1)


STEPS = {step.name: step for step in (FlowGrpoStep(), DanceGrpoStep(), CpsStep())}
