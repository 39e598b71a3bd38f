"""The expected peak accelerator memory of a run, by part, from the model's configs alone (no weights).

    python -m jagg_core.run --preset P --plan [--gpu-memory GB]

How it is computed:

- **Weights**: every component is instantiated on the ``meta`` device from its config (the shipped configs of
  :mod:`jagg_core.archs` for the known models, a local folder's, or the Hub's ``config.json`` files), so
  parameter counts are exact. Bytes per parameter follow ``model.dtype``; with ``model.quantize`` the linear
  layers of the transformer take 0.516 (NF4 with double quantization: 4 bits, one 8-bit scale per 64
  weights, one float32 per 256 scales) or 1 byte (int8, plus a 2-byte scale per output channel).
- **LoRA**: the adapter is added to the meta transformer (peft), so its size is exact: float32 weights,
  gradients, AdamW's two moments (float32, or 1 byte each with ``adamw8bit``) and the EMA copy.
- **Activations** are measured, not guessed: the family's own velocity call (CFG included) and VAE decode
  run on meta tensors at the run's batch sizes and resolution, and :class:`~jagg_core.memory_meter.LiveBytes`
  follows every tensor they create and free; its high-water mark is the phase's transient. The backward runs the
  forward with grad and the backward itself (with gradient checkpointing when on), ``2 x`` the micro-batch when JAGG's
  endpoints are joint. Mixed precision runs these in the compute dtype. A quantized base computes with its weights
  dequantized to bf16: NF4 one weight at a time, int8 a copy per linear that autograd keeps for the backward
  (:func:`_int8_dequantizing`). A stack of identical blocks is traced at 2 and 4 blocks and extended linearly to
  its depth (:func:`_traced_in_depth`): the same bytes in seconds (an int8 base's backward: at its full depth).
  The meta ops run on torch's C++ meta kernels where they have one (:mod:`jagg_core.meta_kernels`): the same
  bytes in half the time.
- **Fixed parts**: the rollout batch's trajectory (latents, velocities, reference velocities, float32) and
  its conditioning; the reward and judge models (their catalog sizes and dtypes; no judge with
  ``eval.judges_on_cpu``). The decoded images go to host memory as they are decoded
  (:meth:`~jagg_core.models.base.FlowModel.decode_to_host`): with ``model.vae_slicing`` the decode phase holds one
  sample's, else the batch's.
- **Host**: with ``model.cache_text_embeddings`` every distinct prompt's conditioning stays in each process's
  host memory and in the run folder (:func:`~jagg_core.models.text_embeddings.bytes_per_prompt` a prompt); with
  ``eval.judges_on_cpu`` each process holds the judges' models there too (float32);
  :func:`check_host` says whether this machine holds them.
- **Phases**: set-up, rollout forward, VAE decode, backward. The peak is the largest phase's resident parts plus
  its transient. The set-up holds first the text encoders alone while they encode the prompts (with the VAE, which
  encodes them on the device, where a prompt row has input images: editing and image-to-video), then, once they have
  left, the resident parts but the optimizer's states (made by its first step), the judges among them (they load
  after the base model): its peak is the larger.

GB are 10^9 bytes (a "16 GB" card has 16 GiB = 17.2 GB, so a plan at 16 GB leaves it ~1 GB of margin).
Not counted: the run's CUDA context (outside ``max_memory_allocated``; whether a plan fits a GPU,
:func:`fits`, adds :data:`CUDA_CONTEXT_GB` for it), allocator fragmentation, and reward models other than the
catalog's defaults. Text-encoder activations at set-up are estimated from
their widths (one layer's largest tensors); their weights dominate that phase. A run's measured peak, which the
plan is checked against, is :func:`~jagg_core.memory_meter.measured_peak`.
"""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from unittest import mock

import torch

from .algorithms import ALGORITHMS
from .config import RunConfig, with_overrides
from .download import amount
from .errors import UserError
from .gpus import GB
from .image_size import ImageSize
from .judges import check_judges_room, cpu_judges
from .memory_meter import LiveBytes
from .meta_kernels import cpp_meta_kernels
from .models import DTYPES, family_for
from .models.base import ENCODE_BATCH, NEGATIVE, FlowModel
from .models.quantize import DENOISER_COMPONENTS, transformer_dtype
from .models.meta import META, meta_pipeline
from .models.text_embeddings import bytes_per_prompt, check_cache_room
from .placement import most_trained_steps
from .preflight import model_family
from .prompts import run_prompts
from .rewards.catalog import CPU_DTYPE, reward_entry
from .rewards.model_size import ScoringModelSize, scoring_model_size

#: bytes per weight of a quantized linear layer (see the module docstring)
QUANTIZED_BYTES = {"nf4": 0.5 + 1 / 64 + 4 / (64 * 256), "int8": 1.0}
#: the largest single accelerator on sale (GB); a plan above it cannot run on one
LARGEST_GPU_GB = 192
#: GPU memory a run's own CUDA context takes, outside torch's allocator and so outside the plan (GB): what the GPU
#: check read on an H200 (150.11 GB in all, 149.56 GB free once its process had made its context; docs/gpu). The
#: device step now also reads it with cuBLAS, cuDNN and attention loaded (``cuda_context_gb``); a test holds this
#: figure to at least that one
CUDA_CONTEXT_GB = 0.55
#: the phase in which the prompts are encoded, before training
SETUP_PHASE = "set-up"




# ----- the plan ------------------------------------------------------------------------------------------
def _bytes(module: torch.nn.Module | None) -> int:
    if module is None:
        return 0
    return sum(p.numel() * p.element_size() for p in module.parameters()) + \
        sum(b.numel() * b.element_size() for b in module.buffers())


def _count(number: int) -> str:
    """``2.24 B``, ``84.0 M``, ``52.1 k``."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if number >= scale:
            return f"{number / scale:.2f} {unit}" if unit == "B" else f"{number / scale:.1f} {unit}"
    return str(number)


def _params(module: torch.nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _transformer_bytes(transformer: torch.nn.Module, quantize: str, element_size: int) -> int:
    """Weights and buffers (SD3's position table: 0.45 GB in bf16) of the frozen transformer (LoRA excluded) in
    ``element_size`` bytes, the linear layers' weights quantized with ``quantize``."""
    total = 0
    for name, module in transformer.named_modules():
        if "lora_" in name:
            continue
        total += sum(buffer.numel() for buffer in module.buffers(recurse=False)) * element_size
        for pname, param in module.named_parameters(recurse=False):
            count = param.numel()
            if quantize != "none" and isinstance(module, torch.nn.Linear) and pname == "weight":
                total += count * QUANTIZED_BYTES[quantize] + (2 * param.shape[0] if quantize == "int8" else 0)
            else:
                total += count * element_size
    return int(total)


@dataclass
class MemoryPlan:
    """Bytes of each resident part during training, of each phase's transient, and the peak."""

    model: str
    family: str
    size: ImageSize
    resident: dict[str, float] = field(default_factory=dict)
    #: of the resident bytes, those the optimizer's first step makes (AdamW's states): not there at set-up
    optimizer_states: float = 0.0
    #: of the resident bytes, those only training holds: the optimizer's states, an EMA, a lagging copy of the LoRA
    training_state: float = 0.0
    #: the prompt encoders' weights on the device while they encode, and whether they stay there (resident: a run
    #: without the text-embedding cache)
    encoder_bytes: float = 0.0
    encoders_stay: bool = False
    #: of the resident bytes, the rewards' and the judges' models on the device
    scorer_bytes: float = 0.0
    #: the prompts' encoding at set-up (the text encoders and their activations)
    setup: dict[str, float] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)       # transient of each training phase
    phase_parts: dict[str, float] = field(default_factory=dict)  # extra resident of each phase (trajectory, ...)
    #: the text-embedding cache's distinct prompts (0: no cache) and bytes a prompt, in each process's host memory
    #: and on the run folder's disk
    cached_prompts: int = 0
    bytes_per_cached_prompt: int = 0
    #: the judges on the CPU (``eval.judges_on_cpu``) by name and the size of each one's model, in each process's
    #: host memory (:func:`~jagg_core.judges.cpu_judges`)
    host_judges: dict[str, ScoringModelSize] = field(default_factory=dict)
    #: the LoRA's trainable parameters
    lora_params: int = 0
    #: each phase's traced transient by what it depends on (:func:`_trace_key`), shared with the plans that
    #: :func:`cheapest_fit` makes from this one: a change that leaves a phase alone does not trace it again
    traces: dict[tuple, int] = field(default_factory=dict, repr=False, compare=False)

    @property
    def host_cache(self) -> int:
        return self.cached_prompts * self.bytes_per_cached_prompt

    def phase_total(self, phase: str) -> float:
        return sum(self.resident.values()) + self.phase_parts.get(phase, 0.0) + self.phases[phase]

    @property
    def totals(self) -> dict[str, float]:
        totals = {phase: self.phase_total(phase) for phase in self.phases}
        totals[SETUP_PHASE] = max(sum(self.setup.values()), self.setup_resident)
        return totals

    @property
    def setup_resident(self) -> float:
        """Bytes on the device at the end of set-up: the resident parts but the optimizer's states."""
        return sum(self.resident.values()) - self.optimizer_states

    def sampling_floor(self, scoring: bool = False) -> float:
        """Bytes that sampling with the run's model and adapter needs on the device at the least (Try it, evaluate:
        no optimizer, one sample at a time), before any activation: the prompt encoders' weights while they encode,
        then the resident parts but the prompt encoders and what only training holds (``training_state``) and,
        unless ``scoring``, the rewards and judges."""
        after = sum(self.resident.values()) - self.encoders_stay * self.encoder_bytes - self.training_state
        return max(self.encoder_bytes, after - (0.0 if scoring else self.scorer_bytes))

    @property
    def peak_phase(self) -> str:
        return max(self.totals, key=self.totals.get)

    @property
    def total(self) -> float:
        return max(self.totals.values())

    def table(self) -> str:
        """The plan as text: the parts, the phases, the peak (GB = 10^9 bytes)."""
        lines = [f"Memory plan: {self.model} ({self.family}, {self.size.config_value()} px), GB of accelerator memory",
                 "  resident during training:"]
        lines += [f"    {name:<58} {size / GB:8.2f}" for name, size in self.resident.items()]
        lines.append("  set-up (prompts encoded, text encoders then released):")
        lines += [f"    {name:<58} {size / GB:8.2f}" for name, size in self.setup.items()]
        lines.append(f"    {'then the resident parts but the optimizer states':<58} {self.setup_resident / GB:8.2f}")
        lines.append("  phases (resident + the phase's own tensors + its transient activations):")
        for phase in self.phases:
            extra = self.phase_parts.get(phase, 0.0)
            lines.append(f"    {phase:<42} +{extra / GB:6.2f} +{self.phases[phase] / GB:6.2f} = "
                         f"{self.phase_total(phase) / GB:6.2f}")
        lines.append(f"  peak: {self.total / GB:.2f} GB ({self.peak_phase})")
        if self.host_judges or self.cached_prompts:
            disk = ", and disk in the run folder" if self.cached_prompts else ""
            lines.append(f"  host memory of each process{disk}:")
        for name, size in self.host_judges.items():
            lines.append(f"    {f'judge {name} on the CPU ({size.describe()}, {CPU_DTYPE})':<58} "
                         f"{size.cpu_bytes / GB:8.2f}")
        if self.cached_prompts:
            lines.append(f"    {f'text-embedding cache ({self.cached_prompts} prompts)':<58} {self.host_cache / GB:8.2f}")
        return "\n".join(lines)


def _flash_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **_):
    """Attention as a GPU's flash / memory-efficient kernels hold it: the output and one float per query row,
    never the score matrix (which the meta device's math fallback would make). Stands in for
    ``scaled_dot_product_attention`` while a plan traces: its result is meta, only its memory counts."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal,
                                                                      scale=scale)[0]


def _traced(run, ignore) -> int:
    """High-water mark of the tensors ``run()`` creates (bytes), with attention counted as on a GPU."""
    meter = LiveBytes(ignore=ignore)
    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", _flash_attention), meter:
        run()
    return meter.peak


def _uniform_stacks(transformer: torch.nn.Module) -> dict[str, torch.nn.ModuleList]:
    """The transformer's stacks of 5 or more blocks of one kind (one class, the same parameter shapes): FLUX's two
    stacks, Qwen-Image's, Wan's, Z-Image's main stack; not SD3.5-Medium's, whose dual-attention blocks and last
    (context-free) block differ from its other blocks."""
    def kind(block: torch.nn.Module) -> tuple:
        return type(block), tuple((name, tuple(p.shape)) for name, p in block.named_parameters())
    return {name: blocks for name, blocks in transformer.named_children()
            if isinstance(blocks, torch.nn.ModuleList) and len(blocks) >= 5 and len({kind(b) for b in blocks}) == 1}


def _traced_in_depth(run, ignore, transformer: torch.nn.Module, backward: bool) -> int:
    """:func:`_traced` of ``run()`` through ``transformer``, its uniform stacks (:func:`_uniform_stacks`) cut short:
    seconds instead of a minute on a CPU for Qwen-Image's 60 blocks; the same bytes as tracing every block on every
    shipped preset.

    Without grad (``backward`` false) a block's tensors are freed before the next block runs, so the peak is that of
    the stacks cut to their first 2 blocks, ``peak(2)``. With grad, each block of a stack keeps the same bytes for
    the backward, so the peak grows linearly in the stack's depth n_s:

        peak = peak(2) + sum_s (n_s - 2) * (peak(stack s at 4) - peak'(2)) / 2

    where ``peak'(2)`` is a second trace at 2 blocks: the first also holds what a model makes on its first call and
    keeps (Qwen-Image's rotary tables), which a deep model makes once, not per block. The slope is measured beyond
    the first 2 blocks and over 2 blocks: two neighbours in the backward at once may cost once more, and
    checkpointed blocks may alternate in what they add."""
    stacks = _uniform_stacks(transformer)
    if not stacks:
        return _traced(run, ignore)

    def peak_with(depths: dict[str, int]) -> int:
        for name, blocks in stacks.items():
            setattr(transformer, name, torch.nn.ModuleList(list(blocks)[:depths.get(name, 2)]))
        try:
            return _traced(run, ignore)
        finally:
            for name, blocks in stacks.items():
                setattr(transformer, name, blocks)

    first = peak_with({})
    if not backward:
        return first
    again = peak_with({})
    return first + sum((len(blocks) - 2) * (peak_with({name: 4}) - again) // 2 for name, blocks in stacks.items())


def _text_encoder_activations(encoder: torch.nn.Module, tokens: int, element: int) -> int:
    """A text encoder's inference transient at set-up: one layer's widest tensors for :data:`ENCODE_BATCH` prompts
    (hidden states in and out, the feed-forward's inner width, the attention scores)."""
    config = getattr(encoder.config, "text_config", encoder.config)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "d_model")
    inner = getattr(config, "intermediate_size", None) or getattr(config, "d_ff", 4 * hidden)
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "num_heads")
    return ENCODE_BATCH * tokens * (2 * hidden + 2 * inner + heads * tokens) * element


def _input_images_encoding(model: FlowModel, cfg: RunConfig) -> int:
    """The VAE's transient while it encodes :data:`ENCODE_BATCH` prompt rows' input images at
    ``model.condition_resolution`` (one image at a time under ``model.vae_slicing``), traced on the meta VAE."""
    vae = model.pipe.vae
    size = cfg.model.condition_size
    pixels = torch.zeros((ENCODE_BATCH, 3, size.height, size.width), dtype=vae.dtype, device=vae.device)

    def run() -> None:
        with torch.no_grad():
            model.input_pixel_latents(pixels)
    return _traced(run, [*vae.parameters(), *vae.buffers()])


def _meta_model(cfg: RunConfig, dtype: torch.dtype | None = None) -> FlowModel:
    """The run's flow model on the meta device, from its configs alone, its weights in ``dtype`` (None: as built)."""
    pipe = meta_pipeline(cfg.model.name, cfg.model.revision)
    family_class = family_for(type(pipe).__name__, cfg.model)
    if dtype is not None:
        with META:
            pipe = pipe.to(dtype=dtype)
    placed = cfg.model.model_copy(update={"offload_text_encoders": False})  # the plan counts an offload itself
    return family_class(pipe, placed, META, num_frames=cfg.sampling.num_frames)


def _offloaded_elements(encoders: list[torch.nn.Module]) -> int:
    """Elements the text encoders hold on the device under ``model.offload_text_encoders`` (accelerate's
    ``cpu_offload``): their buffers, which stay there, and the largest of their modules' own parameters, which come
    one module at a time as it runs."""
    largest = max((sum(p.numel() for p in module.parameters(recurse=False))
                   for encoder in encoders for module in encoder.modules()), default=0)
    return largest + sum(b.numel() for encoder in encoders for b in encoder.buffers())


def _text_cache(cfg: RunConfig, model: FlowModel) -> tuple[int, int]:
    """The run's text-embedding cache: its distinct prompts (training and eval) and the bytes of one."""
    train, held_out = run_prompts(cfg.prompts)
    return len(dict.fromkeys(train + held_out)), bytes_per_prompt(model)


def check_text_cache_before_download(config: RunConfig, run_dir: Path, processes: int = 1) -> None:
    """Refuse, in one line, a text-embedding cache this host cannot hold (:func:`check_cache_room`), sized from
    the model's configs alone, so that a run learns it before it downloads the weights (the trainer checks again
    with the loaded model, for a model that needs no download)."""
    if config.model.cache_text_embeddings:
        prompts, per_prompt = _text_cache(config, _meta_model(config))
        check_cache_room(per_prompt, prompts, run_dir, processes)


def _trace_key(phase: str, cfg: RunConfig, batch: int, compute: torch.dtype) -> tuple:
    """What ``phase``'s trace depends on: the meta model (the model's settings but where the text encoders live; the
    VAE's tiling and slicing only for the decode, the transformer's quantization not for it; the ``compute`` dtype,
    the LoRA), its input's shape (``batch``, resolution, frames) and, for the backward, checkpointing. The rollout
    forward, traced before the backward on the same meta model, leaves no state that depends on its batch size
    (Qwen-Image keeps its rotary tables by resolution), so a smaller rollout chunk keeps the backward's key; the VAE
    decode leaves none in the transformer."""
    unused = {"offload_text_encoders"} | ({"quantize"} if phase == "VAE decode" else {"vae_tiling", "vae_slicing"})
    checkpointing = cfg.train.gradient_checkpointing if phase == "backward" else None
    return (phase, cfg.model.model_dump_json(exclude=unused), cfg.lora.model_dump_json(), str(compute),
            checkpointing, cfg.sampling.resolution, cfg.sampling.num_frames, batch)


@cpp_meta_kernels()
def plan_memory(config: RunConfig, traces: dict[tuple, int] | None = None, trace: bool = True,
                lora_params: int | None = None) -> MemoryPlan:
    """The memory plan of ``config`` (see the module docstring); ``traces``: an earlier plan's
    :attr:`MemoryPlan.traces`, to reuse and extend. ``trace`` False: the phases' activations are left at 0
    (no tracing, a fraction of a second), so the plan's total is a floor of the traced plan's; with ``lora_params``
    too (:attr:`MemoryPlan.lora_params` of a plan of the same model and ``lora`` settings) it adds no LoRA to its
    meta model (peft's injection is most of such a plan's time: a second for FLUX's 500 linear layers)."""
    cfg = config
    forward_process = ALGORITHMS[cfg.train.algorithm] if cfg.train.algorithm != "grpo" else None
    dtype = DTYPES[cfg.model.dtype]
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.mixed_precision)
    compute = autocast or dtype
    if cfg.model.quantize != "none":
        compute = torch.bfloat16
    model = _meta_model(cfg, compute)
    model.check_size(cfg.sampling.size)
    pipe, transformer = model.pipe, model.transformer
    element = torch.tensor([], dtype=dtype).element_size()
    plan = MemoryPlan(cfg.model.name, model.family, cfg.sampling.size,
                      traces={} if traces is None else traces)

    # ----- resident weights
    weight_size = transformer_dtype(cfg.model.quantize, dtype).itemsize
    quant = f", {cfg.model.quantize}" if cfg.model.quantize != "none" else ""
    trained = [id(denoiser) for denoiser in model.trained_transformers]
    for name, denoiser in zip(DENOISER_COMPONENTS, model.denoisers):  # the trained one(s), and a frozen other expert
        role = ("transformer" if denoiser is transformer else name) if id(denoiser) in trained else "other expert"
        plan.resident[f"{role} ({_count(_params(denoiser))} params, {cfg.model.dtype}{quant})"] = \
            _transformer_bytes(denoiser, cfg.model.quantize, weight_size)
    vae_bytes = _params(pipe.vae) * element
    plan.resident[f"VAE ({_count(_params(pipe.vae))}, {cfg.model.dtype})"] = vae_bytes
    encoders = model.text_encoders
    encoder_names = " + ".join(type(e).__name__.removesuffix("Model").removesuffix("ForConditionalGeneration")
                               .removesuffix("ForCausalLM") for e in encoders)
    if cfg.model.offload_text_encoders:  # one module's weights on the device at a time
        encoder_bytes = _offloaded_elements(encoders) * element
        encoder_names += ", offloaded: 1 layer"
    else:
        encoder_bytes = sum(_params(e) for e in encoders) * element
    plan.encoder_bytes, plan.encoders_stay = encoder_bytes, not cfg.model.cache_text_embeddings
    if plan.encoders_stay:
        plan.resident[f"text encoders ({encoder_names})"] = encoder_bytes
    device_judges = [] if cfg.eval.judges_on_cpu else cfg.eval.judges
    plan.host_judges = cpu_judges(cfg)
    for role, spec in [*(("reward", spec) for spec in cfg.rewards), *(("judge", spec) for spec in device_judges)]:
        dtype, size = reward_entry(spec.name).device_dtype, scoring_model_size(spec.name, spec.options)
        if size.params:
            plan.resident[f"{role} {spec.name} ({size.describe()}, {dtype})"] = size.bytes_in(dtype)
            plan.scorer_bytes += size.bytes_in(dtype)

    if trace or lora_params is None:
        lora = model.add_lora(cfg.lora)
        lora_params = sum(p.numel() for p in lora)
        for param in lora:  # float32; under mixed precision it computes (and saves its inputs) in the autocast dtype
            param.data = param.data.to(autocast or torch.float32)
    lora_count = plan.lora_params = lora_params
    state_bytes = 2 if cfg.train.optimizer == "adamw8bit" else 8
    ema = 4 if cfg.train.ema_decay > 0 else 0
    lagging = 4 if forward_process else 0  # NFT's old policy, AWM's EMA regularizer
    extras = ", EMA" * bool(ema) + ", lagging copy" * bool(lagging)
    plan.resident[f"LoRA ({_count(lora_count)}): weights, AdamW states{extras} (fp32)"] = \
        lora_count * (4 + state_bytes + ema + lagging)
    plan.optimizer_states = lora_count * state_bytes
    plan.training_state = lora_count * (state_bytes + ema + lagging)

    # ----- set-up: the text encoders encode every prompt, then leave; the host keeps their embeddings
    if cfg.model.cache_text_embeddings:
        plan.cached_prompts, plan.bytes_per_cached_prompt = _text_cache(cfg, model)
    if cfg.model.cache_text_embeddings and encoders:
        tokens = max(cfg.model.max_sequence_length, 77)
        plan.setup[f"text encoders ({encoder_names}, {cfg.model.dtype})"] = encoder_bytes
        encoding = max(_text_encoder_activations(e, tokens, element) for e in encoders)
        if model.encodes_input_images:  # a row's text, then its images: one transient at a time
            plan.setup[f"VAE (encodes the input images, {cfg.model.dtype})"] = vae_bytes
            encoding = max(encoding, _input_images_encoding(model, cfg))
        plan.setup[f"encoding {ENCODE_BATCH} prompts at a time"] = encoding

    # ----- the rollout batch's tensors
    samples = cfg.grpo.num_generations * cfg.grpo.prompts_per_iteration
    latent = model.latent_shape(cfg.sampling.size)
    latent_numel = math.prod(latent)
    steps = cfg.sampling.num_steps
    trainable = cfg.trainable_steps()
    trained = most_trained_steps(trainable, cfg.grpo.timestep_fraction, cfg.grpo.window_placement,
                                 cfg.backward.window)
    noisy = trained if cfg.grpo.ode_after_trained else trainable
    # reference velocities: the rollout's at every noisy step, or the training pass's at every trained step
    reference = (noisy if cfg.grpo.kl_reference == "rollout" else trained) if cfg.grpo.kl_beta > 0 else 0
    trajectory = samples * latent_numel * 4 * ((steps + 1) + steps + reference)
    rows = samples  # an optimizer step's batch: samples (GRPO), or its (sample, step) rows (NFT, AWM)
    if forward_process:  # the clean latents and every row's noise
        trajectory = (samples + samples * forward_process.steps_per_sample(cfg)) * latent_numel * 4
        rows = samples * forward_process.steps_per_update(cfg)
    cond_shapes = model.conditioning_shapes()
    if model.use_cfg:
        cond_shapes.update({NEGATIVE + k: v for k, v in cond_shapes.items()})
    cond_bytes = samples * sum(math.prod(shape) for shape in cond_shapes.values()) * compute.itemsize

    def conditioning(batch: int) -> dict[str, torch.Tensor]:
        return {k: torch.zeros((batch, *shape), dtype=compute, device=META) for k, shape in cond_shapes.items()}

    micro = math.ceil(rows / cfg.train.gradient_accumulation_steps)
    stacked = micro * (2 if _joint_passes(cfg) else 1)
    # a micro-batch of forward-process rows holds x0, eps, x_t and its companions' velocities, float32
    rows_held = micro * latent_numel * 4 * (3 + len(forward_process.companion_names(cfg))) if forward_process else 0
    plan.phase_parts["rollout forward"] = trajectory + cond_bytes
    plan.phase_parts["VAE decode"] = trajectory + cond_bytes
    plan.phase_parts["backward"] = trajectory + cond_bytes + lora_count * 4 + rows_held
    if not trace:
        plan.phases = dict.fromkeys(plan.phase_parts, 0)
        return plan

    weights = [p for p in transformer.parameters()] + [b for b in transformer.buffers()] + \
        [p for p in pipe.vae.parameters()] + [b for b in pipe.vae.buffers()]

    chunk = cfg.sampling.chunk(samples)
    eval_chunk = cfg.sampling.eval_chunk(cfg.prompts.eval_count)
    sigma = torch.full((1,), 0.5, device=META)

    def forward(batch: int) -> None:
        with torch.no_grad():
            model.velocity(torch.zeros((batch, *latent), device=META), sigma.expand(batch), conditioning(batch))

    def decode(count: int) -> None:
        with torch.no_grad():
            model.decode_samples(torch.zeros((count, *latent), device=META), conditioning(count))

    backward_key = _trace_key("backward", cfg, stacked, compute)
    fresh = backward_key not in plan.traces  # the backward is traced after the rollout forward on its meta model
    forward_batch = max(chunk, eval_chunk)
    forward_key = _trace_key("rollout forward", cfg, forward_batch, compute)
    if fresh or forward_key not in plan.traces:
        plan.traces[forward_key] = _traced_in_depth(lambda: forward(forward_batch), weights, transformer,
                                                    backward=False)
    plan.phases["rollout forward"] = plan.traces[forward_key]
    # one sample at a time, each to the host once decoded (model.vae_slicing), else the batch at once
    decoded = 1 if cfg.model.vae_slicing else samples
    decode_key = _trace_key("VAE decode", cfg, decoded, compute)
    if decode_key not in plan.traces:  # the VAE's: no state of the transformer's
        plan.traces[decode_key] = _traced(lambda: decode(decoded), weights)
    plan.phases["VAE decode"] = plan.traces[decode_key]

    if cfg.train.gradient_checkpointing:
        transformer.enable_gradient_checkpointing()
    transformer.train()

    def backward() -> None:
        z = torch.zeros((stacked, *latent), device=META)
        with _int8_dequantizing(transformer, cfg.model.quantize):
            velocity = model.velocity(z, sigma.expand(stacked), conditioning(stacked))
            (velocity * torch.zeros_like(velocity)).sum().backward()

    if fresh:
        if cfg.model.quantize == "int8":  # the peak's moment moves with the depth: no extrapolation (seconds more)
            plan.traces[backward_key] = _traced(backward, weights)
        else:
            plan.traces[backward_key] = _traced_in_depth(backward, weights, transformer, backward=True) + \
                (_dequantized_weight(transformer) if cfg.model.quantize == "nf4" else 0)
    plan.phases["backward"] = plan.traces[backward_key]
    return plan


def _joint_passes(cfg: RunConfig) -> bool:
    """GRPO's JAGG backward runs its endpoint passes two at a time."""
    return cfg.train.algorithm == "grpo" and cfg.backward.mode == "jagg" and cfg.backward.joint


def _base_linears(transformer: torch.nn.Module) -> list[torch.nn.Linear]:
    """The linear layers a quantized base holds in fewer bits: all of the transformer's but the LoRA's."""
    return [m for name, m in transformer.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in name]


def _dequantized_weight(transformer: torch.nn.Module) -> int:
    """An NF4 linear layer (bitsandbytes) computes with its weight dequantized to bf16, in its forward and again in
    its backward, and keeps only the 4-bit weight: one at a time, the largest one's bytes."""
    return max(m.weight.numel() * 2 for m in _base_linears(transformer))


def _int8_dequantizing_forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, linear.weight.clone(), linear.bias)


@contextmanager
def _int8_dequantizing(transformer: torch.nn.Module, quantize: str):
    """While a plan traces the backward of an int8 base (torchao's weight-only ``Int8Tensor``): each base linear
    computes with its weight dequantized to bf16, a new tensor per call that autograd keeps for the backward (the
    input's gradient is ``grad_out @ W``), so a block's backward holds the dequantized weights of all its linears.
    The meta linears (bf16 already) compute with a copy of their weight, which the trace counts. With gradient
    checkpointing the moment of the peak then moves between stacks as they deepen (the first backward block's, with
    every block's saved input, or the widest block's, with its dequantized weights), which :func:`_traced_in_depth`'s
    linear extrapolation does not follow: an int8 base's backward is traced at its full depth."""
    linears = _base_linears(transformer) if quantize == "int8" else []
    for linear in linears:  # an instance attribute shadows the class's forward
        linear.forward = partial(_int8_dequantizing_forward, linear)
    try:
        yield
    finally:
        for linear in linears:
            del linear.forward


# ----- what fits -------------------------------------------------------------------------------------------
def _memory_savers(config: RunConfig) -> list[tuple[str, object]]:
    """Config changes that lower the peak, the ones that keep the training's result first: the judges on the CPU,
    the text encoders offloaded (the same embeddings, a slower set-up), the same gradient at more time (sequential
    endpoints, checkpointing, smaller rollout chunks and micro-batches),
    then a tiled VAE decode (the rewards see slightly different pixels), fewer bits (8-bit AdamW, int8, NF4 weights),
    then shorter videos and a lower resolution (a different run)."""
    cfg = config
    samples = cfg.grpo.num_generations * cfg.grpo.prompts_per_iteration
    savers: list[tuple[str, object]] = []
    if not cfg.eval.judges_on_cpu and any(reward_entry(spec.name).device_params_m for spec in cfg.eval.judges):
        savers.append(("eval.judges_on_cpu", True))
    if not cfg.model.offload_text_encoders:
        savers.append(("model.offload_text_encoders", True))
    if _joint_passes(cfg):
        savers.append(("backward.joint", False))
    if not cfg.train.gradient_checkpointing:
        savers.append(("train.gradient_checkpointing", True))
    savers += [("sampling.rollout_chunk", size) for size in (8, 4, 2, 1) if size < cfg.sampling.chunk(samples)]
    rows = samples * (ALGORITHMS[cfg.train.algorithm].steps_per_update(cfg) if cfg.train.algorithm != "grpo" else 1)
    micro = math.ceil(rows / cfg.train.gradient_accumulation_steps)
    savers += [("train.gradient_accumulation_steps", math.ceil(rows / size)) for size in (8, 4, 2, 1)
               if size < micro]
    if not cfg.model.vae_tiling:
        savers.append(("model.vae_tiling", True))
    if cfg.train.optimizer == "adamw":
        savers.append(("train.optimizer", "adamw8bit"))
    if cfg.model.quantize == "none":
        savers.append(("model.quantize", "int8"))
    if cfg.model.quantize != "nf4":
        savers.append(("model.quantize", "nf4"))
    savers += [("sampling.num_frames", frames) for frames in (49, 33, 17, 9) if frames < cfg.sampling.num_frames]
    size = cfg.sampling.size
    savers += [("sampling.resolution", size.scaled_to(side).config_value()) for side in (768, 512, 384, 256)
               if side < size.longest]
    return savers


def _with_companions(config: RunConfig, changes: dict[str, object]) -> dict[str, object]:
    """``changes`` and what a change needs beside it: an image-to-video run's input image is its videos' first
    frame, so a lower ``sampling.resolution`` sets ``model.condition_resolution`` to the same size."""
    size = changes.get("sampling.resolution")
    family = model_family(config.model) if size is not None else None
    if family is not None and family.image_to_video and family.input_images(config.model.input_images):
        return {**changes, "model.condition_resolution": size}
    return changes


def _changed(config: RunConfig, changes: dict[str, object]) -> RunConfig:
    """``config`` with each ``section.name`` key of ``changes`` (and its companions) set to its value, validated
    again."""
    return with_overrides(config, [f"{key}={json.dumps(value)}"
                                   for key, value in _with_companions(config, changes).items()])


def check_host(plan: MemoryPlan, run_dir: Path, processes: int = 1) -> str:
    """Whether this host holds the plan's host parts, as the line to show (empty without any): the judges on the CPU
    beside the text-embedding cache in memory, the cache on ``run_dir``'s disk too. A run refuses at set-up a cache
    that does not fit (:func:`check_cache_room`), and judges that do not before they load
    (:func:`~jagg_core.judges.check_judges_room`)."""
    judges = sum(judge.cpu_bytes for judge in plan.host_judges.values())
    parts = [f"the judges on the CPU ({amount(judges)}) in memory"] * bool(plan.host_judges)
    parts += [f"the text-embedding cache ({amount(plan.host_cache)}) in memory and on disk"] * bool(plan.cached_prompts)
    if not parts:
        return ""
    try:
        if plan.cached_prompts:
            check_cache_room(plan.bytes_per_cached_prompt, plan.cached_prompts, run_dir, processes)
        check_judges_room(plan.host_judges, processes, beside=plan.host_cache)
    except UserError as err:
        return f"host: {err}"
    return f"host: fits {' and '.join(parts)}"


def check_room_to_sample(config: RunConfig, free_bytes: int, scoring: bool = False) -> None:
    """Refuse, in one line, to load a run's model to sample with it (Try it, evaluate; ``scoring``: with its rewards
    and judges) on a GPU with ``free_bytes`` free that cannot hold even its weights
    (:meth:`MemoryPlan.sampling_floor`): a run training on that GPU would run out of memory beside it."""
    floor = plan_memory(config, trace=False).sampling_floor(scoring)
    if floor + CUDA_CONTEXT_GB * GB > free_bytes:
        parts = "its weights, rewards and judges" if scoring else "its weights"
        raise UserError(f"the GPU has {free_bytes / GB:.1f} GB free, and sampling with this run's model needs "
                        f"{floor / GB + CUDA_CONTEXT_GB:.1f} GB at least ({parts} and a CUDA context, before any "
                        "activation): is a run training on it? Wait for it to end, or stop it, then try again")


def fits(plan: MemoryPlan, gpu_gb: float) -> bool:
    """Whether a run of ``plan`` fits ``gpu_gb`` GB of GPU memory: its planned peak and its CUDA context."""
    return plan.total + CUDA_CONTEXT_GB * GB <= gpu_gb * GB


@cpp_meta_kernels()
def cheapest_fit(config: RunConfig, budget_gb: float,
                 traces: dict[tuple, int] | None = None) -> tuple[list[str], MemoryPlan] | None:
    """The fewest and mildest changes of :func:`_memory_savers` after which the plan fits ``budget_gb``: the
    ``--set`` overrides and the plan; None when even all of them do not fit.

    The changes are applied in turn until the plan fits; then each earlier one that the fit does not need is undone,
    the costliest first (a tiled decode before smaller micro-batches before sequential endpoints ...), or made only
    as strong as it must be (``sampling.rollout_chunk=4`` where the search went on to 1): a smaller change may fit
    once a later one has. The plans share their phases' traces (and ``traces``, the plan of ``config``'s): most
    changes leave most phases alone. A change whose plan without activations (``trace=False``, a floor of its
    plan) does not fit is not traced: on a card too small for the weights, only the quantizing and resolution
    changes are."""
    traces = {} if traces is None else traces
    lora_params = None  # no change alters the LoRA: the first floor counts it, the others reuse the count

    def fitting_plan(changes: dict[str, object]) -> MemoryPlan | None:
        nonlocal lora_params
        changed = _changed(config, changes)
        floor = plan_memory(changed, trace=False, lora_params=lora_params)
        lora_params = floor.lora_params
        if not fits(floor, budget_gb):
            return None  # its weights and batch alone do not fit: its activations are not traced (seconds each)
        plan = plan_memory(changed, traces)
        return plan if fits(plan, budget_gb) else None

    savers = _memory_savers(config)
    changes: dict[str, object] = {}
    for key, value in savers:
        changes[key] = value
        if plan := fitting_plan(changes):
            break
    else:
        return None
    for key in reversed(list(changes)[:-1]):  # the last change is needed: the plan did not fit before it
        stronger = [v for k, v in savers if k == key]
        for milder in [None, *stronger[:stronger.index(changes[key])]]:  # none at all, then each step of it
            trial = {k: (milder if k == key else v) for k, v in changes.items() if k != key or milder is not None}
            if smaller := fitting_plan(trial):
                changes, plan = trial, smaller
                break
    return [f"{k}={json.dumps(v)}" for k, v in _with_companions(config, changes).items()], plan


def check_fits(plan: MemoryPlan, config: RunConfig, budget_gb: float | None) -> str:
    """Whether the plan fits ``budget_gb`` (GB of the GPU), as the line to show; a plan that no single GPU holds
    is a :class:`UserError` saying what lowers it."""
    if plan.total > LARGEST_GPU_GB * GB:
        raise UserError(f"this run plans {plan.total / GB:.1f} GB, more than any single GPU ({LARGEST_GPU_GB} GB); "
                        "lower sampling.resolution or the rollout batch (grpo.num_generations x "
                        "prompts_per_iteration), set sampling.rollout_chunk, or shard the model over several "
                        "GPUs (presets/accelerate/fsdp.yaml)")
    if budget_gb is None:
        return f"planned peak {plan.total / GB:.1f} GB"
    planned = f"planned peak {plan.total / GB:.1f} GB + {CUDA_CONTEXT_GB:g} GB CUDA context"
    if fits(plan, budget_gb):
        return f"fits: {planned} of {budget_gb:.1f} GB"
    fix = cheapest_fit(config, budget_gb, plan.traces)
    if fix is None:
        return (f"does not fit: {planned}, the GPU has {budget_gb:.1f} GB, and no setting change fits; use a larger "
                "GPU or shard with presets/accelerate/fsdp.yaml")
    return (f"does not fit: {planned}, the GPU has {budget_gb:.1f} GB; cheapest change that fits: "
            f"--set {' --set '.join(fix[0])} (plans {fix[1].total / GB:.1f} GB)")
