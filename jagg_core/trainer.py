"""The training loop: rollout -> rewards -> advantages -> backward plan -> backward and optimizer step -> eval ->
checkpoint, the same stages for every algorithm (``train.algorithm``: GRPO with the exact or the JAGG backward,
DiffusionNFT, AWM; :mod:`jagg_core.algorithms`), which owns the sampler, the plan, the loss and its own state.

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
from pathlib import Path

from contextlib import contextmanager, nullcontext

import torch
from accelerate import Accelerator
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from tqdm.auto import tqdm

from . import metrics
from .algorithms import make_algorithm
from .algorithms.base import Rollout, TrainingContext, iteration_seed
from .config import RunConfig, term_names
from .doctor import (Probe, audit_check, checklist, gradient_check, range_check, ratio_check, report_lines,
                     reward_balance_check, rewards_check, text_window_check)
from .errors import UserError
from .grpo import group_advantages, group_spread, reward_advantages
from .host import cpu_name
from .hubclient import resolve_lora
from .images import captioned_grid, sample_pictures, still_frames, to_pil
from .judges import (BestAdapter, EvalScores, HackingAlarm, build_judges, check_judges_room, cpu_judges,
                     load_judges)
from .models import load_flow_model
from .models.base import FlowModel
from .models.text_embeddings import bytes_per_prompt, check_cache_room, load_embeddings, save_embeddings
from .models.text_windows import WindowReading, prompt_notes, read_windows, refuse_overlong, window_lines
from .prompts import run_prompts
from .rewards import CombinedReward, build_rewards
from .rewards.catalog import reward_entry
from .rng import forked_rng
from .rundir import OPTIMIZER_FILE, TRAINING_STATE_FILE, RunDirectory, adapter_filenames, adapter_files
from .sampler import initial_noise, ode_sample
from .sharding import Sharding, fsdp_requested
from .stopping import STOP, AlarmStop, StopRequested
from .tracking import log_eval_grid, log_row, start_trackers


#: a run fails, instead of skipping updates for ever, after this many iterations in a row with a non-finite reward
MAX_NON_FINITE_STREAK = 5
#: seconds between two progress messages of the prompts' encoding at set-up
SAY_EVERY_S = 1.0


def effective_interval(every: int, iterations: int) -> int:
    """``every`` (``train.sample_every`` / ``checkpoint_every``), unless the run is too short for two such
    intervals: then a quarter of the run, so a short run still gets intermediate samples and checkpoints."""
    return every if every <= iterations // 2 else max(1, iterations // 4)


def group_prompts(config: RunConfig, rollout: Rollout) -> list[str] | None:
    """The prompts that make the rollout's groups (``grpo.group_by: prompt``: a prompt drawn twice is one group), or
    None: each ``grpo.num_generations`` consecutive samples are one."""
    return rollout.prompts if config.grpo.group_by == "prompt" else None


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
    def __init__(self, config: RunConfig, run_dir: str | Path, *, resume: bool = False, doctor_only: bool = False):
        """``doctor_only``: the base eval and the first iteration with its doctor, then stop (``--doctor``)."""
        if doctor_only:
            config = config.model_copy(update={"train": config.train.model_copy(update={"doctor": True})})
        self.config = config
        self.doctor_only = doctor_only
        self.run = RunDirectory(run_dir)
        self.accelerator = Accelerator(mixed_precision=config.train.mixed_precision, cpu=not torch.cuda.is_available(),
                                       log_with=config.train.report_to or None, project_dir=self.run.tracking_dir)
        self.is_main = self.accelerator.is_main_process
        self.rank = self.accelerator.process_index
        self.start_iteration = 1
        self.resume = resume
        self.non_finite_streak = 0  # iterations in a row whose reward had a NaN/inf (updates skipped)
        self.alarm = HackingAlarm(config.eval.hacking_window, config.eval.hacking_z)
        self.best = BestAdapter(config.eval.best_by)
        self.alarm_stop: str | None = None  # the alarm's line when it ends the run (train.on_hacking: stop)
        self.base_eval: dict | None = None  # the base model's eval row (the doctor's range check)
        self.doctor_report: dict | None = None
        self.text_readings: list[WindowReading] = []  # how the prompts fill the text encoders' windows
        self._said_at = time.monotonic()  # when the last progress message was written (:meth:`_say_encoded`)

    # ----- set-up ----------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.config
        if self.is_main:  # the config first: a run killed while its model loads (or downloads) can be resumed
            self.run.create()
            self.run.write_config(cfg.to_yaml())
        torch.manual_seed(cfg.train.seed)
        self.train_prompts, self.eval_prompts = run_prompts(cfg.prompts)
        self.model = self._load_model()
        self.judges = self._load_judges()
        if cfg.train.gradient_checkpointing:
            for transformer in self.model.trained_transformers:
                transformer.enable_gradient_checkpointing()
        self.params = self.model.add_lora(cfg.lora)
        if cfg.lora.init_lora:  # token: HF_TOKEN or `hf auth login`
            self.model.load_lora(resolve_lora(cfg.lora.init_lora, files=adapter_filenames(cfg.model.expert)))
        optimizer = make_optimizer(cfg.train.optimizer, self.params, cfg.train.learning_rate, cfg.train.weight_decay)
        self.sharding = Sharding(self.accelerator)  # FSDP2 of the frozen transformer under an FSDP accelerate config
        self.optimizer = self.sharding.prepare(self.model, optimizer)
        self.sigmas = self.model.sigmas(cfg.sampling.num_steps, cfg.sampling.size)
        self.eval_sigmas = self.model.sigmas(cfg.sampling.eval_num_steps or cfg.sampling.num_steps, cfg.sampling.size)
        self.algorithm = make_algorithm(TrainingContext(
            cfg, self.model, self.params, self.sigmas, self.accelerator.device, self.accelerator.backward,
            self.accelerator.autocast, cfg.train.seed, self.rank, self.sharding))
        self.lr_scheduler = get_scheduler(cfg.train.lr_scheduler, self.optimizer,
                                          num_warmup_steps=cfg.train.lr_warmup_steps,
                                          num_training_steps=cfg.train.iterations * self.algorithm.optimizer_steps,
                                          num_cycles=cfg.train.lr_num_cycles)
        self.ema = EMAModel(self.params, decay=cfg.train.ema_decay) if cfg.train.ema_decay > 0 else None
        self.reward = build_rewards(cfg.rewards, self.accelerator.device, reward_frames=cfg.sampling.reward_frames)
        if self.resume:
            self._load_checkpoint()
            self._say_if_process_count_changed()
        if self.is_main:
            self.run.write_run_info(self.model.family, cfg.model.name, hardware=self._hardware(),
                                    processes=self.accelerator.num_processes,
                                    text_windows=[reading.record() for reading in self.text_readings],
                                    expert=cfg.model.expert if len(self.model.denoisers) > 1 else None)
        start_trackers(self.accelerator, cfg, self.run)

    def _load_model(self) -> FlowModel:
        """The base model. With ``model.cache_text_embeddings`` every training and eval prompt is encoded now (a
        resume reads them back from the run directory instead, without loading the encoders), once the cache is
        known to fit the host's memory and the run folder's disk, and the text encoders are released before the
        transformer and VAE take the device. Without, only the eval prompts are kept encoded."""
        cfg = self.config
        device = self.accelerator.device
        options = {"place_transformer": not fsdp_requested(),  # FSDP places each rank's shard itself
                   "num_frames": cfg.sampling.num_frames}
        prompts = self.train_prompts + self.eval_prompts
        cached = cfg.model.cache_text_embeddings
        saved = load_embeddings(self.run.text_embeddings_file, prompts, cfg.model,
                                self.accelerator.num_processes) if cached and self.resume else None
        model = load_flow_model(cfg.model, device, seed=cfg.train.seed, text_encoders=saved is None, **options)
        model.check_size(cfg.sampling.size)
        self._read_text_windows(model, prompts)
        if not cached:  # the encoders stay: each iteration encodes its prompts, unkept
            model.encode_and_cache(self.eval_prompts)  # every eval samples them
            return model
        if saved is not None:
            model.load_embeddings(saved)
            self._log(f"text embeddings of {len(saved)} prompts read from {self.run.text_embeddings_file.name}")
            return model
        distinct = len(dict.fromkeys(prompts))  # the app and accelerate launch the processes on one machine
        check_cache_room(bytes_per_prompt(model), distinct, self.run.path, self.accelerator.num_processes)
        images = " and their input images" if model.encodes_input_images else ""
        self._phase("loading", f"encoding {distinct} prompts{images} for the text-embedding cache")
        model.encode_and_cache(prompts, progress=self._say_encoded)
        if self.is_main:
            save_embeddings(self.run.text_embeddings_file, model.cached_embeddings, cfg.model)
        model.release_text_encoders()
        return model

    def _read_text_windows(self, model: FlowModel, prompts: list[str]) -> None:
        """How the run's prompts fill the text encoders' windows (:mod:`jagg_core.models.text_windows`), before any
        is encoded: prompts longer than a window the family refuses stop the run in one line; the log names each
        window that cuts prompts, and CFG's negative prompt where a window cuts it; the doctor checks that
        ``model.max_sequence_length`` cuts no prompt."""
        self.text_readings = model.read_text_windows(prompts)
        refuse_overlong(self.text_readings)
        lines = window_lines(self.text_readings)
        if model.use_cfg:  # CFG's negative prompt is encoded beside each prompt, in the same windows
            negative = read_windows(model.text_windows(), [self.config.model.negative_prompt])
            lines += prompt_notes(negative, "model.negative_prompt")
        for line in lines:
            self._log(line)

    def _say_encoded(self, done: int, total: int) -> None:
        """The prompts' encoding at set-up, in ``status.json``'s message at most every :data:`SAY_EVERY_S` seconds
        and at its end (a set of 25,000 prompts takes minutes)."""
        if self.is_main and (done == total or time.monotonic() - self._said_at >= SAY_EVERY_S):
            self.run.write_status("running", phase="loading", message=f"encoding the prompts: {done}/{total}")
            self._said_at = time.monotonic()

    def _load_judges(self) -> CombinedReward | None:
        """The judges (``eval.judges``), each scoring one blank image now, so that a judge that cannot load fails the
        run in one line before the base eval. They load after the base model: on the device they never sit beside
        the text encoders (gone by then under ``model.cache_text_embeddings``), and, under forked random number
        generators, the LoRA's initialisation and the whole run are the same with or without them."""
        cfg = self.config
        check_judges_room(cpu_judges(cfg), self.accelerator.num_processes)
        judges = build_judges(cfg, self.accelerator.device)
        if judges is None:
            return None
        self._phase("loading", "loading the judges " + ", ".join(judges.names))
        frames = (cfg.sampling.num_frames,) if cfg.sampling.num_frames > 1 else ()
        device = self.accelerator.device
        with forked_rng(device):
            load_judges(judges, torch.full((1, *frames, 3, *cfg.sampling.size), 0.5),
                        self.eval_prompts[:1])
        return judges

    def _hardware(self) -> str:
        """What the run trains on, for the model card: the GPU's name, or the CPU's and its thread count."""
        device = self.accelerator.device
        name = (torch.cuda.get_device_name(device) if device.type == "cuda"
                else f"{cpu_name()} ({torch.get_num_threads()} threads)")
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

    def _say_if_process_count_changed(self) -> None:
        """A resume on another number of processes than the run's last is valid but not exact: say so."""
        before, now = self.run.read_run_info().get("processes"), self.accelerator.num_processes
        if isinstance(before, int) and before != now:
            self._log(f"resumed on {now} process(es); the run trained on {before} before: each process draws its own "
                      f"prompts and noise, so from here the run differs from one that went on with {before} (valid, "
                      "not bit-identical)")

    def _training_state(self) -> dict:
        """What a checkpoint needs beyond the adapter file and the optimizer: the schedule, the EMA and the LoRA
        weights being trained (the adapter file holds the average when EMA is on), the algorithm's state (GRPO: the
        audited window cosines that route windows; NFT, AWM: their lagging policy), and what the evals decided (the
        hacking alarm's history, the best adapter's record)."""
        return {**self.algorithm.state_dict(), "lr_scheduler": self.lr_scheduler.state_dict(),
                "hacking_alarm": self.alarm.state_dict(), "best_adapter": self.best.state_dict(),
                "ema": self.ema.state_dict() if self.ema is not None else None,
                "lora": [param.detach().cpu() for param in self.params]}

    def _load_training_state(self, folder: Path) -> None:
        """Restore :meth:`_training_state` (checkpoints written before it existed hold the weights alone)."""
        path = folder / TRAINING_STATE_FILE
        if not path.is_file():
            return
        state = torch.load(path, map_location="cpu", weights_only=False)
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.algorithm.load_state_dict(state)
        if "hacking_alarm" in state:
            self.alarm.load_state_dict(state["hacking_alarm"])
            self.best.load_state_dict(state["best_adapter"])
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

    # ----- the stages of an iteration -------------------------------------------------------
    def rollout(self, iteration: int) -> Rollout:
        """This process's prompts of iteration ``iteration``, their samples by the algorithm's sampler, decoded and
        scored."""
        cfg = self.config
        group = cfg.grpo.num_generations
        picker = random.Random(iteration_seed(cfg.train.seed, iteration, self.rank, 0))
        prompts = [picker.choice(self.train_prompts) for _ in range(cfg.grpo.prompts_per_iteration)]
        sample_prompts = [p for p in prompts for _ in range(group)]
        cond = self.model.conditioning(sample_prompts)
        generator = torch.Generator().manual_seed(iteration_seed(cfg.train.seed, iteration, self.rank, 1))
        with self.accelerator.autocast():
            sampled = self.algorithm.sample(iteration, cond, generator)
            with torch.no_grad():
                images = self.model.decode_to_host(sampled.latents, cond)
        rewards, parts = self.reward(images, sample_prompts)
        return Rollout(sampled, cond, sample_prompts, images, rewards, parts)

    def keep_rollout_images(self, iteration: int, rollout: Rollout) -> None:
        """The latest rollout's images, for the page (``RUN/rollouts``)."""
        if self.is_main:
            pictures, videos = sample_pictures(rollout.images)
            self.run.write_images(self.run.rollouts_dir, pictures, rollout.prompts, videos=videos,
                                  fps=self.config.sampling.fps, rewards=rollout.rewards.tolist(), iteration=iteration)

    def rewards_usable(self, all_rewards: torch.Tensor, iteration: int) -> bool:
        """Whether every process's rewards are finite; a non-finite one skips the update (with a warning), and
        :data:`MAX_NON_FINITE_STREAK` of them in a row fail the run."""
        if torch.isfinite(all_rewards).all():
            self.non_finite_streak = 0
            return True
        self.non_finite_streak += 1
        if self.non_finite_streak >= MAX_NON_FINITE_STREAK:
            raise UserError(f"the reward was missing or non-finite in {self.non_finite_streak} iterations in a row "
                            f"(last at iteration {iteration}); check the reward (server) and resume")
        warnings.warn(f"iteration {iteration}: non-finite reward; this update is skipped", stacklevel=2)
        return False

    def advantages(self, rollout: Rollout) -> torch.Tensor:
        """The rollout's advantages under the ``grpo`` section, on the device: of the rewards' weighted sum
        (:func:`~jagg_core.grpo.group_advantages`), or each reward's own (``multi_reward: per_reward``,
        :func:`~jagg_core.grpo.reward_advantages`)."""
        grpo, prompts = self.config.grpo, group_prompts(self.config, rollout)
        if grpo.multi_reward == "per_reward":
            parts = [rollout.reward_parts[name] for name in self.reward.names]
            advantages = reward_advantages(parts, self.reward.weights, grpo.num_generations, grpo.adv_clip,
                                           prompts=prompts, global_std=grpo.global_std)
        else:
            advantages = group_advantages(rollout.rewards, grpo.num_generations, grpo.adv_clip, prompts=prompts,
                                          global_std=grpo.global_std)
        return advantages.to(self.accelerator.device)

    def reward_signals(self, rollout: Rollout) -> dict[str, float]:
        """Each reward term's signal ``|w| mean_g std_g(r)`` (:func:`~jagg_core.grpo.group_spread`), grouped as the
        advantages are: which term tells a group's samples apart, and so leads a ``multi_reward: sum`` advantage."""
        size, prompts = self.config.grpo.num_generations, group_prompts(self.config, rollout)
        return {name: abs(weight) * group_spread(rollout.reward_parts[name], size, prompts)
                for name, weight in zip(self.reward.names, self.reward.weights)}

    def optimizer_steps(self, rollout: Rollout, advantages: torch.Tensor, plan) -> dict:
        """The algorithm's optimizer steps on one rollout batch, each its backward then the step; the algorithm's
        statistics, the last step's gradient norm and whether any step was skipped."""
        steps, skipped = [], False
        for step in range(self.algorithm.optimizer_steps):
            steps.append(self.algorithm.backward(rollout, advantages, plan, step))
            grad_norm, step_skipped = self._optimizer_step()
            skipped = skipped or step_skipped
        return {**self.algorithm.summarize(plan, steps), metrics.GRAD_NORM: grad_norm, metrics.SKIPPED: skipped}

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
        z0 = initial_noise(self.model, len(self.eval_prompts), cfg.sampling.size, generator)
        images, chunk = [], cfg.sampling.eval_chunk(len(self.eval_prompts))
        with self.accelerator.autocast(), self.averaged_weights():
            for first in range(0, len(self.eval_prompts), chunk):
                part = slice(first, first + chunk)
                cond = self.model.conditioning(self.eval_prompts[part])
                images.append(self.model.decode_to_host(ode_sample(self.model, cond, self.eval_sigmas, z0[part]), cond))
                if iteration == 0:
                    done = min(first + chunk, len(self.eval_prompts))
                    self._phase("base eval", f"sampling the base model: base eval {done}/{len(self.eval_prompts)}")
        images = torch.cat(images)
        if not self.is_main:  # a sharded transformer samples on every process; rank 0 scores and writes
            return {}
        rewards, parts = self.reward(images, self.eval_prompts)
        _, judged = self.judges(images, self.eval_prompts) if self.judges is not None else (None, {})
        what = "base model" if iteration == 0 else f"iteration {iteration}"
        sheet = captioned_grid(to_pil(still_frames(images)),
                               [f"{p} · {r:.2f}" for p, r in zip(self.eval_prompts, rewards.tolist())],
                               title=f"{what} · eval reward {float(rewards.mean()):.3f}")
        pictures, videos = sample_pictures(images)
        self.run.write_images(self.run.samples_dir(iteration), pictures, self.eval_prompts, grid=sheet, videos=videos,
                              fps=cfg.sampling.fps, rewards=rewards.tolist(), iteration=iteration)
        log_eval_grid(self.accelerator, sheet, iteration)
        row = {metrics.EVAL_REWARD_MEAN: float(rewards.mean()),
               **{metrics.eval_reward_part(name): float(v.mean()) for name, v in parts.items()},
               **{metrics.judge_key(name): float(v.mean()) for name, v in judged.items()},
               metrics.TIME_EVAL: time.perf_counter() - began}
        self.watch_eval(iteration, rewards, judged, row)
        return row

    def watch_eval(self, iteration: int, rewards: torch.Tensor, judged: dict[str, torch.Tensor], row: dict) -> None:
        """Show the eval to the hacking alarm (its line goes to ``row``, the log and the status, and under
        ``train.on_hacking: stop`` ends the run after this iteration) and to the best adapter (``RUN/best``)."""
        scores = EvalScores(iteration, rewards.tolist(), {name: v.tolist() for name, v in judged.items()})
        alarm = self.alarm.observe(scores)
        if alarm:
            row[metrics.HACKING_ALARM] = alarm
            self._log(f"WARNING {alarm}")
            self.run.write_status("running", alarm=alarm)
            if self.config.train.on_hacking == "stop":
                self.alarm_stop = alarm
        if self.best.consider(iteration, row):
            self.run.write_best(self._save_adapter, self.best.record)
        elif self.best.record is not None:
            self.run.write_best_record(self.best.record)

    def save_checkpoint(self, iteration: int) -> None:
        """The adapter (the EMA weights when on: the one to publish), the optimizer and the training state."""
        def contents(folder: Path) -> None:
            self._save_adapter(folder)
            torch.save(self.optimizer.state_dict(), folder / OPTIMIZER_FILE)
            torch.save(self._training_state(), folder / TRAINING_STATE_FILE)
        checkpoint = self.run.write_checkpoint(iteration, contents, keep=self.config.train.keep_checkpoints)
        self.run.publish_lora(checkpoint)

    def _save_adapter(self, folder: Path) -> None:
        """The adapter to publish (the EMA weights when on) into ``folder``."""
        with self.averaged_weights():
            self.model.save_lora(folder)

    # ----- the first iteration's doctor --------------------------------------------------------
    def examine(self, iteration: int, all_rewards: torch.Tensor, stats: dict, cosine: float | None,
                velocity_change: float | None, signals: dict[str, float]) -> None:
        """The doctor's checklist of the first iteration (:mod:`jagg_core.doctor`): to the log, ``RUN/doctor.json``
        and the status."""
        cfg = self.config
        ranges = {term: reward_entry(spec.name).expected_range
                  for spec, term in zip(cfg.rewards, term_names([spec.name for spec in cfg.rewards]))}
        checks = [rewards_check(all_rewards, cfg.grpo.num_generations),
                  ratio_check(stats.get(metrics.RATIO_MAX_DEV)),
                  gradient_check(stats.get(metrics.GRAD_NORM), velocity_change),
                  range_check(self.base_eval, ranges),
                  audit_check(cosine, cfg),
                  text_window_check(self.text_readings),
                  reward_balance_check(signals, dict(zip(self.reward.names, self.reward.weights)),
                                       cfg.grpo.multi_reward)]
        self.doctor_report = checklist(iteration, checks)
        if self.is_main:
            self.run.write_doctor(self.doctor_report)
            self.run.write_status("running", doctor=self.doctor_report)
            for line in report_lines(self.doctor_report):
                self._log(line)

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
            self.base_eval = base
            self.run.append_metrics(base)
            log_row(self.accelerator, base)
            self._log(f"iter 0/{total}  base eval reward {base[metrics.EVAL_REWARD_MEAN]:.4f}")
        self._phase("training", f"training iteration {self.start_iteration}/{total}")
        bar = tqdm(range(self.start_iteration, total + 1), initial=self.start_iteration - 1, total=total,
                   desc=cfg.train.algorithm.upper(), disable=not self.is_main, dynamic_ncols=True)
        last = min(total, 1) if self.doctor_only else total
        for iteration in bar:
            with STOP.deferred():
                row = self.iteration(iteration)
                stopping = self._max_over_processes(STOP.requested or 0)
                alarm_stop = self._max_over_processes(int(self.alarm_stop is not None))
                ending = stopping or alarm_stop or iteration == last
                if self.is_main:
                    self.run.append_metrics(row)
                    log_row(self.accelerator, row)
                    if iteration % checkpoint_every == 0 or iteration == total or ending:
                        self.save_checkpoint(iteration)
                    self.run.write_status("running", iteration=iteration, phase="training",
                                          message=f"iteration {iteration}/{total} done")
                    bar.set_postfix(reward=f"{row[metrics.REWARD_MEAN]:.3f}")
                self.accelerator.wait_for_everyone()
            if stopping:
                raise StopRequested(stopping)
            if alarm_stop:
                raise AlarmStop(self.alarm_stop or "the reward-hacking alarm fired on the main process")
            if iteration == last < total:
                self._end_doctor_only(iteration)
                break
        else:
            identical = self._adapters_identical_across_processes()
            if self.is_main:
                self.run.write_status("finished", iteration=total, message=f"finished {total} iterations",
                                      processes=self.accelerator.num_processes, adapters_identical=identical,
                                      **({"sharding": self.sharding.record} if self.sharding.enabled else {}))
                first, *others = adapter_files(self.run.lora_file)
                self._log(f"finished: adapter at {first}" + "".join(f" and {file.name}" for file in others))
        # Every process waits here for the others (and, on gloo, for its own collectives still in flight) before
        # :meth:`close` tears the process group down: a process destroying it while another still writes its status
        # or finishes a collective can abort at exit ("terminate called without an active exception").
        self.accelerator.wait_for_everyone()

    def close(self) -> None:
        """Finish the experiment trackers (flushes their files) and destroy the process group of several processes."""
        self.accelerator.end_training()

    def _end_doctor_only(self, iteration: int) -> None:
        """``--doctor``: the run stops after the checked iteration, resumable."""
        if self.is_main:
            report = self.doctor_report or {}
            verdict = "every check passed" if report.get("passed") else "a check failed (see the checklist)"
            self.run.write_status("stopped", iteration=iteration, message=f"doctor: {verdict}; continue the run with "
                                  "--resume")

    def _max_over_processes(self, value: int) -> int:
        """The largest ``value`` of all processes (a stop signal, an alarm's stop): every process takes the same
        decision, so their collectives stay matched."""
        local = torch.tensor([value], device=self.accelerator.device)
        return int(self.accelerator.gather(local).max())

    def eval_due(self, iteration: int) -> bool:
        """Whether iteration ``iteration`` ends with the held-out eval (``train.sample_every``, and the last)."""
        total = self.config.train.iterations
        return iteration % effective_interval(self.config.train.sample_every, total) == 0 or iteration == total

    def iteration(self, iteration: int, evaluate: bool | None = None) -> dict:
        """One iteration, its stages in order (the algorithm's: :mod:`jagg_core.algorithms.base`): rollout and
        rewards, advantages, the backward plan, the optimizer steps (each a backward and a step), the algorithm's
        state update, and the eval when due (or as ``evaluate`` says); returns its metrics row. :meth:`fit` appends
        the row and writes the checkpoints."""
        cfg = self.config
        began = time.perf_counter()
        rollout = self.rollout(iteration)
        time_rollout = time.perf_counter() - began
        self.keep_rollout_images(iteration, rollout)
        all_rewards = self.accelerator.gather(rollout.rewards.to(self.accelerator.device)).cpu()
        learning_rate = self.lr_scheduler.get_last_lr()[0]  # the rate of this iteration's (first) update
        began = time.perf_counter()
        doctor = cfg.train.doctor and iteration == 1
        cosine = velocity_change = None
        doctor_s = 0.0  # the doctor's own seconds, not the update's
        if self.rewards_usable(all_rewards, iteration):
            advantages = self.advantages(rollout)
            plan = self.algorithm.plan(rollout, advantages, iteration)
            if doctor:
                doctor_began = time.perf_counter()
                probe = Probe(self.model, rollout.sampled.latents, rollout.cond, self.accelerator.autocast)
                cosine, before = self.algorithm.audit_cosine(rollout, advantages, plan), probe.velocity()
                doctor_s = time.perf_counter() - doctor_began
            stats = self.optimizer_steps(rollout, advantages, plan)
            self.algorithm.after_update(iteration)
            if doctor:
                doctor_began = time.perf_counter()
                velocity_change = Probe.change(before, probe.velocity())
                doctor_s += time.perf_counter() - doctor_began
        else:
            stats = {metrics.SKIPPED: True}
        time_train = time.perf_counter() - began - stats.get(metrics.TIME_AUDIT, 0.0) - doctor_s  # the update's
        signals = self.reward_signals(rollout)
        if doctor:
            self.examine(iteration, all_rewards, stats, cosine, velocity_change, signals)
        finite = all_rewards[torch.isfinite(all_rewards)]
        row = {metrics.ITERATION: iteration,
               metrics.REWARD_MEAN: float(finite.mean()) if finite.numel() else float("nan"),
               metrics.REWARD_STD: float(finite.std()) if finite.numel() > 1 else 0.0,
               **{metrics.reward_part(name): float(v.mean()) for name, v in rollout.reward_parts.items()},
               **{metrics.reward_spread(name): value for name, value in signals.items()},
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
