"""GRPO (Flow-GRPO) with the exact or the JAGG backward: the product's default algorithm (``train.algorithm: grpo``).

Rollout: the SDE sampler (:func:`~jagg_core.sampler.sde_rollout`) over the trained steps of
:mod:`jagg_core.placement`, optionally with a shared prefix or a tree. Loss: the per-step policy loss (PPO's clip,
GRPO-Guard's or DPPO's, ``grpo.policy_loss``) with its KL term (:func:`~jagg_core.grpo.step_loss`). Backward:
:func:`~jagg_core.jagg.run_backward` following one :class:`~jagg_core.jagg.BackwardPlan` per rollout batch; every
``backward.audit_every`` iterations the plan's fidelity audit (:mod:`jagg_core.audit`) is measured first, inside
:meth:`GrpoAlgorithm.plan`, and under ``backward.route_by: audit`` the plan is routed by it. ``grpo.inner_epochs``
optimizer steps per batch, the first on-policy.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from .. import metrics
from ..audit import audit_indices, run_audit
from ..config import BackwardConfig
from ..grpo import LossSettings
from ..jagg import BackwardPlan, BackwardResult, Window, make_plan, rescored, run_backward
from ..models.base import Conditioning
from ..placement import branch_splits, split_at, trained_spans, trained_steps
from ..sampler import Trajectory, initial_noise, sde_rollout
from .base import Algorithm, Rollout, Sampled, iteration_seed


@dataclass
class GrpoPlan:
    """The backward plan of one rollout batch and what its audit measured (empty when none was due)."""

    backward: BackwardPlan
    audited: dict = field(default_factory=dict)


class GrpoAlgorithm(Algorithm):
    name = "grpo"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.audited_cosines: dict[Window, float] = {}  # each window's cosine in its latest audit (route_by: audit)

    @property
    def optimizer_steps(self) -> int:
        return self.config.grpo.inner_epochs

    # ----- rollout ---------------------------------------------------------------------
    def trained_spans(self, iteration: int) -> list[range]:
        """The steps iteration ``iteration`` trains (``grpo.window_placement``), the same on every process, placed in
        the trained transformer's steps (:meth:`~jagg_core.models.base.FlowModel.trained_steps`: all, or a
        two-expert model's trained expert's) that add noise (:meth:`~jagg_core.config.RunConfig.trainable_steps`),
        cut where a two-expert model's experts switch (both trained: each window backpropagates through one)."""
        cfg, model = self.config, self.ctx.model
        steps = model.trained_steps(self.ctx.sigmas)
        steps = range(steps.start, min(steps.stop, cfg.trainable_steps()))
        spans = trained_spans(len(steps), cfg.grpo.timestep_fraction, cfg.grpo.window_placement,
                              cfg.grpo.trained_start, cfg.backward.window,
                              seed=iteration_seed(self.ctx.seed, iteration, 0, 2), iteration=iteration,
                              slide_every=cfg.grpo.slide_every, first=steps.start)
        return split_at(spans, model.expert_switch(self.ctx.sigmas))

    def sample(self, iteration: int, cond: Conditioning, generator: torch.Generator) -> Sampled:
        """SDE rollouts; a group shares its initial noise under a shared prefix or a tree."""
        cfg, model = self.config, self.ctx.model
        spans = self.trained_spans(iteration)
        group = cfg.grpo.num_generations
        count = next(iter(cond.values())).shape[0]
        shared = group if cfg.grpo.shared_prefix or cfg.grpo.branch_factor else 1  # samples per initial noise
        splits = branch_splits(trained_steps(spans), group, cfg.grpo.branch_factor) if cfg.grpo.branch_factor else None
        z0 = initial_noise(model, count // shared, cfg.sampling.size, generator)
        traj = sde_rollout(model, cond, self.ctx.sigmas, cfg.sampling.noise_level, z0.repeat_interleave(shared, dim=0),
                           generator, with_reference=cfg.grpo.kl_beta > 0 and cfg.grpo.kl_reference == "rollout",
                           sde_steps=trained_steps(spans) if cfg.grpo.ode_after_trained else None,
                           chunk_size=cfg.sampling.rollout_chunk, group_size=shared, splits=splits,
                           sde_type=cfg.sampling.sde_type)
        return Sampled(traj.latents[-1], traj, spans)

    # ----- backward plan, with the audit -------------------------------------------------
    def plan(self, rollout: Rollout, advantages: torch.Tensor, iteration: int) -> GrpoPlan:
        """The backward plan of the batch. When an audit is due (``backward.audit_every``) and the plan interpolates a
        step, the audit measures it first: under ``route_by: linearity`` the routed plan itself; under ``route_by:
        audit`` the plan with every window under JAGG (so a window routed exact is measured again), which is then
        routed by the fresh cosines, so this iteration already routes by them."""
        backward = self.config.backward
        every = backward.audit_every
        audit_due = every > 0 and iteration % every == 0
        by_audit = backward.route_by == "audit"
        unrouted = backward.model_copy(update={"frac": 1.0, "min_fidelity": None})
        plan = self.plan_backward(rollout.trajectory, rollout.spans, unrouted if audit_due and by_audit else backward)
        if not (audit_due and plan.interpolated):
            return GrpoPlan(plan)
        audited = self.audit(rollout, advantages, plan)
        if by_audit:
            plan = self._agreed(rescored(plan, backward, rollout.trajectory.sigmas, self._agree, self.audited_cosines))
        return GrpoPlan(plan, audited)

    def plan_backward(self, traj: Trajectory, spans: list[range], backward: BackwardConfig) -> BackwardPlan:
        """The backward plan of the trained steps ``spans`` of one rollout batch under ``backward``, with this run's
        loss settings; routed the same on every process when the transformer is sharded."""
        grpo = self.config.grpo
        loss = LossSettings(grpo.clip_range, grpo.kl_beta, kl_form=grpo.kl_form, policy_loss=grpo.policy_loss,
                            kl_mask_threshold=grpo.kl_mask_threshold)
        return self._agreed(make_plan(backward, traj, spans, loss, agree=self._agree, audited=self.audited_cosines))

    @property
    def _agree(self):
        return self.ctx.sharding.agree if self.ctx.sharding.enabled else None

    def _agreed(self, plan: BackwardPlan) -> BackwardPlan:
        if self.ctx.sharding.enabled:
            self.ctx.sharding.check_same_plan(plan)
        return plan

    def audit(self, rollout: Rollout, advantages: torch.Tensor, plan: BackwardPlan) -> dict:
        """The fidelity audit of ``plan`` on ``backward.audit_samples`` samples of the rollout (:mod:`jagg_core.audit`),
        on-policy, before the update and leaving it as it would be; its metrics and seconds. The cosine of each
        interpolated window is kept for routing (``audited_cosines``)."""
        began = time.perf_counter()
        samples = audit_indices(len(rollout.prompts), self.config.backward.audit_samples)
        fidelity = run_audit(self.ctx.params, plan,
                             lambda part: self.accumulate_gradients(rollout, advantages, part, True, samples),
                             self.ctx.device)
        self.audited_cosines.update({win: cosine for win, cosine, jagg in
                                     zip(plan.windows, fidelity.window_cosines, plan.use_jagg) if jagg})
        return {metrics.JAGG_GRAD_COSINE: fidelity.cosine, metrics.JAGG_GRAD_REL_ERR: fidelity.rel_err,
                metrics.JAGG_WINDOW_COSINES: fidelity.window_cosines, metrics.TIME_AUDIT: time.perf_counter() - began}

    def audit_cosine(self, rollout: Rollout, advantages: torch.Tensor, plan: GrpoPlan) -> float | None:
        """The plan's audit cosine; when no audit was due, one measured now that leaves the routing as it was."""
        if plan.audited:
            return plan.audited[metrics.JAGG_GRAD_COSINE]
        if not plan.backward.interpolated:
            return None
        routing = dict(self.audited_cosines)
        try:
            return self.audit(rollout, advantages, plan.backward)[metrics.JAGG_GRAD_COSINE]
        finally:
            self.audited_cosines = routing

    # ----- backward --------------------------------------------------------------------
    def accumulate_gradients(self, rollout: Rollout, advantages: torch.Tensor, plan: BackwardPlan, on_policy: bool,
                             samples: torch.Tensor | None = None) -> list[BackwardResult]:
        """Add the LoRA gradient of the whole rollout batch to ``.grad`` following ``plan``, one micro-batch at a
        time (``train.gradient_accumulation_steps`` of them); or only that of the batch's ``samples`` (indices), in
        micro-batches no larger than those."""
        n = advantages.shape[0]
        count = min(self.config.train.gradient_accumulation_steps, n)
        chunks = torch.arange(n).tensor_split(count) if samples is None else samples.split(math.ceil(n / count))
        traj, cond = rollout.trajectory, rollout.cond
        return [run_backward(self.ctx.model, plan, traj.select(index), {k: v[index] for k, v in cond.items()},
                             advantages[index], on_policy=on_policy, backward=self.ctx.backward,
                             autocast=self.ctx.autocast)
                for index in chunks]

    def backward(self, rollout: Rollout, advantages: torch.Tensor, plan: GrpoPlan, step: int) -> dict[str, float]:
        """Inner epoch ``step`` (the first on-policy): each micro-batch's loss is already weighted by its share of the
        batch, so the losses sum to the batch's; the other statistics are means over the micro-batches."""
        results = self.accumulate_gradients(rollout, advantages, plan.backward, on_policy=step == 0)
        count = len(results)
        return {metrics.LOSS: sum(r.loss for r in results), metrics.KL: sum(r.kl for r in results) / count,
                metrics.RATIO_MEAN: sum(r.ratio_mean for r in results) / count,
                metrics.RATIO_MAX_DEV: max(r.ratio_max_dev for r in results),
                metrics.CLIP_FRAC: sum(r.clip_frac for r in results) / count}

    def summarize(self, plan: GrpoPlan, steps: list[dict[str, float]]) -> dict:
        """The loss averaged over the inner epochs, the other statistics over every micro-batch; the plan's figures
        and the audit's."""
        backward = plan.backward
        return {metrics.LOSS: sum(s[metrics.LOSS] for s in steps) / len(steps),
                **{key: sum(s[key] for s in steps) / len(steps)
                   for key in (metrics.KL, metrics.RATIO_MEAN, metrics.CLIP_FRAC)},
                metrics.RATIO_MAX_DEV: steps[0][metrics.RATIO_MAX_DEV],
                metrics.JAGG_WINDOWS: len(backward.windows), metrics.JAGG_ROUTED_FRAC: backward.routed_frac,
                metrics.JAGG_LINEARITY_MEAN: backward.linearity_mean,
                metrics.BACKWARD_PASSES: len(backward.pass_steps), **plan.audited}

    # ----- state -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The audited window cosines that route windows."""
        return {"audited_cosines": [[win.start, win.end, cosine] for win, cosine in self.audited_cosines.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.audited_cosines = {Window(start, end): cosine for start, end, cosine in state.get("audited_cosines", [])}

