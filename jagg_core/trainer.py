"""The GRPO training loop: rollout -> rewards -> advantages -> backward (exact | JAGG) -> step, with the fidelity
audit of the JAGG backward (:mod:`jagg_core.audit`) before the step every ``backward.audit_every`` iterations.

Runs alone or under ``accelerate launch`` (data parallel: each process draws its own prompts, the
LoRA gradients are averaged across processes before every optimizer step, so all ranks keep
identical adapters). All randomness of iteration ``k`` on rank ``r`` comes from generators seeded
by ``(seed, k, r)`` (the trained steps of a random placement by ``(seed, k)``, the same on every rank), so a
resumed run repeats exactly what an uninterrupted one would have done.
"""

from __future__ import annotations

import math
import os
import random
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from contextlib import contextmanager, nullcontext

import torch
from accelerate import Accelerator
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from tqdm.auto import tqdm

from . import metrics
from .audit import audit_indices, run_audit
from .config import BackwardConfig, RunConfig
from .errors import UserError
from .grpo import LossSettings, group_advantages
from .hubclient import resolve_lora
from .images import captioned_grid, sample_pictures, still_frames, to_pil
from .jagg import BackwardPlan, BackwardResult, Window, make_plan, run_backward
from .models import load_flow_model
from .models.base import Conditioning, FlowModel
from .models.text_embeddings import load_embeddings, save_embeddings
from .placement import trained_spans, trained_steps
from .prompts import run_prompts
from .rewards import build_rewards
from .rundir import OPTIMIZER_FILE, TRAINING_STATE_FILE, RunDirectory
from .sampler import EVAL_BATCH, Trajectory, branch_splits, initial_noise, ode_sample, sde_rollout
from .sharding import Sharding, fsdp_requested
from .stopping import STOP, StopRequested
from .tracking import log_eval_grid, log_row, start_trackers


def iteration_seed(seed: int, iteration: int, rank: int, stream: int) -> int:
    return (seed * 1_000_003 + iteration * 9_176 + rank * 131 + stream) % (2 ** 63)


#: a run fails, instead of skipping updates for ever, after this many iterations in a row with a non-finite reward
MAX_NON_FINITE_STREAK = 5


def effective_interval(every: int, iterations: int) -> int:
    """``every`` (``train.sample_every`` / ``checkpoint_every``), unless the run is too short for two such
    intervals: then a quarter of the run, so a short run still gets intermediate samples and checkpoints."""
    return every if every <= iterations // 2 else max(1, iterations // 4)


def make_optimizer(name: str, params, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    try:
        import bitsandbytes as bnb
        optimizer = bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    except Exception as err:  # bitsandbytes raises many kinds without a usable GPU build
        raise UserError(f"train.optimizer=adamw8bit needs bitsandbytes with a supported GPU ({type(err).__name__}); "
                        "use train.optimizer=adamw") from None
    return optimizer


@dataclass
class Rollout:
    """One iteration's rollout batch on this process, samples prompt-major (``G`` per prompt)."""

    trajectory: Trajectory
    cond: Conditioning
    prompts: list[str]                       # the prompt of each sample
    images: torch.Tensor                     # [N, 3, H, W] in [0, 1] (a video model: [N, F, 3, H, W])
    spans: list[range]                       # the trained steps (jagg_core.placement)
    rewards: torch.Tensor                    # [N] combined reward
    reward_parts: dict[str, torch.Tensor]    # each reward term, [N]


class Trainer:
    def __init__(self, config: RunConfig, run_dir: str | Path, *, resume: bool = False):
        self.config = config
        self.run = RunDirectory(run_dir)
        self.accelerator = Accelerator(mixed_precision=config.train.mixed_precision, cpu=not torch.cuda.is_available(),
                                       log_with=config.train.report_to or None, project_dir=self.run.tracking_dir)
        self.is_main = self.accelerator.is_main_process
        self.rank = self.accelerator.process_index
        self.start_iteration = 1
        self.resume = resume
        self.non_finite_streak = 0  # iterations in a row whose reward had a NaN/inf (updates skipped)
        self.audited_cosines: dict[Window, float] = {}  # each window's cosine in its latest audit (route_by: audit)

    # ----- set-up ----------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.config
        if self.is_main:
            self.run.create()
        torch.manual_seed(cfg.train.seed)
        self.train_prompts, self.eval_prompts = run_prompts(cfg.prompts)
        self.model = self._load_model()
        if cfg.train.gradient_checkpointing:
            self.model.transformer.enable_gradient_checkpointing()
        self.params = self.model.add_lora(cfg.lora)
        if cfg.lora.init_lora:
            self.model.load_lora(resolve_lora(cfg.lora.init_lora))  # token: HF_TOKEN or `hf auth login`
        optimizer = make_optimizer(cfg.train.optimizer, self.params, cfg.train.learning_rate, cfg.train.weight_decay)
        self.sharding = Sharding(self.accelerator)  # FSDP2 of the frozen transformer under an FSDP accelerate config
        self.optimizer = self.sharding.prepare(self.model, optimizer)
        self.lr_scheduler = get_scheduler(cfg.train.lr_scheduler, self.optimizer,
                                          num_warmup_steps=cfg.train.lr_warmup_steps,
                                          num_training_steps=cfg.train.iterations * cfg.grpo.inner_epochs,
                                          num_cycles=cfg.train.lr_num_cycles)
        self.ema = EMAModel(self.params, decay=cfg.train.ema_decay) if cfg.train.ema_decay > 0 else None
        self.reward = build_rewards(cfg.rewards, self.accelerator.device, reward_frames=cfg.sampling.reward_frames)
        self.sigmas = self.model.sigmas(cfg.sampling.num_steps, cfg.sampling.resolution)
        self.eval_sigmas = self.model.sigmas(cfg.sampling.eval_num_steps or cfg.sampling.num_steps,
                                             cfg.sampling.resolution)
        if self.resume:
            self._load_checkpoint()
        if self.is_main:
            self.run.write_config(cfg.to_yaml())
            self.run.write_run_info(self.model.family, cfg.model.name, hardware=self._hardware())
        start_trackers(self.accelerator, cfg, self.run)

    def _load_model(self) -> FlowModel:
        """The base model. With ``model.cache_text_embeddings`` every training and eval prompt is encoded now (a
        resume reads them back from the run directory instead, without loading the encoders) and the text
        encoders are released before the transformer and VAE take the device."""
        cfg = self.config
        device = self.accelerator.device
        options = {"place_transformer": not fsdp_requested(),  # FSDP places each rank's shard itself
                   "num_frames": cfg.sampling.num_frames}
        if not cfg.model.cache_text_embeddings:
            return load_flow_model(cfg.model, device, seed=cfg.train.seed, **options)
        prompts = self.train_prompts + self.eval_prompts
        saved = load_embeddings(self.run.text_embeddings_file, prompts, cfg.model) if self.resume else None
        model = load_flow_model(cfg.model, device, seed=cfg.train.seed, text_encoders=saved is None, **options)
        if saved is not None:
            model.load_embeddings(saved)
            self._log(f"text embeddings of {len(saved)} prompts read from {self.run.text_embeddings_file.name}")
            return model
        model.encode_and_cache(prompts)
        if self.is_main:
            save_embeddings(self.run.text_embeddings_file, model.cached_embeddings, cfg.model)
        model.release_text_encoders()
        return model

    def _hardware(self) -> str:
        """What the run trains on, for the model card: the GPU's name, or the CPU's thread count."""
        device = self.accelerator.device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
        processes = self.accelerator.num_processes
        return f"{processes} x {name}" if processes > 1 else name

    def _load_checkpoint(self) -> None:
        """Continue from the newest checkpoint that loads; a damaged one (truncated, garbage) is skipped, saying so.
        Metrics rows after the checkpoint are dropped: those iterations run again."""
        initial = [param.detach().clone() for param in self.params]
        for done in reversed(self.run.checkpoint_iterations()):
            folder = self.run.checkpoint_dir(done)
            try:
                self.model.load_lora(folder)
                state = torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
                self.optimizer.load_state_dict(state)
                self._load_training_state(folder)
            except Exception as err:  # a damaged file can fail in safetensors, torch.load or load_state_dict
                self._log(f"checkpoint {folder.name} is damaged ({type(err).__name__}: {str(err)[:120]}); "
                          "trying the previous one")
                continue
            self.start_iteration = done + 1
            if self.is_main:
                self.run.truncate_metrics(done)
            self._log(f"resumed from {folder.name}")
            return
        with torch.no_grad():
            for param, value in zip(self.params, initial):
                param.copy_(value)
        if self.is_main:
            self.run.truncate_metrics(-1)  # nothing to continue: the base eval and every iteration run again
        self._log(f"no usable checkpoint in {self.run.path}; starting from iteration 1")

    def _training_state(self) -> dict:
        """What a checkpoint needs beyond the adapter file and the optimizer: the schedule, the EMA and the LoRA
        weights being trained (the adapter file holds the average when EMA is on), and the audited window cosines
        that route windows."""
        return {"lr_scheduler": self.lr_scheduler.state_dict(),
                "audited_cosines": [[win.start, win.end, cosine] for win, cosine in self.audited_cosines.items()],
                "ema": self.ema.state_dict() if self.ema is not None else None,
                "lora": [param.detach().cpu() for param in self.params]}

    def _load_training_state(self, folder: Path) -> None:
        """Restore :meth:`_training_state` (checkpoints written before it existed hold the weights alone)."""
        path = folder / TRAINING_STATE_FILE
        if not path.is_file():
            return
        state = torch.load(path, map_location="cpu", weights_only=False)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.audited_cosines = {Window(start, end): cosine for start, end, cosine in state.get("audited_cosines", [])}
        if self.ema is not None and state["ema"] is not None:
            self.ema.load_state_dict(state["ema"])
        with torch.no_grad():
            for param, value in zip(self.params, state["lora"]):
                param.copy_(value)

    @contextmanager
    def averaged_weights(self):
        """Inside, the LoRA holds its EMA (when ``train.ema_decay`` is on); the trained weights come back after."""
        if self.ema is None:
            with nullcontext():
                yield
            return
        self.ema.store(self.params)
        self.ema.copy_to(self.params)
        try:
            yield
        finally:
            self.ema.restore(self.params)

    # ----- logging ---------------------------------------------------------------------
    def _log(self, line: str) -> None:
        if self.is_main:
            tqdm.write(line)
            self.run.log(line)

    def _phase(self, phase: str, message: str) -> None:
        """Say what the run is doing (``status.json``'s ``phase`` and ``message``, the log) before a long step."""
        if self.is_main:
            self.run.write_status("running", phase=phase, message=message)
            self._log(message)

    # ----- one iteration -------------------------------------------------------------------
    def trained_spans(self, iteration: int) -> list[range]:
        """The steps iteration ``iteration`` trains (``grpo.window_placement``), the same on every process."""
        cfg = self.config
        return trained_spans(cfg.sampling.num_steps, cfg.grpo.timestep_fraction, cfg.grpo.window_placement,
                             cfg.grpo.trained_start, cfg.backward.window,
                             seed=iteration_seed(cfg.train.seed, iteration, 0, 2), iteration=iteration,
                             slide_every=cfg.grpo.slide_every)

    def rollout(self, iteration: int) -> Rollout:
        cfg = self.config
        spans = self.trained_spans(iteration)
        group = cfg.grpo.num_generations
        picker = random.Random(iteration_seed(cfg.train.seed, iteration, self.rank, 0))
        prompts = [picker.choice(self.train_prompts) for _ in range(cfg.grpo.prompts_per_iteration)]
        sample_prompts = [p for p in prompts for _ in range(group)]
        cond = self.model.conditioning(sample_prompts)
        generator = torch.Generator().manual_seed(iteration_seed(cfg.train.seed, iteration, self.rank, 1))
        shared = group if cfg.grpo.shared_prefix or cfg.grpo.branch_factor else 1  # samples per initial noise
        splits = branch_splits(trained_steps(spans), group, cfg.grpo.branch_factor) if cfg.grpo.branch_factor else None
        z0 = initial_noise(self.model, len(sample_prompts) // shared, cfg.sampling.resolution, generator)
        with self.accelerator.autocast():
            traj = sde_rollout(self.model, cond, self.sigmas, cfg.sampling.noise_level,
                               z0.repeat_interleave(shared, dim=0), generator,
                               with_reference=cfg.grpo.kl_beta > 0 and cfg.grpo.kl_reference == "rollout",
                               sde_steps=trained_steps(spans) if cfg.grpo.ode_after_trained else None,
                               chunk_size=cfg.sampling.rollout_batch_size, group_size=shared, splits=splits)
            with torch.no_grad():
                images = self.model.decode(traj.latents[-1])
        rewards, parts = self.reward(images, sample_prompts)
        return Rollout(traj, cond, sample_prompts, images, spans, rewards, parts)

    def advantages(self, rollout: Rollout) -> torch.Tensor:
        """The rollout's advantages (:func:`~jagg_core.grpo.group_advantages` under the ``grpo`` section), on the
        device."""
        grpo = self.config.grpo
        prompts = rollout.prompts if grpo.group_by == "prompt" else None
        return group_advantages(rollout.rewards, grpo.num_generations, grpo.adv_clip, prompts=prompts,
                                global_std=grpo.global_std).to(self.accelerator.device)

    def plan_backward(self, traj: Trajectory, spans: list[range], backward: BackwardConfig) -> BackwardPlan:
        """The backward plan of the trained steps ``spans`` of one rollout batch under ``backward``, with this run's
        loss settings."""
        grpo = self.config.grpo
        loss = LossSettings(grpo.clip_range, grpo.kl_beta, kl_form=grpo.kl_form)
        if not self.sharding.enabled:
            return make_plan(backward, traj, spans, loss, audited=self.audited_cosines)
        plan = make_plan(backward, traj, spans, loss, agree=self.sharding.agree,  # same routing everywhere
                         audited=self.audited_cosines)
        self.sharding.check_same_plan(plan)
        return plan

    def accumulate_gradients(self, traj: Trajectory, cond: Conditioning, advantages: torch.Tensor,
                             plan: BackwardPlan, on_policy: bool,
                             samples: torch.Tensor | None = None) -> list[BackwardResult]:
        """Add the LoRA gradient of the whole rollout batch to ``.grad`` following ``plan``, one micro-batch at a
        time (``train.gradient_accumulation_steps`` of them); or only that of the batch's ``samples`` (indices), in
        micro-batches no larger than those."""
        n = advantages.shape[0]
        count = min(self.config.train.gradient_accumulation_steps, n)
        chunks = torch.arange(n).tensor_split(count) if samples is None else samples.split(math.ceil(n / count))
        return [run_backward(self.model, plan, traj.select(index), {k: v[index] for k, v in cond.items()},
                             advantages[index], on_policy=on_policy, backward=self.accelerator.backward,
                             autocast=self.accelerator.autocast)
                for index in chunks]

    def train_on(self, rollout: Rollout, audit: bool = False) -> dict:
        """``grpo.inner_epochs`` optimizer steps on one rollout batch, all following one backward plan; the
        first is on-policy. ``audit``: the fidelity audit (:meth:`audit`) first, when the plan interpolates a step:
        of that plan, or under ``backward.route_by: audit`` of every window under JAGG (so a window routed exact is
        measured again), before routing, so this iteration already routes by it."""
        cfg = self.config
        advantages = self.advantages(rollout)
        audited = {}
        if audit and cfg.backward.route_by == "audit":
            unrouted = cfg.backward.model_copy(update={"frac": 1.0, "min_fidelity": None})
            candidate = self.plan_backward(rollout.trajectory, rollout.spans, unrouted)
            audited = self.audit(rollout, advantages, candidate) if candidate.interpolated else {}
        plan = self.plan_backward(rollout.trajectory, rollout.spans, cfg.backward)
        if audit and cfg.backward.route_by == "linearity" and plan.interpolated:
            audited = self.audit(rollout, advantages, plan)
        results, grad_norms, skipped = [], [], False
        for epoch in range(cfg.grpo.inner_epochs):
            results += self.accumulate_gradients(rollout.trajectory, rollout.cond, advantages, plan,
                                                 on_policy=epoch == 0)
            grad_norm, step_skipped = self._optimizer_step()
            grad_norms.append(grad_norm)
            skipped = skipped or step_skipped
        count = len(results)
        # each micro-batch's loss is already weighted by its share of the batch: sum them, average epochs
        return {metrics.LOSS: sum(r.loss for r in results) / cfg.grpo.inner_epochs,
                metrics.KL: sum(r.kl for r in results) / count,
                metrics.RATIO_MEAN: sum(r.ratio_mean for r in results) / count,
                metrics.CLIP_FRAC: sum(r.clip_frac for r in results) / count, metrics.GRAD_NORM: grad_norms[-1],
                metrics.SKIPPED: skipped, metrics.JAGG_WINDOWS: len(plan.windows),
                metrics.JAGG_ROUTED_FRAC: plan.routed_frac, metrics.JAGG_LINEARITY_MEAN: plan.linearity_mean,
                metrics.BACKWARD_PASSES: len(plan.pass_steps), **audited}

    def audit(self, rollout: Rollout, advantages: torch.Tensor, plan: BackwardPlan) -> dict:
        """The fidelity audit of ``plan`` on ``backward.audit_samples`` samples of the rollout (:mod:`jagg_core.audit`),
        on-policy, before the update and leaving it as it would be; its metrics and seconds. The cosine of each
        interpolated window is kept for routing (``audited_cosines``)."""
        began = time.perf_counter()
        samples = audit_indices(len(rollout.prompts), self.config.backward.audit_samples)

        def backward_of(part: BackwardPlan) -> None:
            self.accumulate_gradients(rollout.trajectory, rollout.cond, advantages, part, on_policy=True,
                                      samples=samples)

        fidelity = run_audit(self.params, plan, backward_of, self.accelerator.device)
        self.audited_cosines.update({win: cosine for win, cosine, jagg in
                                     zip(plan.windows, fidelity.window_cosines, plan.use_jagg) if jagg})
        return {metrics.JAGG_GRAD_COSINE: fidelity.cosine, metrics.JAGG_GRAD_REL_ERR: fidelity.rel_err,
                metrics.JAGG_WINDOW_COSINES: fidelity.window_cosines, metrics.TIME_AUDIT: time.perf_counter() - began}

    def _optimizer_step(self) -> tuple[float, bool]:
        """Average gradients over processes, clip, step; skip (and warn) if anything is non-finite."""
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            if self.accelerator.num_processes > 1:
                param.grad = self.accelerator.reduce(param.grad, reduction="mean")
        grad_norm = float(self.accelerator.clip_grad_norm_(self.params, self.config.train.max_grad_norm))
        skipped = not math.isfinite(grad_norm)
        if skipped:
            warnings.warn("non-finite gradient: this update is skipped and the adapter is unchanged", stacklevel=2)
        else:
            self.optimizer.step()
            if self.ema is not None:
                self.ema.step(self.params)
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # torch warns when the very first update was skipped; the order is meant
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()` before"))
            self.lr_scheduler.step()  # the schedule follows the steps taken or skipped, so it ends with the run
        return grad_norm, skipped

    def _adapters_identical_across_processes(self) -> bool:
        """Data-parallel sanity check: every process holds bit-identical LoRA weights."""
        local = torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().abs().sum()])
                             for p in self.params]).flatten()
        gathered = self.accelerator.gather(local[None].to(self.accelerator.device))
        identical = bool((gathered == gathered[0]).all())
        if not identical:
            warnings.warn("the processes' adapters differ; the data-parallel gradient sync is broken", stacklevel=2)
        return identical

    @torch.no_grad()
    def evaluate(self, iteration: int) -> dict:
        """Fixed-seed ODE samples of the held-out prompts, with the EMA weights when on; writes them (and their grid
        to the trackers) and returns their metrics: the mean reward, each reward term's, and the eval's seconds."""
        began = time.perf_counter()
        cfg = self.config
        generator = torch.Generator().manual_seed(cfg.train.eval_seed)
        z0 = initial_noise(self.model, len(self.eval_prompts), cfg.sampling.resolution, generator)
        images, chunk = [], cfg.sampling.rollout_batch_size or EVAL_BATCH
        with self.accelerator.autocast(), self.averaged_weights():
            for first in range(0, len(self.eval_prompts), chunk):
                part = slice(first, first + chunk)
                z = ode_sample(self.model, self.model.conditioning(self.eval_prompts[part]), self.eval_sigmas, z0[part])
                images.append(self.model.decode(z))
                if iteration == 0:
                    done = min(first + chunk, len(self.eval_prompts))
                    self._phase("base eval", f"sampling the base model: base eval {done}/{len(self.eval_prompts)}")
        images = torch.cat(images)
        if not self.is_main:  # a sharded transformer samples on every process; rank 0 scores and writes
            return {}
        rewards, parts = self.reward(images, self.eval_prompts)
        what = "base model" if iteration == 0 else f"iteration {iteration}"
        sheet = captioned_grid(to_pil(still_frames(images)),
                               [f"{p} · {r:.2f}" for p, r in zip(self.eval_prompts, rewards.tolist())],
                               title=f"{what} · eval reward {float(rewards.mean()):.3f}")
        pictures, videos = sample_pictures(images)
        self.run.write_images(self.run.samples_dir(iteration), pictures, self.eval_prompts, grid=sheet, videos=videos,
                              fps=cfg.sampling.fps, rewards=rewards.tolist(), iteration=iteration)
        log_eval_grid(self.accelerator, sheet, iteration)
        return {metrics.EVAL_REWARD_MEAN: float(rewards.mean()),
                **{metrics.eval_reward_part(name): float(v.mean()) for name, v in parts.items()},
                metrics.TIME_EVAL: time.perf_counter() - began}

    def save_checkpoint(self, iteration: int) -> None:
        """The adapter (the EMA weights when on: the one to publish), the optimizer and the training state."""
        def contents(folder: Path) -> None:
            with self.averaged_weights():
                self.model.save_lora(folder)
            torch.save(self.optimizer.state_dict(), folder / OPTIMIZER_FILE)
            torch.save(self._training_state(), folder / TRAINING_STATE_FILE)
        checkpoint = self.run.write_checkpoint(iteration, contents, keep=self.config.train.keep_checkpoints)
        self.run.publish_lora(checkpoint)

    # ----- the loop ------------------------------------------------------------------------
    def fit(self) -> None:
        """Iterations ``start_iteration..N``. Each one's metrics row is appended before its checkpoint is written,
        and a resume drops the rows after its checkpoint, so every row is in metrics.jsonl exactly once whenever
        the process is killed. A stop signal during an iteration ends it, checkpoints it, then stops."""
        cfg = self.config
        total = cfg.train.iterations
        checkpoint_every = effective_interval(cfg.train.checkpoint_every, total)
        if self.is_main:
            self.run.write_status("running", pid=os.getpid(), iteration=self.start_iteration - 1, total_iterations=total,
                                  started_at=time.time())
        if self.start_iteration == 1:
            self._phase("base eval", f"sampling the base model: base eval 0/{len(self.eval_prompts)}")
        if self.sharding.enabled:
            self._log(self.sharding.describe_line())
            if self.start_iteration == 1 and not self.is_main:
                self.evaluate(0)  # every process takes part in a sharded transformer's forwards
        if self.start_iteration == 1 and self.is_main:
            base = {metrics.ITERATION: 0, **self.evaluate(0)}
            self.run.append_metrics(base)
            log_row(self.accelerator, base)
            self._log(f"iter 0/{total}  base eval reward {base[metrics.EVAL_REWARD_MEAN]:.4f}")
        self._phase("training", f"training iteration {self.start_iteration}/{total}")
        bar = tqdm(range(self.start_iteration, total + 1), initial=self.start_iteration - 1, total=total,
                   desc="GRPO", disable=not self.is_main, dynamic_ncols=True)
        for iteration in bar:
            with STOP.deferred():
                row = self.iteration(iteration)
                stopping = self._stop_requested_anywhere()
                if self.is_main:
                    self.run.append_metrics(row)
                    log_row(self.accelerator, row)
                    if iteration % checkpoint_every == 0 or iteration == total or stopping:
                        self.save_checkpoint(iteration)
                    self.run.write_status("running", iteration=iteration, phase="training",
                                          message=f"iteration {iteration}/{total} done")
                    bar.set_postfix(reward=f"{row[metrics.REWARD_MEAN]:.3f}")
                self.accelerator.wait_for_everyone()
            if stopping:
                raise StopRequested(stopping)
        identical = self._adapters_identical_across_processes()
        if self.is_main:
            self.run.write_status("finished", iteration=total, message=f"finished {total} iterations",
                                  processes=self.accelerator.num_processes, adapters_identical=identical,
                                  **({"sharding": self.sharding.record} if self.sharding.enabled else {}))
            self._log(f"finished: adapter at {self.run.lora_file}")

    def close(self) -> None:
        """Finish the experiment trackers (flushes their files)."""
        self.accelerator.end_training()

    def _stop_requested_anywhere(self) -> int:
        """The stop signal any process received during this iteration (0: none); every process takes the same
        decision, so their collectives stay matched."""
        local = torch.tensor([STOP.requested or 0], device=self.accelerator.device)
        return int(self.accelerator.gather(local).max())

    def eval_due(self, iteration: int) -> bool:
        """Whether iteration ``iteration`` ends with the held-out eval (``train.sample_every``, and the last)."""
        total = self.config.train.iterations
        return iteration % effective_interval(self.config.train.sample_every, total) == 0 or iteration == total

    def iteration(self, iteration: int, evaluate: bool | None = None) -> dict:
        """One GRPO iteration (rollout, update, and the eval when due, or as ``evaluate`` says); returns its metrics
        row. :meth:`fit` appends the row and writes the checkpoints."""
        cfg = self.config
        t0 = time.perf_counter()
        rollout = self.rollout(iteration)
        time_rollout = time.perf_counter() - t0
        if self.is_main:
            pictures, videos = sample_pictures(rollout.images)
            self.run.write_images(self.run.rollouts_dir, pictures, rollout.prompts, videos=videos,
                                  fps=cfg.sampling.fps, rewards=rollout.rewards.tolist(), iteration=iteration)
        all_rewards = self.accelerator.gather(rollout.rewards.to(self.accelerator.device)).cpu()
        learning_rate = self.lr_scheduler.get_last_lr()[0]  # the rate of this iteration's (first) update
        t1 = time.perf_counter()
        if torch.isfinite(all_rewards).all():
            every = cfg.backward.audit_every
            stats = self.train_on(rollout, audit=every > 0 and iteration % every == 0)
            self.non_finite_streak = 0
        else:
            self.non_finite_streak += 1
            if self.non_finite_streak >= MAX_NON_FINITE_STREAK:
                raise UserError(f"the reward was missing or non-finite in {self.non_finite_streak} iterations in a row "
                                f"(last at iteration {iteration}); check the reward (server) and resume")
            warnings.warn(f"iteration {iteration}: non-finite reward; this update is skipped", stacklevel=2)
            stats = {metrics.SKIPPED: True}
        time_train = time.perf_counter() - t1 - stats.get(metrics.TIME_AUDIT, 0.0)  # the update's; the audit's apart
        finite = all_rewards[torch.isfinite(all_rewards)]
        row = {metrics.ITERATION: iteration,
               metrics.REWARD_MEAN: float(finite.mean()) if finite.numel() else float("nan"),
               metrics.REWARD_STD: float(finite.std()) if finite.numel() > 1 else 0.0,
               **{metrics.reward_part(name): float(v.mean()) for name, v in rollout.reward_parts.items()},
               **stats, metrics.LEARNING_RATE: learning_rate,
               metrics.TIME_ROLLOUT: time_rollout, metrics.TIME_TRAIN: time_train}
        if self.eval_due(iteration) if evaluate is None else evaluate:
            if self.is_main:
                row.update(self.evaluate(iteration))
            elif self.sharding.enabled:
                self.evaluate(iteration)  # every process takes part in a sharded transformer's forwards
        eval_part = f"  eval {row[metrics.EVAL_REWARD_MEAN]:.4f} ({row[metrics.TIME_EVAL]:.1f}s)" \
            if metrics.EVAL_REWARD_MEAN in row else ""
        self._log(f"iter {iteration}/{cfg.train.iterations}  reward {row[metrics.REWARD_MEAN]:.4f} "
                  f"± {row[metrics.REWARD_STD]:.3f}  loss {row.get(metrics.LOSS, float('nan')):+.3e}{eval_part}"
                  f"  rollout {time_rollout:.1f}s  train {time_train:.1f}s")
        return row
