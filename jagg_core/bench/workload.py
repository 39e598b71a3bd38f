"""One rollout batch of a model and its backward under each variant, timed."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ..audit import flat_gradient
from ..jagg import BackwardPlan
from ..trainer import Trainer
from .variants import EXACT, Variant, bench_config


class Workload:
    """A model with its LoRA (through :meth:`Trainer.setup`) and one rollout batch (:meth:`Trainer.rollout`),
    under the config of :func:`bench_config` with ``overrides``."""

    def __init__(self, model: str, run_dir: str | Path, overrides: tuple[str, ...] = ()):
        self.model_name, self.overrides = model, tuple(overrides)
        self.trainer = Trainer(bench_config(model, self.overrides), run_dir)
        self.trainer.setup()
        self.device = self.trainer.accelerator.device
        self.batch = self.trainer.rollout(1)
        self.traj, self.cond, self.spans = self.batch.trajectory, self.batch.cond, self.batch.spans
        self.advantages = self.trainer.advantages(self.batch)
        self.params_m = base_params_m(self.trainer)

    def rollout(self) -> float:
        """Seconds of one more rollout of the batch (iteration 1's prompts and noise again: sampling, decoding
        and rewards, as the trainer's ``time/rollout_s``); the workload keeps its first rollout."""
        start = time.perf_counter()
        self.trainer.rollout(1)
        synchronize(self.device)
        return time.perf_counter() - start

    def backward(self, variant: Variant) -> BackwardPlan:
        """The train phase under ``variant``: the LoRA gradient of the whole batch into ``.grad``
        (:meth:`GrpoAlgorithm.accumulate_gradients`, as in training before the optimizer step)."""
        for param in self.trainer.params:
            param.grad = None
        grpo = self.trainer.algorithm
        plan = grpo.plan_backward(self.traj, self.spans, variant.backward_config())
        grpo.accumulate_gradients(self.batch, self.advantages, plan, on_policy=True)
        synchronize(self.device)
        return plan

    def gradient(self) -> torch.Tensor:
        """All LoRA gradients, flattened (zeros where a parameter got none)."""
        return flat_gradient(self.trainer.params).double().cpu()


def base_params_m(trainer: Trainer) -> float:
    """Millions of parameters of the transformer, LoRA excluded."""
    lora = {id(p) for p in trainer.params}
    return round(sum(p.numel() for p in trainer.model.transformer.parameters() if id(p) not in lora) / 1e6, 3)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variants(work: Workload, variants: list[Variant], repeats: int, warmup: int):
    """Seconds of every repeat, the gradient and the plan of each variant, and the seconds of a rollout in every
    repeat. Warm-up: ``warmup`` exact backwards; then each repeat runs a rollout and every variant once, in order."""
    for _ in range(warmup):
        work.backward(EXACT)
    seconds = {v: [] for v in variants}
    gradients, plans, rollouts = {}, {}, []
    for repeat in range(repeats):
        rollouts.append(work.rollout())
        for variant in variants:
            start = time.perf_counter()
            plan = work.backward(variant)
            seconds[variant].append(time.perf_counter() - start)
            if repeat == 0:
                gradients[variant], plans[variant] = work.gradient(), plan
    return seconds, gradients, plans, rollouts
