"""The seam between the trainer and a training algorithm: what an algorithm is given, what it must answer.

The trainer's iteration is the same list of stages for every algorithm (:meth:`jagg_core.trainer.Trainer.iteration`)::

    sampled    = algorithm.sample(iteration, cond, generator)      the rollout's latents (and what the loss needs)
    rewards    -> advantages                                      the trainer's, the same for every algorithm
    plan       = algorithm.plan(rollout, advantages, iteration)    what every optimizer step of the batch follows
    for step in range(algorithm.optimizer_steps):
        algorithm.backward(rollout, advantages, plan, step)        adds dL/dtheta to the LoRA's .grad
        trainer: optimizer step                                    averaged over processes, clipped, stepped
    algorithm.after_update(iteration)                              per-iteration state (a lagging policy)

An algorithm owns its state beyond the LoRA and the optimizer (:meth:`Algorithm.state_dict`, checkpointed, so a
resume is exact) and never calls back into the trainer: what it needs is in :class:`TrainingContext`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from ..config import RunConfig
from ..models.base import Conditioning, FlowModel
from ..sampler import Trajectory
from ..sharding import Sharding


def iteration_seed(seed: int, iteration: int, rank: int, stream: int) -> int:
    """The seed of random stream ``stream`` of iteration ``iteration`` on process ``rank`` (0: the prompts, 1: the
    rollout's noise, 2: the trained steps (rank 0: the same on every process), 3: a forward-process loss's draws)."""
    return (seed * 1_000_003 + iteration * 9_176 + rank * 131 + stream) % (2 ** 63)


@dataclass
class TrainingContext:
    """What an algorithm works with: the model and its trained LoRA parameters, the rollout schedule, and the
    accelerate hooks (``backward`` for a scalar's backward, ``autocast`` for forwards)."""

    config: RunConfig
    model: FlowModel
    params: list[torch.nn.Parameter]
    sigmas: torch.Tensor                      # the rollout schedule, sigma_0 = 1 .. sigma_T = 0
    device: torch.device
    backward: Callable[[torch.Tensor], None]
    autocast: Callable
    seed: int                                 # train.seed
    rank: int                                 # this process's index
    sharding: Sharding                        # the transformer's FSDP sharding (enabled or not)


@dataclass
class Sampled:
    """An algorithm's rollout of one batch: the clean latents, and for GRPO the SDE trajectory and trained steps."""

    latents: torch.Tensor                     # [N, *latent]: the final (clean) latents, decoded into the images
    trajectory: Trajectory | None = None
    spans: list[range] = field(default_factory=list)


@dataclass
class Rollout:
    """One iteration's rollout batch on this process, samples prompt-major (``G`` per prompt)."""

    sampled: Sampled
    cond: Conditioning
    prompts: list[str]                       # the prompt of each sample
    images: torch.Tensor                     # [N, 3, H, W] in [0, 1] (a video model: [N, F, 3, H, W])
    rewards: torch.Tensor                    # [N] combined reward
    reward_parts: dict[str, torch.Tensor]    # each reward term, [N]

    @property
    def trajectory(self) -> Trajectory | None:
        return self.sampled.trajectory

    @property
    def spans(self) -> list[range]:
        return self.sampled.spans


class Algorithm(ABC):
    """One training algorithm (``train.algorithm``) behind the trainer's stages (the module's list)."""

    name: ClassVar[str]

    def __init__(self, ctx: TrainingContext):
        self.ctx = ctx
        self.config = ctx.config

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per rollout batch."""
        return 1

    @abstractmethod
    def sample(self, iteration: int, cond: Conditioning, generator: torch.Generator) -> Sampled:
        """The rollout of the samples whose conditioning is ``cond``, all noise drawn from ``generator``."""

    @abstractmethod
    def plan(self, rollout: Rollout, advantages: torch.Tensor, iteration: int) -> Any:
        """What every optimizer step on this rollout batch follows (drawn once, so a resume repeats it)."""

    @abstractmethod
    def backward(self, rollout: Rollout, advantages: torch.Tensor, plan: Any, step: int) -> dict[str, float]:
        """Add the LoRA gradient of optimizer step ``step`` to ``.grad``; its statistics (metric key -> value)."""

    @abstractmethod
    def summarize(self, plan: Any, steps: list[dict[str, float]]) -> dict:
        """The metrics row's part of this algorithm: the loss and its terms over the steps, and the plan's."""

    def after_update(self, iteration: int) -> None:
        """Called after the optimizer steps of iteration ``iteration``."""

    def audit_cosine(self, rollout: Rollout, advantages: torch.Tensor, plan: Any) -> float | None:
        """Before the update: the cosine of this algorithm's gradient with the exact one on this rollout, for the
        first iteration's doctor (:mod:`jagg_core.doctor`); None when the gradient is exact."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` from a checkpoint's training state (absent keys: a checkpoint before it)."""


class LaggingPolicy:
    """A copy of the LoRA weights that trails the trained ones (DiffusionNFT's sampling policy, AWM's EMA
    regularizer): it starts equal to them and after iteration ``k`` becomes ``lag = d lag + (1 - d) theta`` with
    ``d = min(d_max, rate * max(0, k - delay))`` (the reference codes' decay schedules, ``k`` their optimizer steps).
    ``swapped_in`` puts it into the model for a forward; the trained weights come back."""

    def __init__(self, params: list[torch.nn.Parameter], rate: float, maximum: float, delay: int = 0):
        self.params = params
        self.rate, self.maximum, self.delay = rate, maximum, delay
        self.weights = [p.detach().clone() for p in params]

    def decay(self, step: int) -> float:
        return min(self.maximum, self.rate * max(0, step - self.delay))

    @torch.no_grad()
    def update(self, step: int) -> None:
        d = self.decay(step)
        for lag, param in zip(self.weights, self.params):
            lag.mul_(d).add_(param.detach(), alpha=1 - d)

    @contextmanager
    def swapped_in(self):
        with torch.no_grad():
            trained = [p.detach().clone() for p in self.params]
            for param, lag in zip(self.params, self.weights):
                param.copy_(lag)
        try:
            yield
        finally:
            with torch.no_grad():
                for param, value in zip(self.params, trained):
                    param.copy_(value)

    def state(self) -> list[torch.Tensor]:
        return [w.cpu() for w in self.weights]

    @torch.no_grad()
    def load(self, weights: list[torch.Tensor]) -> None:
        for lag, value in zip(self.weights, weights):
            lag.copy_(value)
