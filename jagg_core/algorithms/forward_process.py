"""What the forward-process algorithms (DiffusionNFT, AWM) share: ODE rollouts, and a loss on the rollout's clean
samples re-noised at the schedule's discrete sigmas.

No log-probabilities, no SDE trajectory and no per-step backward of the sampling chain: a rollout is Euler ODE
sampling (:func:`~jagg_core.sampler.ode_sample`) of ``x0``, and the loss is computed on *rows* ``(b, k, eps)``: the
sample ``b``'s clean latent noised to the schedule's sigma of step ``k`` with fresh noise (DESIGN.md's convention)::

    x_t = (1 - sigma_k) x0_b + sigma_k eps,      target velocity eps - x0_b,      timestep = 1000 sigma_k

Each sample gets the same number of rows (the algorithm's :meth:`ForwardProcessAlgorithm.draw_steps`), cut in
order into the iteration's optimizer steps (:attr:`~.base.Algorithm.optimizer_steps`: each step trains every sample
at its part of its steps); a step's loss is the mean over its rows, so the rows are split into
``train.gradient_accumulation_steps`` micro-batches, each backpropagated with its share ``R_micro / R`` of that mean:
the same gradient at any split.
Each micro-batch is one forward with grad over its rows, plus the no-grad forwards of the algorithm's companion
policies (the base model, a lagging copy of the LoRA) at the same rows. The draws (steps and noise) come from a
generator seeded by (``train.seed``, iteration, process), so a resumed run draws them again the same.
"""

from __future__ import annotations

from abc import abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from .. import metrics
from ..config import RunConfig
from ..models.base import Conditioning
from ..sampler import initial_noise, ode_sample
from .base import Algorithm, LaggingPolicy, Rollout, Sampled, iteration_seed

#: the random stream of the forward-process loss's draws (steps and noise) in :func:`~.base.iteration_seed`
ROWS_STREAM = 3


@dataclass
class Rows:
    """The rows one rollout batch is trained on, sample-major."""

    samples: torch.Tensor    # [R] the sample b of each row
    steps: torch.Tensor      # [R] the schedule step k of each row
    updates: torch.Tensor    # [R] the optimizer step of the iteration that trains the row
    sigmas: torch.Tensor     # [R] sigma_k, float32
    noise: torch.Tensor      # [R, *latent] eps, float32


@dataclass
class RowBatch:
    """One micro-batch of rows with everything its loss needs (float32, on the model's device)."""

    x0: torch.Tensor         # clean latents [R', *latent]
    noise: torch.Tensor      # eps
    x_t: torch.Tensor        # (1 - sigma) x0 + sigma eps
    sigmas: torch.Tensor     # [R']
    advantages: torch.Tensor  # [R'] the group advantage of each row's sample


def per_row_mean(x: torch.Tensor) -> torch.Tensor:
    """The mean over every dimension but the first (a row's latent elements)."""
    return x.mean(dim=tuple(range(1, x.dim())))


def broadcast_rows(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` [R] shaped to broadcast against ``like`` [R, ...]."""
    return values.view(-1, *([1] * (like.dim() - 1)))


class ForwardProcessAlgorithm(Algorithm):
    """ODE rollouts and a loss on re-noised rows; a subclass gives its lagging policy, the rollout's policy, the rows'
    steps, the companion velocities and the loss."""

    state_key: ClassVar[str]  # the checkpoint's key of the lagging policy's weights

    def __init__(self, ctx):
        super().__init__(ctx)
        #: every process draws the same steps for its rows (its noise stays its own): two sharded experts
        #: (``model.expert: both`` under FSDP) are then called alike on every process, each call a collective; steps
        #: drawn apart would call one expert on one process where another calls the other
        self.steps_alike = ctx.sharding.enabled and len(ctx.model.trained_transformers) > 1
        self.lag = self.lagging_policy()

    @abstractmethod
    def lagging_policy(self) -> LaggingPolicy:
        """The copy of the LoRA that trails the trained weights (updated after every iteration, checkpointed)."""

    def sampling_policy(self) -> AbstractContextManager:
        """The weights the rollout samples with (the trained ones unless overridden)."""
        return nullcontext()

    @staticmethod
    @abstractmethod
    def steps_per_sample(config: RunConfig) -> int:
        """K: the rows (schedule steps) each sample is trained at."""

    @staticmethod
    def updates_per_rollout(config: RunConfig) -> int:
        """m: the optimizer steps of an iteration, each on its part of every sample's K rows."""
        return 1

    @classmethod
    def steps_per_update(cls, config: RunConfig) -> int:
        """The most rows of one sample that one optimizer step trains: ``ceil(K / m)``."""
        return -(-cls.steps_per_sample(config) // cls.updates_per_rollout(config))

    @property
    def optimizer_steps(self) -> int:
        return self.updates_per_rollout(self.config)

    @abstractmethod
    def draw_steps(self, samples: int, generator: torch.Generator) -> torch.Tensor:
        """[samples, K] schedule steps (indices into the rollout schedule) each sample is trained at."""

    @staticmethod
    @abstractmethod
    def companion_names(config: RunConfig) -> list[str]:
        """The no-grad companion velocities each row's loss needs (the keys of :meth:`companions`)."""

    @abstractmethod
    def policy(self, companion: str) -> Callable[[], AbstractContextManager]:
        """The context under which the model gives the velocity of ``companion`` (one of :meth:`companion_names`)."""

    @abstractmethod
    def loss(self, v: torch.Tensor, others: dict[str, torch.Tensor], rows: RowBatch) -> tuple[torch.Tensor, dict]:
        """The mean loss over ``rows`` (a scalar with grad through ``v``) and its detached statistics (metric key ->
        mean over the rows)."""

    # ----- the stages ------------------------------------------------------------------
    def sample(self, iteration: int, cond: Conditioning, generator: torch.Generator) -> Sampled:
        """Euler ODE samples from independent noise, under :meth:`sampling_policy`."""
        cfg, model = self.config, self.ctx.model
        count = next(iter(cond.values())).shape[0]
        z0 = initial_noise(model, count, cfg.sampling.size, generator)
        with self.sampling_policy():
            latents = ode_sample(model, cond, self.ctx.sigmas, z0, chunk_size=cfg.sampling.rollout_chunk)
        return Sampled(latents)

    def plan(self, rollout: Rollout, advantages: torch.Tensor, iteration: int) -> Rows:
        """Every sample's steps and noise, drawn once per iteration from the process's seed (the steps from the first
        process's where they are drawn alike, :attr:`steps_alike`)."""
        generator = torch.Generator().manual_seed(iteration_seed(self.ctx.seed, iteration, self.ctx.rank, ROWS_STREAM))
        latents = rollout.sampled.latents
        steps = self.draw_steps(latents.shape[0], torch.Generator().manual_seed(
            iteration_seed(self.ctx.seed, iteration, 0, ROWS_STREAM)) if self.steps_alike else generator)
        per_sample = steps.shape[1]
        samples = torch.arange(latents.shape[0]).repeat_interleave(per_sample)
        update_of_column = torch.cat([torch.full((len(part),), update) for update, part in
                                      enumerate(torch.arange(per_sample).tensor_split(self.optimizer_steps))])
        updates = update_of_column.repeat(latents.shape[0])
        steps = steps.flatten()
        noise = torch.randn((len(steps), *latents.shape[1:]), generator=generator, dtype=torch.float32)
        return Rows(samples, steps, updates, self.ctx.sigmas[steps].float(), noise)

    def backward(self, rollout: Rollout, advantages: torch.Tensor, plan: Rows, step: int) -> dict[str, float]:
        """The loss's gradient on the rows of optimizer step ``step``, one micro-batch of rows at a time, each weighted
        by its share of the step's rows."""
        model, device = self.ctx.model, self.ctx.device
        step_rows = torch.nonzero(plan.updates == step).flatten()
        total = len(step_rows)
        count = min(self.config.train.gradient_accumulation_steps, total)
        sums: dict[str, float] = {}
        for index in step_rows.tensor_split(count):
            samples = plan.samples[index]
            x0 = rollout.sampled.latents[samples.to(rollout.sampled.latents.device)].float().to(device)
            noise, sigmas = plan.noise[index].to(device), plan.sigmas[index].to(device)
            t = broadcast_rows(sigmas, x0)
            rows = RowBatch(x0, noise, (1 - t) * x0 + t * noise, sigmas, advantages[samples.to(advantages.device)])
            cond = {key: value[samples.to(value.device)] for key, value in rollout.cond.items()}
            others = {}
            for name in self.companion_names(self.config):
                with torch.no_grad(), self.policy(name)(), self.ctx.autocast():
                    others[name] = model.velocity(rows.x_t, sigmas, cond).float()
            with self.ctx.autocast():
                v = model.velocity(rows.x_t, sigmas, cond).float()
            loss, stats = self.loss(v, others, rows)
            share = len(index) / total
            self.ctx.backward(loss * share)
            for key, value in {metrics.LOSS: float(loss.detach()), **stats}.items():
                sums[key] = sums.get(key, 0.0) + share * float(value)
        return sums

    def after_update(self, iteration: int) -> None:
        """The lagging policy's update after the iteration's optimizer steps, its decay by the steps so far."""
        self.lag.update(iteration * self.optimizer_steps)

    def state_dict(self) -> dict:
        return {self.state_key: self.lag.state()}

    def load_state_dict(self, state: dict) -> None:
        if self.state_key in state:
            self.lag.load(state[self.state_key])

    def summarize(self, plan: Rows, steps: list[dict[str, float]]) -> dict:
        """Each statistic's mean over the iteration's optimizer steps."""
        return {key: sum(s[key] for s in steps) / len(steps) for key in steps[0]}
