"""The steps of the GPU check, each a function of :class:`~.common.CheckOptions` that returns its rows, and their
order of registration (:func:`all_steps`), which is the order of the steps of equal priority (:mod:`.ledger`)."""

from __future__ import annotations

import functools
import importlib.metadata
import math
import os
import re
import signal
import tempfile
import time
import traceback
from pathlib import Path

from ..image_size import parse_resolution
from .common import GB, CheckOptions, Step, one_line, torch_device
from .triage import triage_steps

TINY_MODELS = ("tiny-sd3", "tiny-flux", "tiny-qwen")
#: the tiny runs: every one in bf16 with 8-bit AdamW, then the base as named
TINY_BASE = ("train.iterations=2", "train.sample_every=2", "train.checkpoint_every=2", "model.dtype=bfloat16",
             "train.mixed_precision=bf16", "train.optimizer=adamw8bit")
RECIPES = {"bf16": (), "nf4": ("model.quantize=nf4",), "int8": ("model.quantize=int8",)}
#: a real-size whole iteration (rollout + train) per family at the real depth, and the base it needs to fit
BENCH_ARCHS = (("sd35-medium", None), ("flux-dev", None), ("qwen-image", "nf4"), ("flux2-klein-4b", None),
               ("z-image-turbo", None), ("wan21-t2v-1.3b", None))
#: the cost of quantization for training: the same iteration on each base of this family
QUANTIZE_ARCH, QUANTIZE_BASES = "sd35-medium", ("bf16", "int8", "nf4")
#: the real-size bench's window: W = 5, cached velocities, joint endpoints (the project's default backward)
BENCH_WINDOW = 5
#: the reduced bench's rollout batch (one prompt, two samples) and prompt set (two to train on, two held out: each
#: distinct prompt is encoded at set-up, by the real-width encoders)
REDUCED_BENCH_BATCH = ("grpo.prompts_per_iteration=1", "grpo.num_generations=2", "prompts.limit=2",
                       "prompts.eval_count=2")
#: the weightless reward of the measured memory runs
MEASURE_REWARD = "jpeg_compressibility"
LIBRARIES = ("torch", "diffusers", "transformers", "peft", "accelerate", "bitsandbytes", "torchao")
#: caps of the real-size steps, and of those of the 20B Qwen-Image models (40 GB of random weights to make, and
#: to quantize to NF4, before the first step)
MEMORY_CAP_S, BENCH_CAP_S, QWEN_CAP_S = 200, 240, 300
#: the simulated hang's cap under ``--reduced``
HANG_CAP_S = 3
#: GPU memory (GB) a tiny run may take beside other steps
TINY_GB = 2.0
#: memory steps of a preset's recipe with settings no preset of its card turns on, each its own step
#: ``memory-PRESET-VARIANT``: (preset, variant, config overrides, environment of its process). The allocator's
#: expandable segments (torch's ``PYTORCH_CUDA_ALLOC_CONF``) map freed blocks together: the reserved peak beside
#: the plain step's tells what fragmentation costs the card
MEMORY_VARIANTS = (("sd35-medium-pickscore-16gb", "offload", ("model.offload_text_encoders=true",), {}),
                   ("sd35-medium-pickscore-16gb", "expandable-segments", (),
                    {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}))


def memory_presets() -> list[str]:
    """The presets made for 16 and 24 GB cards (named ``...-16gb``, ``...-24gb``)."""
    from ..config import list_presets
    return [name for name in list_presets() if re.search(r"-(16|24)gb$", name)]


def all_steps(options: CheckOptions) -> list[Step]:
    """Every step, in the order of registration: the device, the crash triage (seconds each), the presets'
    memory recipes, the real-size whole iterations, the quantization's cost, the tiny runs; ``--reduced`` adds
    the simulated crash and hang after the device (they show the isolation on any machine)."""
    steps = [Step("device", "device", step_device, cap_s=30, reduced_cap_s=60)]
    if options.reduced:
        steps += [Step("simulate-crash", "simulated", simulate_crash, cap_s=30, reduced_cap_s=60),
                  Step("simulate-hang", "simulated", simulate_hang, cap_s=30, reduced_cap_s=HANG_CAP_S)]
    steps += triage_steps()
    memory_steps = [(preset, None, (), {}) for preset in memory_presets()] + list(MEMORY_VARIANTS)
    steps += [Step(memory_step_name(preset, variant), "memory",
                   functools.partial(step_memory, preset, variant, extra, env), env=env,
                   cap_s=QWEN_CAP_S if preset.startswith("qwen-image") else MEMORY_CAP_S, reduced_cap_s=300,
                   shares_gb=memory_step_gb(preset),
                   configs=functools.partial(memory_configs, preset, extra))
              for preset, variant, extra, env in memory_steps]
    steps += [Step(f"bench-{arch}", "bench", functools.partial(step_bench, arch, quantize),
                   cap_s=QWEN_CAP_S if arch.startswith("qwen-image") else BENCH_CAP_S, reduced_cap_s=300,
                   configs=functools.partial(bench_configs, arch, quantize)) for arch, quantize in BENCH_ARCHS]
    steps += [Step(f"quantize-{QUANTIZE_ARCH}-{base}", "quantize", functools.partial(step_quantize, base),
                   cap_s=180, reduced_cap_s=300,
                   configs=functools.partial(bench_configs, QUANTIZE_ARCH, None if base == "bf16" else base))
              for base in QUANTIZE_BASES]
    steps += [Step(model, "tiny", functools.partial(step_tiny, model), cap_s=60, reduced_cap_s=300,
                   shares_gb=TINY_GB, configs=functools.partial(tiny_configs, model)) for model in TINY_MODELS]
    return steps


def memory_step_name(preset: str, variant: str | None) -> str:
    return f"memory-{preset}" + (f"-{variant}" if variant else "")


def memory_step_gb(preset: str) -> float | None:
    """GPU memory a preset's memory step may take beside others: the card its name is made for (16 or 24 GB). None
    (alone) for a quantized base: its bf16 random weights pass through the host's memory and disk to be quantized
    (24 GB for FLUX.1, 40 GB for Qwen-Image), and two of them would fill the GPU machine's 64 GB disk."""
    from ..config import load_config
    if load_config(preset=preset).model.quantize != "none":
        return None
    return float(re.search(r"-(\d+)gb$", preset)[1])


def step_names(options: CheckOptions = CheckOptions()) -> list[str]:
    return [step.name for step in all_steps(options)]


def step_device(options: CheckOptions) -> list[dict]:
    """Whether CUDA is visible, the GPU and its memory, the library versions, and the temporary folder's free disk
    (a quantized recipe of a model built in memory is saved there first: a random Qwen-Image's 41 GB)."""
    import torch

    from ..host import free_disk
    row = {"step": "device", "status": "ok", "cuda": torch.cuda.is_available(),
           "versions": {name: _version(name) for name in LIBRARIES},
           "tmp_free_gb": free_disk(Path(tempfile.gettempdir())) / GB}
    if row["cuda"]:
        free, total = torch.cuda.mem_get_info()
        row.update(gpu=torch.cuda.get_device_name(), gpu_total_gb=total / GB, gpu_free_gb=free / GB,
                   capability=".".join(map(str, torch.cuda.get_device_capability())),
                   cuda_version=torch.version.cuda, cudnn_version=torch.backends.cudnn.version(),
                   bf16=torch.cuda.is_bf16_supported())
        try:
            row["cuda_context_gb"] = _cuda_context_gb()
        except Exception as err:  # a figure, not the device's health: the check must go on to its other steps
            row["cuda_context_error"] = one_line(err)
    elif options.reduced:
        row.update(reason="no GPU (--reduced runs on the CPU)")
    else:
        row.update(status="failed", reason="CUDA is not visible: torch.cuda.is_available() is False")
    return [row]


def _cuda_context_gb() -> float:
    """GB this process holds on the GPU outside torch's allocator once the libraries a run calls are loaded (the CUDA
    context, cuBLAS's and cuDNN's handles and workspaces, the attention kernels): the device's used memory less the
    allocator's reserved bytes, after a bf16 matmul, an attention and a convolution, each forward and backward, under
    the product's default kernel settings. What :data:`~jagg_core.memory_plan.CUDA_CONTEXT_GB` stands for; the
    device step runs alone, so the device's used memory is this process's."""
    import torch

    from ..config import ModelConfig
    from ..kernels import apply_kernel_settings
    apply_kernel_settings(ModelConfig())
    functional = torch.nn.functional
    x = torch.randn(4, 256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    image = torch.randn(1, 8, 32, 32, device="cuda", requires_grad=True)
    kernel = torch.randn(8, 8, 3, 3, device="cuda", requires_grad=True)
    heads = x.view(1, 4, 256, 256)[..., :128]
    loss = (x @ x).float().sum() + functional.scaled_dot_product_attention(heads, heads, heads).float().sum() + \
        functional.conv2d(image, kernel, padding=1).sum()
    loss.backward()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / GB


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def simulate_crash(options: CheckOptions) -> list[dict]:
    """Dies as a kernel fault kills a process (SIGSEGV), before it returns a row."""
    print("simulate-crash: killing this process with SIGSEGV", flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)
    return []


def simulate_hang(options: CheckOptions) -> list[dict]:
    """Never returns (a kernel that hangs), until its cap kills it."""
    print("simulate-hang: waiting for a signal that never comes", flush=True)
    while True:
        signal.pause()


def tiny_configs(model: str, options: CheckOptions) -> dict:
    """The configs of the tiny ``model``'s runs, by base (:data:`RECIPES`)."""
    from ..config import load_config
    return {recipe: load_config(preset="tiny-sd3", overrides=[f"model.name={model}", *TINY_BASE, *overrides])
            for recipe, overrides in RECIPES.items()}


def step_tiny(model: str, options: CheckOptions) -> list[dict]:
    """2-iteration runs of the tiny ``model`` for each of :data:`RECIPES`."""
    from ..errors import UserError
    from ..memory_meter import PeakMemory
    from ..rundir import RunDirectory
    from ..run import train
    from .. import metrics
    device = torch_device()
    rows = []
    for recipe, config in tiny_configs(model, options).items():
        row = {"step": model, "recipe": recipe, "status": "ok"}
        rows.append(row)
        if recipe == "nf4" and device.type != "cuda":
            row.update(status="skipped", reason="NF4 (bitsandbytes) needs a CUDA GPU")
            continue
        with tempfile.TemporaryDirectory() as run_dir:
            meter = PeakMemory(device).start()
            start = time.perf_counter()
            try:
                train(config, Path(run_dir), resume=False)
            except Exception as err:  # one recipe's failure is its row; the next recipe still runs
                traceback.print_exc()
                row.update(status="failed", reason=str(err) if isinstance(err, UserError) else one_line(err))
                continue
            last = RunDirectory(run_dir).read_metrics()[-1]
            row.update(seconds=time.perf_counter() - start, peak_gb=cuda_peak_gb(meter.stop()),
                       loss=last.get(metrics.LOSS), reward=last.get(metrics.REWARD_MEAN),
                       eval_reward=last.get(metrics.EVAL_REWARD_MEAN))
            if not all(math.isfinite(row[key]) for key in ("loss", "reward", "eval_reward")):
                row.update(status="failed", reason="a non-finite loss or reward")
    return rows


def bench_rows(arch: str, options: CheckOptions, layers: int | None = None, quantize: str | None = None,
               jagg_only: bool = False, repeats: int = 2, warmup: int = 1, overrides: tuple[str, ...] = ()
               ) -> list[dict]:
    """The real-size bench of ``arch`` (random weights, ``layers`` blocks or the real depth, 512 px on a GPU,
    gradient checkpointing, on a ``quantize`` base, with config ``overrides``): exact and JAGG W =
    :data:`BENCH_WINDOW` cached joint on one rollout batch; ``jagg_only`` keeps JAGG's row (exact still runs: the
    speed-ups and cosine are against it)."""
    from ..bench import EXACT, BenchOptions, Variant, arch_model, bench_train_phase
    from ..quiet import log_to_stderr
    device = torch_device()
    model = arch_model(arch, random_weights=True, layers=layers)
    overrides = bench_overrides(options, quantize, overrides)
    bench = BenchOptions(models=[model], overrides=tuple(overrides), repeats=repeats, warmup=warmup,
                         memory=device.type == "cuda", iterations=0)
    jagg = Variant("cached", window=BENCH_WINDOW, joint=True)
    rows = bench_train_phase(model, [EXACT, jagg], bench, options.threads, log=log_to_stderr)  # into STEP.log
    resolution = next(parse_resolution(o.split("=")[1]).config_value() for o in overrides
                      if o.startswith("sampling.resolution="))
    return [{"status": "ok", "arch": arch, "resolution": resolution, "quantize": quantize or "none", **row}
            for row in rows if not jagg_only or row["mode"] != "exact"]


def bench_overrides(options: CheckOptions, quantize: str | None, overrides: tuple[str, ...] = ()) -> list[str]:
    """The config overrides of :func:`bench_rows`: the real-size bench's on this device, on a ``quantize`` base,
    with gradient checkpointing, then ``options``' and ``overrides``."""
    from ..bench import arch_overrides
    return [*arch_overrides(options.device_type, options.resolution, quantize), "train.gradient_checkpointing=true",
            *options.overrides, *(REDUCED_BENCH_BATCH if options.reduced else ()), *overrides]


def bench_configs(arch: str, quantize: str | None, options: CheckOptions) -> dict:
    """The config of :func:`bench_rows` for ``arch`` on a ``quantize`` base, at the check's depth."""
    from ..bench import arch_model
    from ..bench.variants import bench_config
    return {"bench": bench_config(arch_model(arch, random_weights=True, layers=options.layers),
                                  bench_overrides(options, quantize))}


def _needs_cuda(quantize: str | None) -> str | None:
    """Why a ``quantize`` base cannot run on this device (None: it can)."""
    return "NF4 (bitsandbytes) needs a CUDA GPU" if quantize == "nf4" and torch_device().type != "cuda" else None


def step_bench(arch: str, quantize: str | None, options: CheckOptions) -> list[dict]:
    """A whole iteration of ``arch`` at its real depth (:func:`bench_rows`), on the base it needs to fit
    (``quantize``)."""
    if reason := _needs_cuda(quantize):
        return [{"step": f"bench-{arch}", "status": "skipped", "reason": reason}]
    return [{**row, "step": f"bench-{arch}"} for row in bench_rows(arch, options, options.layers, quantize)]


def step_quantize(base: str, options: CheckOptions) -> list[dict]:
    """JAGG's whole iteration of :data:`QUANTIZE_ARCH` on a ``base`` base (bf16, int8 or NF4): seconds and peak."""
    quantize = None if base == "bf16" else base
    name = f"quantize-{QUANTIZE_ARCH}-{base}"
    if reason := _needs_cuda(quantize):
        return [{"step": name, "status": "skipped", "reason": reason}]
    return [{**row, "step": name} for row in bench_rows(QUANTIZE_ARCH, options, options.layers, quantize,
                                                        jagg_only=True)]


def memory_recipe(preset: str, options: CheckOptions, extra: tuple[str, ...] = ()):
    """The preset's config with the ``extra`` overrides at real size with random weights, shrunk where the memory
    does not depend on it:
    one prompt with one rollout chunk of samples (at least 2), the same micro-batch, an eval of one chunk
    of 4 steps, the weightless reward :data:`MEASURE_REWARD` and no judges, 2 iterations (the second is measured,
    so the first iteration's doctor is off: on a GPU its audit is whole backward passes at real size),
    one encoding batch of training prompts (the set-up's peak encodes one batch; its host cache is apart)."""
    from ..archs import arch_for_model
    from ..config import load_config
    from ..models.base import ENCODE_BATCH
    config = load_config(preset=preset)
    arch = arch_for_model(config.model.name)
    samples = config.grpo.num_generations * config.grpo.prompts_per_iteration
    micro = math.ceil(samples / config.train.gradient_accumulation_steps)
    chunk = config.sampling.chunk(samples)
    generations = max(2, chunk)
    layers = f"@{options.layers}" if options.layers else ""
    overrides = [f"model.name=random:{arch}{layers}", f"rewards=[{{name: {MEASURE_REWARD}}}]", "eval.judges=[]",
                 "train.doctor=false", "grpo.prompts_per_iteration=1", f"grpo.num_generations={generations}",
                 f"train.gradient_accumulation_steps={math.ceil(generations / micro)}",
                 f"prompts.eval_count={min(chunk, generations)}", "sampling.eval_num_steps=4",
                 "train.iterations=2", "train.sample_every=2", "train.checkpoint_every=2",
                 f"prompts.limit={ENCODE_BATCH}", *extra, *options.overrides]
    if options.resolution:  # an editing preset's input images too
        overrides += [f"sampling.resolution={options.resolution}", f"model.condition_resolution={options.resolution}"]
    return load_config(preset=preset, overrides=overrides)


def memory_configs(preset: str, extra: tuple[str, ...], options: CheckOptions) -> dict:
    return {"recipe": memory_recipe(preset, options, extra)}


def cuda_peak_gb(meter) -> float | None:
    """A finished :class:`~jagg_core.memory_meter.PeakMemory`'s peak in GB on a GPU; None on a CPU (its figures there
    are not the GPU's)."""
    return meter.peak / GB if meter.device.type == "cuda" else None


def step_memory(preset: str, variant: str | None, extra: tuple[str, ...], env: dict[str, str],
                options: CheckOptions) -> list[dict]:
    """Planned against measured peak memory of ``preset``'s recipe with the ``extra`` overrides (:func:`memory_recipe`),
    in a process with the ``env`` variables (a ``variant`` of the preset when there are any)."""
    from ..config import load_config
    from ..memory_meter import PeakMemory, basis, measured_peak
    from ..memory_plan import SETUP_PHASE, plan_memory
    from ..quiet import quiet_libraries
    from ..trainer import Trainer
    device = torch_device()
    config = memory_recipe(preset, options, extra)
    row = {"step": memory_step_name(preset, variant), "status": "ok", "preset": preset, "model": config.model.name,
           "quantize": config.model.quantize, "resolution": config.sampling.resolution}
    if extra:
        row["overrides"] = list(extra)
    if env:  # as this process has them (the driver sets them)
        row["env"] = {key: os.environ.get(key) for key in env}
    if reason := _needs_cuda(config.model.quantize):
        return [{**row, "status": "skipped", "reason": reason}]
    plan = plan_memory(config)
    training_phases = {p: t for p, t in plan.totals.items() if p != SETUP_PHASE}
    row.update(planned_setup_gb=plan.totals[SETUP_PHASE] / GB, planned_gb=max(training_phases.values()) / GB,
               planned_phase=max(training_phases, key=training_phases.get),
               preset_planned_gb=plan_memory(load_config(preset=preset, overrides=list(extra))).total / GB)
    quiet_libraries()
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(config, run_dir)
        with PeakMemory(device) as setup:
            trainer.setup()
        row["measured_setup_gb"] = cuda_peak_gb(setup)
        row["measured_gb"] = measured_peak(trainer) / GB
        if device.type == "cuda":  # what the allocator held for it: the peak, its cached blocks and fragments
            import torch
            row["measured_reserved_gb"] = torch.cuda.max_memory_reserved(device) / GB
        trainer.close()
    row["planned_over_measured"] = row["planned_gb"] / row["measured_gb"]
    row["basis"] = basis(device, cpu="tensors")
    return [row]


def run_step(name: str, options: CheckOptions) -> list[dict]:
    step = next((s for s in all_steps(options) if s.name == name), None)
    if step is None:
        raise ValueError(f"unknown step {name}")
    return step.run(options)
