"""The GRPO training loop: rollout -> rewards -> advantages -> backward (exact | JAGG) -> step.

Runs alone or under ``accelerate launch`` (data parallel: each process draws its own prompts, the
LoRA gradients are averaged across processes before every optimizer step, so all ranks keep
identical adapters). All randomness of iteration ``k`` on rank ``r`` comes from generators seeded
by ``(seed, k, r)``, so a resumed run repeats exactly what an uninterrupted one would have done.
"""

from __future__ import annotations

import math
import os
import random
import signal
import time
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator
from tqdm.auto import tqdm

from .config import BackwardConfig, RunConfig
from .errors import UserError
from .grpo import LossSettings, group_advantages
from .jagg import BackwardPlan, make_plan, run_backward
from .models import load_flow_model
from .prompts import load_prompts, split_prompts
from .rewards import build_rewards
from .rundir import LORA_FILE, RunDirectory
from .sampler import initial_noise, ode_sample, sde_rollout


class StopRequested(Exception):
    """SIGTERM/SIGINT: stop after leaving the run directory consistent."""


def iteration_seed(seed: int, iteration: int, rank: int, stream: int) -> int:
    return (seed * 1_000_003 + iteration * 9_176 + rank * 131 + stream) % (2 ** 63)


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


class Trainer:
    def __init__(self, config: RunConfig, run_dir: str | Path, *, resume: bool = False):
        self.config = config
        self.run = RunDirectory(run_dir)
        self.accelerator = Accelerator(mixed_precision=config.train.mixed_precision, cpu=not torch.cuda.is_available())
        self.is_main = self.accelerator.is_main_process
        self.rank = self.accelerator.process_index
        self.start_iteration = 1
        self.resume = resume

    # ----- set-up ----------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.config
        torch.manual_seed(cfg.train.seed)
        self.model = load_flow_model(cfg.model, self.accelerator.device, seed=cfg.train.seed)
        if cfg.train.gradient_checkpointing:
            self.model.transformer.enable_gradient_checkpointing()
        self.params = self.model.add_lora(cfg.lora)
        if cfg.lora.init_lora:
            from .hub import resolve_lora
            self.model.load_lora(resolve_lora(cfg.lora.init_lora))  # token: HF_TOKEN or `hf auth login`
        optimizer = make_optimizer(cfg.train.optimizer, self.params, cfg.train.learning_rate, cfg.train.weight_decay)
        self.optimizer = self.accelerator.prepare(optimizer)
        prompts = load_prompts(cfg.prompts.source)
        self.train_prompts, self.eval_prompts = split_prompts(prompts, cfg.prompts.eval_count, cfg.prompts.split_seed)
        self.reward = build_rewards(cfg.rewards, self.accelerator.device)
        self.sigmas = self.model.sigmas(cfg.sampling.num_steps, cfg.sampling.resolution)
        self.eval_sigmas = self.model.sigmas(cfg.sampling.eval_num_steps or cfg.sampling.num_steps,
                                             cfg.sampling.resolution)
        self.trained_steps = max(1, math.ceil(cfg.sampling.num_steps * cfg.grpo.timestep_fraction))
        if self.resume:
            self._load_checkpoint()
        if self.is_main:
            self.run.create()
            self.run.config_file.write_text(cfg.to_yaml())
            self.run.write_json("run_info.json", {"family": self.model.family, "base_model": cfg.model.name})

    def _load_checkpoint(self) -> None:
        checkpoint = self.run.latest_checkpoint()
        if checkpoint is None:
            self._log(f"no checkpoint in {self.run.path}; starting from iteration 1")
            return
        self.model.load_lora(checkpoint)
        state = torch.load(checkpoint / "optimizer.pt", map_location=self.accelerator.device, weights_only=True)
        self.optimizer.load_state_dict(state)
        done = int(checkpoint.name.removeprefix("iter_"))
        self.start_iteration = done + 1
        if self.is_main:
            self.run.truncate_metrics(done)
        self._log(f"resumed from {checkpoint.name}")

    # ----- logging ---------------------------------------------------------------------
    def _log(self, line: str) -> None:
        if self.is_main:
            tqdm.write(line)
            self.run.log(line)

    # ----- one iteration -------------------------------------------------------------------
    def rollout(self, iteration: int):
        cfg = self.config
        group = cfg.grpo.num_generations
        picker = random.Random(iteration_seed(cfg.train.seed, iteration, self.rank, 0))
        prompts = [picker.choice(self.train_prompts) for _ in range(cfg.grpo.prompts_per_iteration)]
        sample_prompts = [p for p in prompts for _ in range(group)]
        cond = self.model.conditioning(sample_prompts)
        generator = torch.Generator().manual_seed(iteration_seed(cfg.train.seed, iteration, self.rank, 1))
        z0 = initial_noise(self.model, len(sample_prompts), cfg.sampling.resolution, generator)
        with self.accelerator.autocast():
            traj = sde_rollout(self.model, cond, self.sigmas, cfg.sampling.noise_level, z0, generator,
                               with_reference=cfg.grpo.kl_beta > 0,
                               sde_steps=self.trained_steps if cfg.grpo.ode_after_trained else None)
            with torch.no_grad():
                images = self.model.decode(traj.latents[-1])
        rewards, parts = self.reward(images, sample_prompts)
        return traj, cond, sample_prompts, images, rewards, parts

    def accumulate_gradients(self, traj, cond, advantages: torch.Tensor, backward: BackwardConfig,
                             on_policy: bool) -> tuple[list, BackwardPlan]:
        """Add the LoRA gradient of the whole rollout batch to ``.grad``, one micro-batch at a time
        (``train.gradient_accumulation_steps`` of them); each micro-batch's loss is weighted by its share."""
        n = advantages.shape[0]
        chunks = torch.arange(n).tensor_split(min(self.config.train.gradient_accumulation_steps, n))
        results, plan = [], None
        for index in chunks:
            batch = traj.select(index)
            plan = make_plan(backward, batch, self.trained_steps)
            settings = LossSettings(self.config.grpo.clip_range, self.config.grpo.kl_beta,
                                    scale=len(index) / n / self.trained_steps)
            results.append(run_backward(
                self.model, batch, {k: v[index] for k, v in cond.items()}, advantages[index], plan, settings,
                backward, on_policy=on_policy, backward=self.accelerator.backward, autocast=self.accelerator.autocast))
        return results, plan

    def train_on(self, traj, cond, rewards) -> dict:
        """``grpo.inner_epochs`` optimizer steps on one rollout batch; the first is on-policy."""
        cfg = self.config
        advantages = group_advantages(rewards, cfg.grpo.num_generations, cfg.grpo.adv_clip).to(self.accelerator.device)
        results, grad_norms, skipped, plan = [], [], False, None
        for epoch in range(cfg.grpo.inner_epochs):
            epoch_results, plan = self.accumulate_gradients(traj, cond, advantages, cfg.backward, on_policy=epoch == 0)
            results += epoch_results
            grad_norm, step_skipped = self._optimizer_step()
            grad_norms.append(grad_norm)
            skipped = skipped or step_skipped
        count = len(results)
        # each micro-batch's loss is already weighted by its share of the batch: sum them, average epochs
        return {"loss": sum(r.loss for r in results) / cfg.grpo.inner_epochs,
                "kl": sum(r.kl for r in results) / count, "ratio_mean": sum(r.ratio_mean for r in results) / count,
                "clip_frac": sum(r.clip_frac for r in results) / count, "grad_norm": grad_norms[-1],
                "skipped": skipped, "jagg_windows": len(plan.windows), "jagg_routed_frac": plan.routed_frac,
                "jagg_linearity_mean": plan.linearity_mean, "backward_passes": len(plan.pass_steps)}

    def _optimizer_step(self) -> tuple[float, bool]:
        """Average gradients over processes, clip, step; skip (and warn) if anything is non-finite."""
        for param in self.params:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            if self.accelerator.num_processes > 1:
                param.grad = self.accelerator.reduce(param.grad, reduction="mean")
        grad_norm = float(self.accelerator.clip_grad_norm_(self.params, self.config.train.max_grad_norm))
        if not math.isfinite(grad_norm):
            warnings.warn("non-finite gradient: this update is skipped and the adapter is unchanged", stacklevel=2)
            self.optimizer.zero_grad(set_to_none=True)
            return grad_norm, True
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, False

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
    def evaluate(self, iteration: int) -> float:
        """Fixed-seed ODE samples of the held-out prompts; writes them and returns their mean reward."""
        cfg = self.config
        generator = torch.Generator().manual_seed(cfg.train.eval_seed)
        z0 = initial_noise(self.model, len(self.eval_prompts), cfg.sampling.resolution, generator)
        images = []
        with self.accelerator.autocast():
            for start in range(0, len(self.eval_prompts), 16):
                part = slice(start, start + 16)
                z = ode_sample(self.model, self.model.conditioning(self.eval_prompts[part]), self.eval_sigmas, z0[part])
                images.append(self.model.decode(z))
        images = torch.cat(images)
        rewards, _ = self.reward(images, self.eval_prompts)
        self.run.write_images(self.run.samples_dir(iteration), images, self.eval_prompts,
                              rewards=rewards.tolist(), iteration=iteration)
        return float(rewards.mean())

    def save_checkpoint(self, iteration: int) -> None:
        def contents(folder: Path) -> None:
            self.model.save_lora(folder)
            torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")
        checkpoint = self.run.write_checkpoint(iteration, contents, keep=self.config.train.keep_checkpoints)
        self.run.publish_lora(checkpoint)

    # ----- the loop ------------------------------------------------------------------------
    def fit(self) -> None:
        cfg = self.config
        total = cfg.train.iterations
        if self.is_main:
            self.run.write_status("running", pid=os.getpid(), iteration=self.start_iteration - 1, total_iterations=total,
                                  message="loading", started_at=time.time())
        if self.start_iteration == 1 and self.is_main:
            base_reward = self.evaluate(0)
            self.run.append_metrics({"iteration": 0, "eval_reward_mean": base_reward})
            self._log(f"iter 0/{total}  base eval reward {base_reward:.4f}")
        bar = tqdm(range(self.start_iteration, total + 1), initial=self.start_iteration - 1, total=total,
                   desc="GRPO", disable=not self.is_main, dynamic_ncols=True)
        for iteration in bar:
            row = self.iteration(iteration)
            if self.is_main:
                self.run.append_metrics(row)
                self.run.write_status("running", iteration=iteration, message=f"iteration {iteration}/{total}")
                bar.set_postfix(reward=f"{row['reward_mean']:.3f}")
        identical = self._adapters_identical_across_processes()
        if self.is_main:
            self.run.write_status("finished", iteration=total, message=f"finished {total} iterations",
                                  processes=self.accelerator.num_processes, adapters_identical=identical)
            self._log(f"finished: adapter at {self.run.lora_dir / LORA_FILE}")

    def iteration(self, iteration: int) -> dict:
        cfg = self.config
        t0 = time.perf_counter()
        traj, cond, prompts, images, rewards, parts = self.rollout(iteration)
        time_rollout = time.perf_counter() - t0
        if self.is_main:
            self.run.write_images(self.run.path / "rollouts" / "latest", images, prompts,
                                  rewards=rewards.tolist(), iteration=iteration)
        all_rewards = self.accelerator.gather(rewards.to(self.accelerator.device)).cpu()
        t1 = time.perf_counter()
        if torch.isfinite(all_rewards).all():
            stats = self.train_on(traj, cond, rewards)
        else:
            warnings.warn(f"iteration {iteration}: non-finite reward; this update is skipped", stacklevel=2)
            stats = {"skipped": True}
        time_train = time.perf_counter() - t1
        finite = all_rewards[torch.isfinite(all_rewards)]
        row = {"iteration": iteration, "reward_mean": float(finite.mean()) if finite.numel() else float("nan"),
               "reward_std": float(finite.std()) if finite.numel() > 1 else 0.0,
               **{f"reward_{name}": float(v.mean()) for name, v in parts.items()},
               **stats, "lr": self.optimizer.param_groups[0]["lr"],
               "time_rollout_s": time_rollout, "time_train_s": time_train}
        if iteration % cfg.train.sample_every == 0 or iteration == cfg.train.iterations:
            if self.is_main:
                row["eval_reward_mean"] = self.evaluate(iteration)
        if iteration % cfg.train.checkpoint_every == 0 or iteration == cfg.train.iterations:
            if self.is_main:
                self.save_checkpoint(iteration)
        self.accelerator.wait_for_everyone()
        eval_part = f"  eval {row['eval_reward_mean']:.4f}" if "eval_reward_mean" in row else ""
        self._log(f"iter {iteration}/{cfg.train.iterations}  reward {row['reward_mean']:.4f} ± {row['reward_std']:.3f}"
                  f"  loss {row.get('loss', float('nan')):+.5f}{eval_part}"
                  f"  rollout {time_rollout:.1f}s  train {time_train:.1f}s")
        return row


def install_stop_handlers() -> None:
    """SIGTERM/SIGINT raise :class:`StopRequested` in the main thread."""
    def handler(signum, frame):
        raise StopRequested(signal.Signals(signum).name)
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
