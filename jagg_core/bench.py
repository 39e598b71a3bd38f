"""Benchmark: the exact backward against JAGG, side by side, in one run.

    python -m jagg_core.bench [--quick] [--json OUT.json] [--table OUT.md] [--plot OUT.png] [--models A,B]
    python -m jagg_core.bench --arch NAME --random-weights [--layers N] [--resolution R] [--quantize nf4|int8]
    python -m jagg_core.bench --fidelity ROLLOUTS ...     (adds section 5)
    python -m jagg_core.bench --training [--setups flow_grpo,exact,default,tree] [--models M] [--json|--table|--plot OUT]

Every comparison runs in one process on the same model, the same rollout batch and the same seeds,
through the project's own code: :class:`~jagg_core.trainer.Trainer` (set-up, rollout, iterations),
:meth:`~jagg_core.trainer.Trainer.plan_backward` and :meth:`~jagg_core.trainer.Trainer.accumulate_gradients`
(``make_plan`` + ``run_backward``) under one :class:`~jagg_core.config.BackwardConfig` per variant.

1. **Train phase** (the backward of one rollout batch, LoRA gradients from zero) for ``exact`` and
   the JAGG modes ``forward`` (a no-grad forward per intermediate step, the paper), ``cached``
   (rollout velocities with the endpoint correction) and ``cached_shared`` (plus shared knots), at
   each window W, with joint (stacked) and sequential endpoints. Seconds are the minimum over
   repeats after a warm-up, the variants interleaved within each repeat so that load from other
   processes falls on all of them alike. Peak memory is the increment over the memory before the
   backward (see :func:`peak_memory`); gradients are compared with the exact one (cosine, relative
   norm error of the flattened LoRA gradient).
2. The same on each model of ``--models``: by default the embedded pretrained model (or tiny-sd3
   while there is none) and ``bench-sd3-31m``, a DiT large enough to be compute-bound on a CPU.
3. **Whole iterations** (rollout + train) of short trainings on each model, alternating
   iteration by iteration, for each seed: Flow-GRPO's default (every step SDE, exact backward, reference in the
   rollout), the exact backward with the default's rollout, the default, and the default with tree rollouts
   (:func:`~jagg_core.training_bench.comparison_setups`); reward
   against wall-clock goes to ``--plot``. The default's training is audited at every iteration
   (``backward.audit_every``), timed apart: the cost of one audit against an iteration's.
4. **Routing**: the linearity score of every window (``linearity`` in each row) and rows with
   ``frac < 1`` (section ``routing``).
5. **Fidelity** (``--fidelity``, :mod:`jagg_core.fidelity_bench`): each window's audited gradient cosine along the
   trajectory, and how well the routing predictors rank it (section ``fidelity``).

``--training`` runs instead whole trainings of the setups ``--setups`` (default: the exact backward and the default)
over three seeds (:mod:`jagg_core.training_bench`).

Every train-phase row also has the seconds of one rollout of the same batch (``rollout_s``, timed once per
repeat among the variants), so ``iteration_s = rollout_s + train_s`` and ``iteration_speedup`` compare whole
iterations, and the rollout's peak memory (``rollout_peak_mem_mb``).

**Real architectures** (``--arch``): one model, a real architecture of :mod:`jagg_core.archs` with random
weights (``--random-weights``: ``model.name = random:ARCH[@LAYERS]``, built from the shipped configs, no
download) or the Hub model's own weights, on the bench's rollout batch at ``--resolution``, in bf16 with
bf16 autocast on a GPU (float32 on a CPU), through the same machinery: exact and JAGG at W = 2, 4, 5
(forward and cached velocities, joint and sequential endpoints), see :data:`ARCH_OPTIONS`.

The JSON is a list of rows; every row has :data:`ROW_KEYS` (``None`` where a figure does not apply).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import metrics
from .archs import RANDOM_PREFIX, arch_names, hub_id, parse_random_model
from .audit import flat_gradient, gradient_agreement
from .config import BackwardConfig, RunConfig, list_presets, load_config
from .errors import UserError, exit_on_user_error
from .fidelity_bench import fidelity_rows, format_fidelity
from .training_bench import (SETUP_LABELS, backward_label, comparison_setups, format_training, plot_training,
                             training_rows)
from .jagg import BackwardPlan
from .models import embedded_models
from .placement import trained_count
from .report import cell, markdown_table, plot_curves
from .quiet import quiet_libraries
from .trainer import Trainer

EMBEDDED_MODEL = "jagg-shapes"
LARGE_MODEL = "bench-sd3-31m"
JAGG_MODES = ("forward", "cached", "cached_shared")
ROW_KEYS = ("section", "model", "params_m", "mode", "window", "joint", "frac", "seconds", "speedup",
            "peak_mem_ratio", "peak_mem_basis", "grad_cosine", "grad_rel_err")
#: The preset a model runs with when its name is not a preset's (default: tiny-sd3's), and overrides: the CPU
#: models run the default task.
MODEL_PRESETS = {EMBEDDED_MODEL: "shapes", LARGE_MODEL: "shapes"}
MODEL_OVERRIDES = {
    LARGE_MODEL: ["model.max_sequence_length=16"],
}
#: glibc settings of the memory subprocess: every buffer of 64 KiB or more is its own mapping, returned
#: to the system when freed, so the resident set follows the live tensors and its peak is theirs.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


# ----- variants ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One backward configuration under test."""

    mode: str            # exact | forward | cached | cached_shared
    window: int = 1
    joint: bool = False
    frac: float = 1.0

    def backward_config(self, **settings) -> BackwardConfig:
        """The backward section of this variant, with other keys of it (``audit_every`` ...) from ``settings``."""
        if self.mode == "exact":
            return BackwardConfig(mode="exact", **settings)
        return BackwardConfig(mode="jagg", window=self.window, joint=self.joint, frac=self.frac, route_by="linearity",
                              velocities="forward" if self.mode == "forward" else "cached",
                              shared_knots=self.mode == "cached_shared", **settings)

    @property
    def label(self) -> str:
        if self.mode == "exact":
            return "exact"
        routed = f" frac={self.frac:g}" if self.frac < 1 else ""
        return f"{self.mode} W={self.window} {'joint' if self.joint else 'seq'}{routed}"


EXACT = Variant("exact")


def variant_grid(windows, joints=(True, False), modes=JAGG_MODES, fracs=(), routing_window: int = 5) -> list[Variant]:
    """``exact``, every JAGG mode x window x endpoint layout, then the routed (``frac < 1``) variants."""
    grid = [EXACT] + [Variant(m, w, j) for m in modes for w in windows for j in joints]
    return grid + [Variant("cached", routing_window, True, f) for f in fracs]


@dataclass
class BenchOptions:
    """What to run. The first model gets ``windows`` and the routing rows; the others ``other_windows``."""

    models: list[str] = field(default_factory=lambda: default_models())
    windows: tuple[int, ...] = (2, 4, 5, 10)
    other_windows: tuple[int, ...] = (2, 4, 5, 10)
    modes: tuple[str, ...] = JAGG_MODES
    joints: tuple[bool, ...] = (True, False)
    fracs: tuple[float, ...] = (0.5, 0.75)
    routing_window: int = 5
    repeats: int = 5
    warmup: int = 1
    memory: bool = True
    #: sections 1, 2 and 4 (the train phase of each variant); False: only the whole iterations (and fidelity)
    train_phase: bool = True
    iterations: int = 20
    seeds: tuple[int, ...] = (0, 1)
    #: rollouts of the fidelity section (:mod:`jagg_core.fidelity_bench`, on the first model); 0 = skip
    fidelity_rollouts: int = 0
    #: config overrides (``key=value``) of every run the bench makes, after the model's own
    overrides: tuple[str, ...] = ()

    @classmethod
    def quick(cls, **changes) -> "BenchOptions":
        """The ``--quick`` set: W in {2, 3, 5} (exactness, the default window, the widest on the default task's
        five trained steps), W = 3 and 5 on the larger models, 2 repeats, 6 iterations."""
        return cls(**{"windows": (2, 3, 5), "other_windows": (3, 5), "repeats": 2, "iterations": 6, **changes})

    def grid(self, index: int) -> list[Variant]:
        if index == 0:
            return variant_grid(self.windows, self.joints, self.modes, self.fracs, self.routing_window)
        return variant_grid(self.other_windows, self.joints, self.modes)


def default_models() -> list[str]:
    """The embedded pretrained model (tiny-sd3 while it is not there) and the larger DiT."""
    return [EMBEDDED_MODEL if EMBEDDED_MODEL in embedded_models() else "tiny-sd3", LARGE_MODEL]


def bench_config(model: str, overrides: list[str] = ()) -> RunConfig:
    """The run config for ``model``: its preset if there is one, else that of :data:`MODEL_PRESETS`
    (tiny-sd3's by default) with the model swapped in."""
    if model in list_presets():
        return load_config(preset=model, overrides=list(overrides))
    return load_config(preset=MODEL_PRESETS.get(model, "tiny-sd3"),
                       overrides=[f"model.name={model}", *MODEL_OVERRIDES.get(model, []), *overrides])


# ----- real architectures (--arch) ------------------------------------------------------------
#: the real-architecture bench: exact, and JAGG at W = 2, 4, 5 with forward and cached velocities (joint and
#: sequential endpoints), 3 repeats, a 3-iteration training; ``--quick``: W = 2, 5 cached, 2 repeats, no training
ARCH_OPTIONS = {"windows": (2, 4, 5), "modes": ("forward", "cached"), "fracs": (), "repeats": 3, "iterations": 3,
                "seeds": (0,)}
ARCH_OPTIONS_QUICK = {**ARCH_OPTIONS, "windows": (2, 5), "modes": ("cached",), "repeats": 2, "iterations": 0}
#: default image side of the real-architecture bench, by device type
ARCH_RESOLUTION = {"cuda": 512, "cpu": 64}


def arch_model(arch: str | None, random_weights: bool, layers: int | None = None) -> str:
    """``model.name`` of the ``--arch`` bench: ``random:ARCH[@LAYERS]`` with random weights, else the arch's
    Hub id (its real weights, downloaded); a missing or unknown arch is a :class:`UserError`."""
    if arch is None:
        raise UserError(f"--random-weights needs --arch NAME; archs: {', '.join(arch_names())}")
    if not random_weights:
        if layers is not None:
            raise UserError("--layers needs --random-weights (the Hub model has its real depth)")
        return hub_id(arch)
    name = RANDOM_PREFIX + arch + (f"@{layers}" if layers is not None else "")
    parse_random_model(name)  # an unknown arch or a layer count out of range
    return name


def arch_overrides(device_type: str, resolution: int | None = None, quantize: str | None = None) -> list[str]:
    """Config overrides of the real-architecture bench: the resolution (default :data:`ARCH_RESOLUTION`),
    bf16 weights and bf16 autocast on a GPU (float32 on a CPU), and ``model.quantize``."""
    overrides = [f"sampling.resolution={resolution or ARCH_RESOLUTION.get(device_type, ARCH_RESOLUTION['cpu'])}"]
    if device_type == "cuda":
        overrides += ["model.dtype=bfloat16", "train.mixed_precision=bf16"]
    if quantize:
        overrides.append(f"model.quantize={quantize}")
    return overrides


def arch_options(model: str, overrides: list[str], quick: bool = False, **changes) -> BenchOptions:
    """The real-architecture bench of ``model`` (:data:`ARCH_OPTIONS`, or :data:`ARCH_OPTIONS_QUICK`) under
    ``overrides``, which are checked here."""
    bench_config(model, overrides)
    return BenchOptions(models=[model], overrides=tuple(overrides),
                        **{**(ARCH_OPTIONS_QUICK if quick else ARCH_OPTIONS), **changes})


# ----- one rollout batch and its backward ----------------------------------------------------
class Workload:
    """A model with its LoRA (through :meth:`Trainer.setup`) and one rollout batch (:meth:`Trainer.rollout`),
    under the config of :func:`bench_config` with ``overrides``."""

    def __init__(self, model: str, run_dir: str | Path, overrides: tuple[str, ...] = ()):
        self.model_name, self.overrides = model, tuple(overrides)
        self.trainer = Trainer(bench_config(model, self.overrides), run_dir)
        self.trainer.setup()
        self.device = self.trainer.accelerator.device
        rollout = self.trainer.rollout(1)
        self.traj, self.cond, self.spans = rollout.trajectory, rollout.cond, rollout.spans
        self.advantages = self.trainer.advantages(rollout)
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
        (:meth:`Trainer.accumulate_gradients`, as in training before the optimizer step)."""
        for param in self.trainer.params:
            param.grad = None
        plan = self.trainer.plan_backward(self.traj, self.spans, variant.backward_config())
        self.trainer.accumulate_gradients(self.traj, self.cond, self.advantages, plan, on_policy=True)
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


# ----- peak memory ------------------------------------------------------------------------------
def _proc_status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{key} is not in /proc/self/status")


@contextlib.contextmanager
def memory_probe(device: torch.device):
    """Yields a dict that gets ``base_mb`` (before) and ``peak_mb`` (the high-water mark inside).

    GPU: ``torch.cuda.memory_allocated`` / ``max_memory_allocated``. CPU: the resident set
    (``VmRSS``) and its high-water mark ``VmHWM``, reset on entry through ``/proc/self/clear_refs``;
    meaningful in a process started with :data:`MALLOC_ENV`.
    """
    gc.collect()
    figures = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        figures["base_mb"] = torch.cuda.memory_allocated(device) / 2 ** 20
        yield figures
        figures["peak_mb"] = torch.cuda.max_memory_allocated(device) / 2 ** 20
    else:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        figures["base_mb"] = _proc_status_mb("VmRSS")
        yield figures
        figures["peak_mb"] = _proc_status_mb("VmHWM")


def memory_basis(device: torch.device) -> str:
    return "cuda max_memory_allocated increment" if device.type == "cuda" else "cpu peak RSS increment"


#: the key of the rollout's figures in :func:`peak_memory`'s result
ROLLOUT = "rollout"


def peak_memory(work: Workload, variants: list[Variant]) -> dict[str, dict[str, float]]:
    """Base and peak memory of a rollout (key :data:`ROLLOUT`) and of each variant's backward, after one exact
    backward as warm-up."""
    work.backward(EXACT)
    figures = {}
    with memory_probe(work.device) as figures[ROLLOUT]:
        work.rollout()
    for variant in variants:
        with memory_probe(work.device) as figures[variant.label]:
            work.backward(variant)
    return figures


def measure_memory(work: Workload, variants: list[Variant], threads: int) -> dict[str, dict[str, float]]:
    """:func:`peak_memory` of ``work``: in this process on a GPU; on a CPU in a fresh subprocess with
    :data:`MALLOC_ENV` that rebuilds the same workload (same model, seeds and rollout)."""
    if work.device.type == "cuda":
        return peak_memory(work, variants)
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"model": work.model_name, "overrides": work.overrides,
                                    "variants": [asdict(v) for v in variants],
                                    "threads": threads, "out": str(Path(tmp) / "memory.json")}))
        subprocess.run([sys.executable, "-m", "jagg_core.bench", "--memory-worker", str(spec)],
                       env={**os.environ, **MALLOC_ENV}, check=True, stdout=subprocess.DEVNULL)
        return json.loads((Path(tmp) / "memory.json").read_text())


def memory_worker(spec_file: str) -> None:
    """Entry of the memory subprocess: build the workload, measure, write the figures as JSON."""
    spec = json.loads(Path(spec_file).read_text())
    torch.set_num_threads(spec["threads"])
    with tempfile.TemporaryDirectory() as run_dir:
        work = Workload(spec["model"], run_dir, spec["overrides"])
        figures = peak_memory(work, [Variant(**v) for v in spec["variants"]])
    Path(spec["out"]).write_text(json.dumps(figures))


# ----- rows ------------------------------------------------------------------------------------
def train_phase_rows(work: Workload, variants: list[Variant], seconds, gradients, plans, rollouts,
                     memory) -> list[dict]:
    """One row per variant, compared with ``exact`` (which must be among them); ``rollouts`` are the rollout's
    seconds (the same batch for every variant), so ``iteration_s`` is the rollout's plus the train phase's."""
    exact_seconds, exact_grad = min(seconds[EXACT]), gradients[EXACT]
    exact_mem, rollout_mem = memory.get(EXACT.label), memory.get(ROLLOUT)
    rollout_s = min(rollouts)
    rows = []
    for variant in variants:
        grad, plan, mem = gradients[variant], plans[variant], memory.get(variant.label)
        cosine, rel_err = gradient_agreement(grad, exact_grad)
        row = {"section": "routing" if variant.frac < 1 else "train_phase", "model": work.model_name,
               "params_m": work.params_m, "mode": variant.mode, "window": variant.window, "joint": variant.joint,
               "frac": variant.frac, "routed_frac": plan.routed_frac, "passes": len(plan.pass_steps),
               "linearity": [round(s, 5) for s in plan.linearity] if variant.mode != "exact" else None,
               "seconds": min(seconds[variant]), "seconds_median": statistics.median(seconds[variant]),
               "repeats": len(seconds[variant]), "speedup": exact_seconds / min(seconds[variant]),
               "train_s": min(seconds[variant]), "rollout_s": rollout_s,
               "iteration_s": rollout_s + min(seconds[variant]),
               "iteration_speedup": (rollout_s + exact_seconds) / (rollout_s + min(seconds[variant])),
               "grad_cosine": cosine, "grad_rel_err": rel_err,
               "peak_mem_basis": memory_basis(work.device) if mem else None,
               "base_mem_mb": mem["base_mb"] if mem else None, "peak_mem_mb": mem["peak_mb"] if mem else None,
               "peak_mem_ratio": ((mem["peak_mb"] - mem["base_mb"]) / (exact_mem["peak_mb"] - exact_mem["base_mb"])
                                  if mem else None),
               "rollout_peak_mem_mb": rollout_mem["peak_mb"] if rollout_mem else None,
               "device": str(work.device)}
        rows.append(row)
    return rows


def bench_train_phase(model: str, variants: list[Variant], options: BenchOptions, threads: int) -> list[dict]:
    """Train-phase rows of ``model``: timings and gradients here, peak memory per :func:`measure_memory`."""
    with tempfile.TemporaryDirectory() as run_dir:
        work = Workload(model, run_dir, options.overrides)
        seconds, gradients, plans, rollouts = time_variants(work, variants, options.repeats, options.warmup)
        memory = measure_memory(work, variants, threads) if options.memory else {}
        return train_phase_rows(work, variants, seconds, gradients, plans, rollouts, memory)


def bench_iterations(model: str, options: BenchOptions) -> list[dict]:
    """Short trainings of ``model``'s bench config (:func:`bench_config`) under each of
    :func:`~jagg_core.training_bench.comparison_setups`,
    alternating iteration by iteration, per seed.

    One row per setup: per-iteration seconds over every iteration but the first (the warm-up, unless
    there is only one), as the minimum of the rollout plus the minimum of the train phase (every
    iteration does the same work, so the minimum is the figure least disturbed by other processes,
    as in the train phase) and as the median; ``speedup`` = exact's seconds / the setup's (exact has the
    default's rollout), ``whole_iteration_speedup`` = Flow-GRPO's default's / the setup's; and each seed's reward
    curve as ``[cumulative seconds, rollout reward mean]`` points. The default setup runs the fidelity audit
    (:mod:`jagg_core.audit`) at every iteration, on the config's ``backward.audit_samples``: it changes nothing
    of the training and is timed apart, so its row also has the seconds of one audit (``audit_s``, the minimum),
    their ratio to the iteration's (``audit_ratio``) and the mean audited cosine (``audit_cosine``).
    """
    setups = comparison_setups(bench_config(model, options.overrides))
    times = {name: {"rollout": [], "train": [], "audit": []} for name in setups}
    cosines = {name: [] for name in setups}
    curves = {name: {} for name in setups}
    configs = {}
    first = 1 if options.iterations > 1 else 0
    with tempfile.TemporaryDirectory() as root:
        for seed in options.seeds:
            trainers = {}
            for name, changes in setups.items():
                config = bench_config(model, [*options.overrides, *changes, f"train.seed={seed}",
                                              f"train.iterations={options.iterations}",
                                              f"backward.audit_every={int(name == 'default')}"])
                configs[name] = config
                trainers[name] = Trainer(config, Path(root) / f"{name}-{seed}")
                trainers[name].setup()
                curves[name][str(seed)] = []
            for iteration in range(1, options.iterations + 1):
                for name, trainer in trainers.items():
                    row = trainer.iteration(iteration, evaluate=False)  # no held-out eval, no checkpoint
                    elapsed = row[metrics.TIME_ROLLOUT] + row[metrics.TIME_TRAIN]
                    curve = curves[name][str(seed)]
                    curve.append([(curve[-1][0] if curve else 0.0) + elapsed, row[metrics.REWARD_MEAN]])
                    if iteration > first:
                        times[name]["rollout"].append(row[metrics.TIME_ROLLOUT])
                        times[name]["train"].append(row[metrics.TIME_TRAIN])
                        if metrics.TIME_AUDIT in row:
                            times[name]["audit"].append(row[metrics.TIME_AUDIT])
                            cosines[name].append(row[metrics.JAGG_GRAD_COSINE])
            params_m, device = base_params_m(trainers["exact"]), str(trainers["exact"].accelerator.device)
    iteration_s = {name: min(times[name]["rollout"]) + min(times[name]["train"]) for name in setups}
    audit_s = {name: min(times[name]["audit"]) if times[name]["audit"] else None for name in setups}
    rows = []
    for name, config in configs.items():
        backward = config.backward
        rows.append({
            "section": "iteration", "setup": name, "model": model, "params_m": params_m,
            "mode": "exact" if backward.mode == "exact" else backward_label(backward).split()[0],
            "window": backward.window if backward.mode == "jagg" else 1, "joint": backward.joint,
            "frac": backward.frac, "backward": backward_label(backward),
            "trained_steps": trained_count(config.sampling.num_steps, config.grpo.timestep_fraction),
            "sde_every_step": not config.grpo.ode_after_trained,
            "reference": config.grpo.kl_reference if config.grpo.kl_beta > 0 else None,
            "seconds": iteration_s[name], "rollout_s": min(times[name]["rollout"]),
            "train_s": min(times[name]["train"]),
            "seconds_median": statistics.median(r + t for r, t in zip(times[name]["rollout"], times[name]["train"])),
            "speedup": iteration_s["exact"] / iteration_s[name],
            "whole_iteration_speedup": iteration_s["flow_grpo"] / iteration_s[name],
            "iterations": options.iterations, "seeds": list(options.seeds),
            "reward_final": statistics.mean(c[-1][1] for c in curves[name].values()), "curves": curves[name],
            "peak_mem_ratio": None, "peak_mem_basis": None, "grad_cosine": None, "grad_rel_err": None,
            "audit_s": audit_s[name], "audit_ratio": audit_s[name] / iteration_s[name] if audit_s[name] else None,
            "audit_cosine": statistics.mean(cosines[name]) if cosines[name] else None, "device": device})
    return rows


def run_bench(options: BenchOptions, threads: int = 2, log=print) -> list[dict]:
    """All sections for ``options``; returns the rows."""
    rows = []
    for index, model in enumerate(options.models if options.train_phase else []):
        variants = options.grid(index)
        log(f"[bench] {model}: train phase, {len(variants)} variants x {options.repeats} repeats")
        rows += bench_train_phase(model, variants, options, threads)
    if options.iterations and options.seeds:
        for model in options.models:
            log(f"[bench] {model}: {options.iterations} iterations x {len(options.seeds)} seeds, whole iterations: "
                "Flow-GRPO's default, exact, the default")
            rows += bench_iterations(model, options)
    if options.fidelity_rollouts:
        log(f"[bench] {options.models[0]}: fidelity along the trajectory, {options.fidelity_rollouts} rollouts")
        rows += [{**dict.fromkeys(ROW_KEYS), **row}
                 for row in fidelity_rows(bench_config(options.models[0], options.overrides),
                                             options.fidelity_rollouts)]
    return rows


# ----- output ---------------------------------------------------------------------------------
def format_tables(rows: list[dict]) -> str:
    """Markdown tables: train phase and routing, linearity per window, the train phase's rows as whole iterations
    (with the rollout), short trainings."""
    parts = []
    phase = [r for r in rows if r["section"] in ("train_phase", "routing")]
    if phase:
        parts.append(markdown_table(
            ["model", "params (M)", "mode", "W", "endpoints", "frac", "passes", "seconds", "speed-up",
             "peak mem (MB over base)", "mem ratio", "grad cosine", "grad rel err"],
            [[r["model"], f"{r['params_m']:g}", r["mode"], str(r["window"]), "joint" if r["joint"] else "seq",
              f"{r['frac']:g}", str(r["passes"]), f"{r['seconds']:.3f}", f"{r['speedup']:.2f}x",
              cell(r["peak_mem_mb"] - r["base_mem_mb"] if r["peak_mem_mb"] is not None else None, ".1f"),
              cell(r["peak_mem_ratio"], ".2f"), f"{r['grad_cosine']:.4f}", f"{r['grad_rel_err']:.4f}"]
             for r in phase]))
        linearity = {}
        for r in phase:
            if r["mode"] in ("cached", "cached_shared") and r["frac"] == 1 and r["joint"]:
                linearity.setdefault((r["model"], r["mode"], r["window"]), r["linearity"])
        parts.append("Linearity score per window, along the trajectory (noise -> data):\n\n" + markdown_table(
            ["model", "windows", "W", "scores"],
            [[m, "shared knots" if mode == "cached_shared" else "disjoint", str(w), " ".join(f"{s:.3f}" for s in sc)]
             for (m, mode, w), sc in linearity.items()]))
    timed = [r for r in phase if r.get("rollout_s") is not None]
    if timed:
        parts.append("Whole iterations on the same rollout batch (rollout + train phase; peak memory absolute):\n\n"
                     + markdown_table(
                         ["model", "mode", "W", "endpoints", "rollout s", "train s", "iteration s", "speed-up",
                          "rollout peak MB", "train peak MB"],
                         [[r["model"], r["mode"], str(r["window"]), "joint" if r["joint"] else "seq",
                           f"{r['rollout_s']:.3f}", f"{r['train_s']:.3f}", f"{r['iteration_s']:.3f}",
                           f"{r['iteration_speedup']:.2f}x", cell(r.get("rollout_peak_mem_mb"), ".0f"),
                           cell(r["peak_mem_mb"], ".0f")] for r in timed]))
    iteration = [r for r in rows if r["section"] == "iteration"]
    if iteration:
        parts.append("Whole iterations of short trainings of the default task (section 3); speed-up against the exact "
                     "backward with the default's rollout, and against Flow-GRPO's default:\n\n" + markdown_table(
                         ["model", "setup", "backward", "trained steps", "SDE", "reference", "rollout s", "train s",
                          "iteration s", "vs exact (default rollout)", "vs Flow-GRPO", "iteration s (median)",
                          "final reward (mean of seeds)", "audit s", "audit / iteration", "audit cosine"],
                         [[r["model"], SETUP_LABELS[r["setup"]], r["backward"], str(r["trained_steps"]),
                           "every step" if r["sde_every_step"] else "trained steps", r["reference"] or "-",
                           f"{r['rollout_s']:.3f}", f"{r['train_s']:.3f}", f"{r['seconds']:.3f}",
                           f"{r['speedup']:.2f}x", f"{r['whole_iteration_speedup']:.2f}x", f"{r['seconds_median']:.3f}",
                           f"{r['reward_final']:.4f}", cell(r.get("audit_s"), ".3f"), cell(r.get("audit_ratio"), ".1%"),
                           cell(r.get("audit_cosine"), ".4f")] for r in iteration]))
    fidelity = [r for r in rows if r["section"] == "fidelity"]
    if fidelity:
        parts.append("Fidelity along the trajectory (every step trained) and its predictors:\n\n"
                     + format_fidelity(fidelity).strip())
    return "\n\n".join(parts) + "\n"


def plot_rewards(rows: list[dict], path: str | Path) -> None:
    """Reward against wall-clock seconds of every seed's training, exact and JAGG."""
    iteration = [r for r in rows if r["section"] == "iteration" and r["model"] == rows[0]["model"]]
    series = [(f"{SETUP_LABELS[r['setup']]} ({r['backward']})", r["curves"]) for r in iteration]
    title = (f"{iteration[0]['model']}: rollout reward vs wall-clock ({iteration[0]['iterations']} iterations)"
             if iteration else "")
    plot_curves(series, title, "cumulative seconds (rollout + train)", "mean rollout reward", path)


def write_outputs(rows: list[dict], json_path=None, table_path=None, plot_path=None) -> str:
    """Write the JSON, the markdown table and the plot where asked; returns the table."""
    table = format_tables(rows)
    for path in (json_path, table_path, plot_path):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
    if json_path:
        Path(json_path).write_text(json.dumps(rows, indent=1))
    if table_path:
        Path(table_path).write_text(table)
    if plot_path:
        plot_rewards(rows, plot_path)
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jagg_core.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and iterations, W=5 on the larger models "
                        "(with --arch: W=2, 5 cached, no training)")
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--table", help="write the markdown tables here")
    parser.add_argument("--plot", help="write the reward-vs-seconds PNG here")
    parser.add_argument("--models", help=f"comma-separated models (default: {','.join(default_models())})")
    parser.add_argument("--repeats", type=int, help="timed repeats per variant")
    parser.add_argument("--iterations", type=int, help="iterations of each short training (0: skip)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    parser.add_argument("--no-train-phase", action="store_true", help="skip the train phase of every variant "
                        "(sections 1, 2, 4): only the whole iterations (and --fidelity)")
    parser.add_argument("--training", action="store_true", help="instead: full-length trainings of the first model's "
                        "task (default: the default preset) with the exact and its JAGG backward, same seeds 0, 1, 2: "
                        "held-out gain, wall clock and gain per minute with their spread (jagg_core.training_bench)")
    parser.add_argument("--setups", default="exact,default", help="with --training: the setups trained, of "
                        f"{','.join(SETUP_LABELS)} (flow_grpo: Flow-GRPO's default iteration, every step SDE, exact "
                        "backward, reference in the rollout; tree: the default with tree rollouts); default "
                        "exact,default")
    parser.add_argument("--fidelity", type=int, metavar="ROLLOUTS", help="also the per-window fidelity along the "
                        "trajectory and the Spearman correlation of the routing predictors with it, over ROLLOUTS "
                        "rollouts of the first model at noise levels 0.7 and 1.2 (jagg_core.fidelity_bench)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override of every run of the bench (repeatable), "
                        "e.g. train.gradient_checkpointing=true")
    real = parser.add_argument_group("real architectures", "one real model: " + ", ".join(arch_names()))
    real.add_argument("--arch", help="bench this architecture (its Hub model, or random weights with --random-weights)")
    real.add_argument("--random-weights", action="store_true",
                      help="the arch built from its shipped configs with random weights (model random:ARCH[@LAYERS])")
    real.add_argument("--layers", type=int,
                      help="transformer blocks of the random-weight model (default: the real depth)")
    real.add_argument("--resolution", type=int,
                      help=f"image side in pixels (default {ARCH_RESOLUTION['cuda']} on a GPU, "
                      f"{ARCH_RESOLUTION['cpu']} on a CPU)")
    real.add_argument("--quantize", choices=("none", "nf4", "int8"), help="model.quantize of the transformer")
    parser.add_argument("--memory-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quiet_libraries()
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    if args.memory_worker:
        memory_worker(args.memory_worker)
        return
    with exit_on_user_error(parser.prog):
        if args.training:
            run_training(args)
            return
        options = bench_options(args)
        run_and_report(options, args)


def run_training(args: argparse.Namespace) -> None:
    """``--training``: the trainings of :mod:`jagg_core.training_bench`, written to ``--json``/``--table``/``--plot``
    and printed."""
    model = args.models.split(",")[0] if args.models else EMBEDDED_MODEL
    setups = [name.strip() for name in args.setups.split(",") if name.strip()]
    unknown = [name for name in setups if name not in SETUP_LABELS]
    if unknown or not setups:
        raise UserError(f"--setups {args.setups}: choose from {', '.join(SETUP_LABELS)}")
    rows = training_rows(bench_config(model, args.overrides), setups=setups)
    table = format_training(rows)
    for path, write in ((args.json, lambda p: p.write_text(json.dumps(rows, indent=1))),
                        (args.table, lambda p: p.write_text(table)), (args.plot, lambda p: plot_training(rows, p))):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            write(Path(path))
    print(table)


def bench_options(args: argparse.Namespace) -> BenchOptions:
    """The :class:`BenchOptions` of the command line."""
    changes = {key: value for key, value in (("repeats", args.repeats), ("iterations", args.iterations),
                                             ("fidelity_rollouts", args.fidelity)) if value is not None}
    if args.no_memory:
        changes["memory"] = False
    if args.no_train_phase:
        changes["train_phase"] = False
    if args.arch or args.random_weights:
        if args.models:
            raise UserError("--models and --arch exclude each other")
        model = arch_model(args.arch, args.random_weights, args.layers)
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        overrides = arch_overrides(device_type, args.resolution, args.quantize) + args.overrides
        return arch_options(model, overrides, quick=args.quick, **changes)
    given = [flag for flag, value in (("--layers", args.layers), ("--resolution", args.resolution),
                                      ("--quantize", args.quantize)) if value is not None]
    if given:
        raise UserError(f"{', '.join(given)}: only with --arch NAME")
    if args.models:
        changes["models"] = args.models.split(",")
    changes["overrides"] = tuple(args.overrides)
    return BenchOptions.quick(**changes) if args.quick else BenchOptions(**changes)


def run_and_report(options: BenchOptions, args: argparse.Namespace) -> None:
    """Run the bench, write ``--json``/``--table``/``--plot``, print the tables and the machine's load."""
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    rows = run_bench(options, threads=args.threads, log=lambda line: print(line, file=sys.stderr, flush=True))
    table = write_outputs(rows, args.json, args.table, args.plot)
    print(table)
    print(f"{time.perf_counter() - start:.0f} s on {rows[0]['device'] if rows else 'cpu'}, "
          f"{torch.get_num_threads()} threads; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")


if __name__ == "__main__":
    main()
