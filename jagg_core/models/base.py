"""The small interface every model family implements, over a diffusers pipeline.

The sampler, GRPO and JAGG only see a :class:`FlowModel`: prompt conditioning (cached per
prompt), the sigma schedule, the velocity ``v_theta(z, sigma, c)`` in the sampler's latent space
(packed for FLUX and Qwen-Image), and decoding to images. Flow-matching convention: sigma runs
from 1 (noise) to 0 (data), ``z_sigma = (1 - sigma) x0 + sigma * noise`` and ``v = noise - x0``.
"""

from __future__ import annotations

import gc
import json
import os
import warnings
from abc import ABC, abstractmethod
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from accelerate import cpu_offload
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.utils import convert_unet_state_dict_to_peft
from peft import LoraConfig as PeftLoraConfig
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict

from ..config import LoraConfig, ModelConfig
from ..errors import UserError
from ..image_size import ImageSize
from ..preflight import dynamic_shift_refusal
from ..rundir import LORA_FILE, adapter_filenames
from .quantize import DENOISER_COMPONENTS, is_quantized
from .text_windows import TextWindow, WindowReading, read_windows

Conditioning = dict[str, torch.Tensor]
NEGATIVE = "negative/"
#: the pipeline components that encode a prompt row at set-up, released together after it: its text encoders, and
#: the image encoder of Wan 2.1's image-to-video (a CLIP vision tower that reads the row's input image)
PROMPT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3", "image_encoder")
#: ``model.expert`` -> the pipeline components its LoRA trains: a two-expert model's (Wan 2.2 A14B's)
#: ``transformer`` denoises the high-noise steps and ``transformer_2`` the low-noise ones, ``both`` trains each; a
#: model of one transformer has the first
TRAINED_COMPONENTS = {"high_noise": DENOISER_COMPONENTS[:1], "low_noise": DENOISER_COMPONENTS[1:],
                      "both": DENOISER_COMPONENTS}
#: prompts encoded together at set-up
ENCODE_BATCH = 16
#: the peft name of the run's own adapter (:meth:`FlowModel.add_lora`)
DEFAULT_ADAPTER = "default"
#: peft's LoRA settings that set an adapter's scale, each with the run config's key
LORA_SCALE_KEYS = {"lora_alpha": "lora.alpha", "use_rslora": "lora.use_rslora"}


def expert_files(expert: str) -> dict[str, str]:
    """The pipeline components a run of ``model.expert`` trains -> its adapter's file of each:
    :data:`~jagg_core.rundir.LORA_FILE` (the trained expert's), and with both experts
    :data:`~jagg_core.rundir.TRANSFORMER_2_LORA_FILE` for the low-noise one."""
    return dict(zip(TRAINED_COMPONENTS[expert], adapter_filenames(expert)))


def calculate_shift(image_seq_len: int, scheduler_config) -> float:
    """Resolution-dependent shift ``mu``, linear in the image token count (as diffusers' pipelines):
    mu = base_shift + (max_shift - base_shift) * (L - base_len) / (max_len - base_len)."""
    base_len = scheduler_config.get("base_image_seq_len", 256)
    max_len = scheduler_config.get("max_image_seq_len", 4096)
    base_shift = scheduler_config.get("base_shift", 0.5)
    max_shift = scheduler_config.get("max_shift", 1.15)
    slope = (max_shift - base_shift) / (max_len - base_len)
    return image_seq_len * slope + base_shift - slope * base_len


def linspace_sigmas(num_steps: int) -> dict:
    """``set_timesteps`` arguments of the pipelines that pass ``sigmas = linspace(1, 1/n, n)`` to the scheduler,
    which then shifts them (FLUX.1, FLUX.2, Qwen-Image, Z-Image)."""
    return {"sigmas": np.linspace(1.0, 1 / num_steps, num_steps)}


def decode_scaled(vae, latents: torch.Tensor) -> torch.Tensor:
    """``x = vae.decode(latents / scaling_factor + shift_factor)`` mapped from [-1, 1] to [0, 1], float32 (the KL VAE
    of SD3, FLUX.1 and Z-Image)."""
    latents = latents / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
    images = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
    return (images.float() / 2 + 0.5).clamp(0, 1)


def drop_text_encoders(pipe) -> None:
    """Set the pipeline's prompt encoders (:data:`PROMPT_ENCODERS`) to None (its tokenizers and processors stay)."""
    for name in PROMPT_ENCODERS:
        if getattr(pipe, name, None) is not None:
            setattr(pipe, name, None)


def sort_safetensors_header(path: Path) -> None:
    """Rewrite a safetensors file's JSON header with its keys sorted (padded with spaces to 8 bytes, as safetensors
    writes it): safetensors orders the metadata map differently in every process, so equal tensors and metadata would
    give files with different bytes. The tensors' bytes and offsets (relative to the data) stay."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8:8 + length]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + length:])
    os.replace(tmp, path)


def _check_lora_kind(path: Path, adapter: PeftLoraConfig, state: dict, metadata: dict) -> None:
    """Refuse, in one line, a LoRA file of another kind than ``adapter`` (peft's config of the adapter it would load
    into): a DoRA (its ``lora_magnitude_vector`` weights) into a plain LoRA or the other way round, or, where the file
    says so in its peft metadata (our adapters and diffusers' training scripts write it), another alpha or another
    scale rule (rsLoRA). Loaded anyway, its weights would compute another function than the one they were trained as.
    A file of another rank fails on its weights' shapes."""
    dora = any("lora_magnitude_vector" in key for key in state)
    if dora != bool(adapter.use_dora):
        kind = "a DoRA" if dora else "a plain LoRA (no DoRA magnitudes)"
        raise UserError(f"the LoRA in {path} is {kind}: set lora.use_dora: {json.dumps(dora)} to match it")
    for key, setting in LORA_SCALE_KEYS.items():
        if key in metadata and metadata[key] != getattr(adapter, key):
            raise UserError(f"the LoRA in {path} was trained with {setting} {json.dumps(metadata[key])}, this adapter "
                            f"has {json.dumps(getattr(adapter, key))}: set {setting}: {json.dumps(metadata[key])} "
                            "to match it")


class FlowModel(ABC):
    """A flow-matching pipeline (text-to-image, image editing or text-to-video) seen as ``v_theta(z, sigma, c)`` plus
    I/O; one subclass per family, declared with it in its file (:mod:`.family`)."""

    family: str = ""
    default_lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    #: a video family's samples are ``num_frames`` frames: :meth:`decode` returns ``[B, F, 3, H, W]``
    is_video: bool = False
    #: a prompt row carries input images (editing, image-to-video), VAE-encoded with its text: the VAE is on the
    #: device from the start, beside the text encoders at set-up (``input_pixel_latents`` encodes them)
    encodes_input_images: bool = False

    def __init__(self, pipe, config: ModelConfig, device: torch.device | str = "cpu", *, defer_denoiser: bool = False,
                 prepare_transformer: Callable[[], None] | None = None, place_transformer: bool = True,
                 num_frames: int = 1):
        """Frozen components go to ``device`` (the text encoders' weights stay on the host under
        ``model.offload_text_encoders``, each module's coming to ``device`` as it runs). ``prepare_transformer``
        (quantization) sets ``pipe.transformer`` before it is placed. With ``defer_denoiser`` the transformer (and the
        VAE of a model that does not encode input images) waits until :meth:`release_text_encoders`, so the text
        encoders never share the accelerator with it. ``num_frames`` (``sampling.num_frames``): the frames of one
        sample of a video family; an image family takes 1 only."""
        if config.expert != "high_noise" and getattr(pipe, DENOISER_COMPONENTS[1], None) is None:
            raise UserError(f"model.expert={config.expert} trains the low-noise expert of a two-expert model (Wan 2.2 "
                            f"A14B); '{config.name}' has one transformer: unset model.expert")
        if config.guidance_scale_2 is not None and getattr(pipe, DENOISER_COMPONENTS[1], None) is None:
            raise UserError(f"model.guidance_scale_2 is the CFG scale of a two-expert model's low-noise steps (Wan 2.2 "
                            f"A14B); '{config.name}' has one transformer: unset it")
        if config.flow_shift is not None and pipe.scheduler.config.get("use_dynamic_shifting", False):
            raise UserError(dynamic_shift_refusal(config.name))
        if num_frames != 1 and not self.is_video:
            raise UserError(f"sampling.num_frames is {num_frames}, but {self.family} makes images: set it to 1")
        self.num_frames = num_frames
        self.pipe = pipe
        self.config = config
        self.device = torch.device(device)
        self._prompt_cache: dict[str, Conditioning] = {}  # host memory
        self._prepare_transformer = prepare_transformer
        self._place_transformer = place_transformer
        pipe.set_progress_bar_config(disable=True)
        for module in self.text_encoders:
            module.requires_grad_(False).eval()
            if config.offload_text_encoders:  # its weights stay on the host, each module's coming as it runs
                cpu_offload(module, execution_device=self.device)
            else:
                module.to(self.device)
        pipe.vae.requires_grad_(False).eval()
        if config.vae_slicing:
            pipe.vae.enable_slicing()
        if config.vae_tiling:
            pipe.vae.enable_tiling()
        if self.encodes_input_images:  # set-up encodes each row's images on the device, not the host's CPU
            pipe.vae.to(self.device)
        if not defer_denoiser:
            self._place_denoiser()

    def _place_denoiser(self) -> None:
        if self._prepare_transformer is not None:
            self._prepare_transformer()
            self._prepare_transformer = None
        self.pipe.vae.to(self.device)
        trained = [id(module) for module in self.trained_transformers]
        for module in self.denoisers:  # sharding places the trained ones' parts; a two-expert model's other comes whole
            module.requires_grad_(False)
            if (self._place_transformer or id(module) not in trained) and not is_quantized(module):
                module.to(self.device)  # quantizers place while loading

    @property
    def text_encoders(self) -> list[torch.nn.Module]:
        """The pipeline's prompt encoders (:data:`PROMPT_ENCODERS`): placed, offloaded and released together."""
        return [module for name in PROMPT_ENCODERS if (module := getattr(self.pipe, name, None)) is not None]

    def release_text_encoders(self) -> None:
        """Drop the text encoders (device and host memory) once every prompt is encoded, then place the
        transformer and VAE. A prompt not encoded before raises an error from then on."""
        drop_text_encoders(self.pipe)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._place_denoiser()

    # ----- the transformer and its LoRA -------------------------------------------------
    @property
    def trained_components(self) -> tuple[str, ...]:
        """The pipeline components the LoRA trains: ``transformer``, or a two-expert model's ``model.expert``'s
        (:data:`TRAINED_COMPONENTS`: one of them, or both)."""
        return TRAINED_COMPONENTS[self.config.expert]

    @property
    def trained_transformers(self) -> list[torch.nn.Module]:
        """The transformers the LoRA trains (:attr:`trained_components`), each with an adapter of its own."""
        return [getattr(self.pipe, name) for name in self.trained_components]

    @property
    def transformer(self) -> torch.nn.Module:
        """The (first) transformer the LoRA trains, whose config and dtype the family reads (two experts share
        them)."""
        return self.trained_transformers[0]

    @property
    def denoisers(self) -> list[torch.nn.Module]:
        """The pipeline's transformers: one, or a two-expert model's two (Wan 2.2 A14B's ``transformer`` and
        ``transformer_2``), placed, quantized and metered alike (under sharding FSDP places the trained one's
        shards)."""
        return [module for name in DENOISER_COMPONENTS if (module := getattr(self.pipe, name, None)) is not None]

    def trained_steps(self, sigmas: torch.Tensor) -> range:
        """The schedule steps (of ``sigmas`` [T + 1]) whose velocity the trained transformer gives: all ``T`` of a
        model of one transformer."""
        return range(len(sigmas) - 1)

    def expert_switch(self, sigmas: torch.Tensor) -> int | None:
        """The step of ``sigmas`` where a two-expert model's second expert takes over; None for one transformer."""
        return None

    @property
    def use_cfg(self) -> bool:
        return self.config.uses_cfg

    def add_lora(self, lora: LoraConfig) -> list[torch.nn.Parameter]:
        """Add a trainable LoRA adapter (peft through diffusers); return its parameters (fp32)."""
        targets = lora.target_modules or list(self.default_lora_targets)
        peft_config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                     use_dora=lora.use_dora, use_rslora=lora.use_rslora,
                                     init_lora_weights="gaussian", target_modules=targets)
        params = []
        for transformer in self.trained_transformers:
            try:
                transformer.add_adapter(peft_config)
            except ValueError as err:
                raise UserError(f"lora.target_modules {targets} do not fit this {self.family} model: {err}") from None
            params += [p for n, p in transformer.named_parameters() if "lora_" in n]
        for param in params:
            param.data = param.data.float()
            param.requires_grad_(True)
        return params

    def save_lora(self, directory: str | Path) -> Path:
        """Write each trained transformer's adapter in diffusers format (``pipe.load_lora_weights``) into
        ``directory``, as :func:`expert_files` names them; return the first.

        The adapter's peft config (rank, alpha, targets) goes into the file's metadata: without it,
        ``load_lora_weights`` assumes ``alpha = rank``, a wrong scale whenever ``lora.alpha != lora.rank``. Its sets
        (``target_modules``) are written sorted, so equal weights give an equal file."""
        paths = []
        for component, filename in expert_files(self.config.expert).items():
            transformer = getattr(self.pipe, component)
            state = {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(transformer).items()}
            metadata = {key: sorted(value) if isinstance(value, set) else value
                        for key, value in transformer.peft_config[DEFAULT_ADAPTER].to_dict().items()}
            type(self.pipe).save_lora_weights(str(directory), transformer_lora_layers=state, safe_serialization=True,
                                              transformer_lora_adapter_metadata=metadata, weight_name=filename)
            paths.append(Path(directory) / filename)
            sort_safetensors_header(paths[-1])
        return paths[0]

    def adapter_sources(self, path: str | Path, expert: str | None = None) -> dict[str, Path]:
        """Each component's file of the adapter ``path`` (a diffusers LoRA file, or its folder) of a run of
        ``expert`` (None: this run's ``model.expert``; :func:`expert_files`): the file (the folder's
        :data:`~jagg_core.rundir.LORA_FILE`), and with both experts the low-noise one's beside it; a one-line
        :class:`UserError` when that one is missing."""
        path, files = Path(path), expert_files(expert or self.config.expert)
        first = path / LORA_FILE if path.is_dir() else path
        (component, _), *others = files.items()
        sources = {component: first}
        for component, filename in others:
            sources[component] = first.parent / filename
            if not sources[component].is_file():
                raise UserError(f"{first.parent} has no {filename}: an adapter of both experts (model.expert: both) "
                                f"is two files, {' and '.join(files.values())}")
        return sources

    def load_lora(self, path: str | Path) -> None:
        """Load a diffusers-format LoRA (file or folder; both experts': :meth:`adapter_sources`) into the (already
        added) adapter."""
        for component, source in self.adapter_sources(path).items():
            self._load_lora_into(getattr(self.pipe, component), source)

    def _load_lora_into(self, transformer: torch.nn.Module, path: Path) -> None:
        """Load one diffusers-format LoRA file into ``transformer``'s (already added) adapter."""
        try:
            read = type(self.pipe).lora_state_dict(str(path), return_lora_metadata=True)
        except Exception as err:  # safetensors, torch.load and diffusers raise many kinds for a bad file
            raise UserError(f"{path} is not a readable diffusers LoRA ({type(err).__name__}: "
                            f"{str(err).splitlines()[0][:160] if str(err) else 'unreadable'})") from None
        state, metadata = read[0], read[-1] or {}
        transformer_state = {k.removeprefix("transformer."): v for k, v in state.items() if k.startswith("transformer.")}
        if not transformer_state:
            raise UserError(f"{path} holds no transformer LoRA weights")
        _check_lora_kind(path, transformer.peft_config[DEFAULT_ADAPTER], transformer_state,
                         {k.removeprefix("transformer."): v for k, v in metadata.items()})
        transformer_state = convert_unet_state_dict_to_peft(transformer_state)
        try:
            result = set_peft_model_state_dict(transformer, transformer_state, adapter_name=DEFAULT_ADAPTER)
        except RuntimeError as err:
            raise UserError(f"the LoRA in {path} does not match lora.rank/target_modules: {str(err).splitlines()[0]}") from None
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise UserError(f"the LoRA in {path} has weights for modules this adapter lacks, e.g. {unexpected[0]}; "
                            "set lora.target_modules to match it")

    def load_other_lora(self, path: str | Path, name: str, expert: str | None = None) -> None:
        """Load another diffusers-format LoRA beside the run's, as the adapter ``name``, with its own rank, alpha and
        targets (``pipe.load_lora_weights``), into the transformers a run of ``expert`` trains (None: the ones this
        run trains; each file of :meth:`adapter_sources`; a two-expert model's low-noise expert's:
        ``load_into_transformer_2``); :meth:`use_adapter` picks which one samples."""
        for component, source in self.adapter_sources(path, expert).items():
            into = {"load_into_transformer_2": True} if component == DENOISER_COMPONENTS[1] else {}
            try:
                with warnings.catch_warnings():  # peft warns of a second adapter: here that is the point
                    warnings.filterwarnings("ignore", "Already found a `peft_config`", UserWarning)
                    self.pipe.load_lora_weights(str(source), adapter_name=name, **into)
            except Exception as err:  # safetensors, peft and diffusers raise many kinds for a file they cannot use
                raise UserError(f"{source} is not a LoRA of this {self.family} model ({type(err).__name__}: "
                                f"{str(err).splitlines()[0][:160] if str(err) else 'unreadable'})") from None
        self.use_adapter(DEFAULT_ADAPTER)

    def use_adapter(self, name: str | None) -> None:
        """Sample with the adapter ``name`` (the run's is ``default``; another loaded by :meth:`load_other_lora`), or
        with None the base model: each transformer that holds ``name`` takes it, the others their base weights (a
        two-expert model's expert that only the other adapter, or only the run's, adapts)."""
        for transformer in self.denoisers:
            adapters = getattr(transformer, "peft_config", None) or {}
            if name in adapters:
                transformer.enable_adapters()
                transformer.set_adapter(name)
            elif adapters:
                transformer.disable_adapters()

    @contextmanager
    def adapters_disabled(self):
        """The reference model: the base transformers with the LoRA switched off."""
        for transformer in self.trained_transformers:
            transformer.disable_adapters()
        try:
            yield
        finally:
            for transformer in self.trained_transformers:
                transformer.enable_adapters()

    # ----- prompts --------------------------------------------------------------------
    def encode_and_cache(self, prompts: list[str], batch_size: int = ENCODE_BATCH,
                         progress: Callable[[int, int], None] | None = None) -> None:
        """Encode the prompts not cached yet, ``batch_size`` at a time, into the host-memory cache; ``progress(done,
        total)`` after each batch. Each cached tensor is a copy of its own, so none shares memory with another (an
        editing row's ``negative/image_latents`` is its ``image_latents``; safetensors refuses to save such)."""
        missing = [p for p in dict.fromkeys(prompts) if p not in self._prompt_cache]
        encoded = self._encode(missing, batch_size, progress)
        self._prompt_cache.update({prompt: {k: v.to("cpu", copy=True) for k, v in cond.items()}
                                   for prompt, cond in encoded.items()})

    def _encode(self, prompts: list[str], batch_size: int = ENCODE_BATCH,
                progress: Callable[[int, int], None] | None = None) -> dict[str, Conditioning]:
        """Each of ``prompts``' conditioning (a batch of one, on the device), ``batch_size`` at a time."""
        if prompts and not self.text_encoders:
            raise UserError(f"prompt {prompts[0]!r} was not encoded at set-up and the text encoders are released; "
                            "set model.cache_text_embeddings=false to encode prompts as they come")
        encoded: dict[str, Conditioning] = {}
        for first in range(0, len(prompts), batch_size):
            part = prompts[first:first + batch_size]
            with torch.no_grad():
                batch = self.encode_prompts(part)
            encoded.update({prompt: {k: v[i:i + 1] for k, v in batch.items()} for i, prompt in enumerate(part)})
            if progress is not None:
                progress(first + len(part), len(prompts))
        return encoded

    def conditioning(self, prompts: list[str]) -> Conditioning:
        """Batched conditioning tensors for ``prompts`` on the device. A cached prompt's come from the host cache; the
        others are encoded now and not kept: only :meth:`encode_and_cache` keeps prompts (a run's every prompt at
        set-up under ``model.cache_text_embeddings``, else its eval prompts), so the host's memory does not grow with
        the prompts a long run draws."""
        rows = {p: self._prompt_cache[p] for p in prompts if p in self._prompt_cache}
        rows.update(self._encode([p for p in dict.fromkeys(prompts) if p not in rows]))
        return {key: torch.cat([rows[p][key].to(self.device) for p in prompts]) for key in rows[prompts[0]]}

    @property
    def cached_embeddings(self) -> dict[str, Conditioning]:
        """Prompt -> its conditioning tensors (host memory), as :meth:`load_embeddings` takes them back."""
        return dict(self._prompt_cache)

    def load_embeddings(self, embeddings: dict[str, Conditioning]) -> None:
        self._prompt_cache.update(embeddings)

    @abstractmethod
    def text_windows(self) -> list[TextWindow]:
        """Each text encoder's window of a prompt (:mod:`.text_windows`), counting :meth:`prompt_texts`."""

    def prompt_texts(self, prompts: list[str]) -> list[str]:
        """What the text encoders read of each prompt (an editing row: its instruction)."""
        return prompts

    def read_text_windows(self, prompts: list[str]) -> list[WindowReading]:
        """How ``prompts`` fill each text encoder's window (the tokenizers stay when the encoders are released)."""
        return read_windows(self.text_windows(), self.prompt_texts(prompts))

    @staticmethod
    def tile_conditioning(cond: Conditioning, times: int) -> Conditioning:
        """The batch repeated ``times`` times as blocks: ``[c; c; ...]`` (for stacked steps)."""
        return cond if times == 1 else {k: torch.cat([v] * times) for k, v in cond.items()}

    # ----- sigmas ---------------------------------------------------------------------
    def sigmas(self, num_steps: int, size: ImageSize) -> torch.Tensor:
        """``num_steps + 1`` sigmas from the pipeline's scheduler config (shift, dynamic shift), ending at 0."""
        scheduler = self.euler_scheduler()
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", False):
            kwargs["mu"] = self.dynamic_shift(num_steps, size)
        scheduler.set_timesteps(num_steps, device="cpu", **self.schedule_kwargs(num_steps), **kwargs)
        return scheduler.sigmas.float()

    def dynamic_shift(self, num_steps: int, size: ImageSize) -> float:
        """The ``mu`` of a dynamically shifted schedule: :func:`calculate_shift` of the image token count, as most
        pipelines compute it (FLUX.2 overrides it)."""
        return calculate_shift(self.image_seq_len(size), self.pipe.scheduler.config)

    def euler_scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        """A flow-matching Euler scheduler with the pipeline's schedule settings (its scheduler's config), its shift
        ``model.flow_shift`` when that is set."""
        shift = {"shift": self.config.flow_shift} if self.config.flow_shift is not None else {}
        return FlowMatchEulerDiscreteScheduler.from_config(self.pipe.scheduler.config, **shift)

    def schedule_kwargs(self, num_steps: int) -> dict:
        """Extra ``set_timesteps`` arguments the family's pipeline passes (e.g. explicit sigmas)."""
        return {}

    # ----- family specifics ---------------------------------------------------------------
    @abstractmethod
    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """Encode prompts into batched tensors; with CFG also the negative prompt, under the same
        keys prefixed by ``NEGATIVE``."""

    @abstractmethod
    def conditioning_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of one prompt's conditioning tensors without CFG, from the configs alone (memory plan)."""

    def largest_size(self) -> tuple[ImageSize, str] | None:
        """The largest image (or frame) the transformer can place and why (its position table's extent); None: no
        limit below the config's 2048 px (the real models)."""
        return None

    def check_size(self, size: ImageSize) -> None:
        """A ``size`` beyond :meth:`largest_size` refused in one line (the transformer would fail mid-sampling)."""
        if (limit := self.largest_size()) and (size.height > limit[0].height or size.width > limit[0].width):
            largest, why = limit
            raise UserError(f"sampling.resolution {size.config_value()} is too large for {self.config.name}: {why}, "
                            f"{largest.config_value()} px at most; lower sampling.resolution")

    @abstractmethod
    def latent_shape(self, size: ImageSize) -> tuple[int, ...]:
        """Shape of one sample's latent in the sampler's space, for images (or frames) of ``size``."""

    @abstractmethod
    def image_seq_len(self, size: ImageSize) -> int:
        """Number of image tokens the transformer sees (for the dynamic shift)."""

    @abstractmethod
    def transformer_velocity(self, z: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """One transformer call: velocity for latents ``z`` at per-sample ``sigma`` [B]."""

    @abstractmethod
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Latents -> images float32 [B, 3, H, W] in [0, 1]; a video family's -> frames [B, F, 3, H, W]."""

    def decode_samples(self, z: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The images (or videos) of samples ``z`` drawn under ``cond``: :meth:`decode`, which an image-to-video model
        extends with the input image's first frame (:class:`~jagg_core.models.wan.WanImageToVideoModel`)."""
        return self.decode(z)

    def decode_to_host(self, z: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """:meth:`decode_samples` into host memory: with ``model.vae_slicing`` one sample at a time, each moved to the
        host once decoded, so the device holds one sample's images at a time, not the batch's (a video of 33 frames
        at 1280 x 704 is 0.36 GB of float32 frames); the same bits as the sliced VAE's batch (it decodes one sample at
        a time too). Without slicing the batch is decoded at once, then moved."""
        if not self.config.vae_slicing:
            return self.decode_samples(z, cond).cpu()
        return torch.cat([self.decode_samples(z[i:i + 1], {key: value[i:i + 1] for key, value in cond.items()}).cpu()
                          for i in range(z.shape[0])])

    # ----- the velocity the sampler uses ------------------------------------------------------
    def velocity(self, z: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """``v_theta(z, sigma, c)``; with CFG, ``v = v_neg + g (v_pos - v_neg)`` from one stacked call."""
        sigma = sigma.expand(z.shape[0]) if sigma.dim() == 0 else sigma
        positive = {k: v for k, v in cond.items() if not k.startswith(NEGATIVE)}
        if not self.use_cfg:
            return self.transformer_velocity(z, sigma, positive)
        stacked = {k: torch.cat([cond[NEGATIVE + k], v]) for k, v in positive.items()}
        v_neg, v_pos = self.transformer_velocity(torch.cat([z, z]), torch.cat([sigma, sigma]), stacked).chunk(2)
        return self.guide(v_neg, v_pos, sigma)

    def guide(self, v_neg: torch.Tensor, v_pos: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """Classifier-free guidance ``v = v_neg + g (v_pos - v_neg)`` at each row's ``sigma`` [B]
        (:meth:`cfg_scale`); families whose pipeline post-processes the guided prediction (Qwen-Image) override
        this."""
        return v_neg + self.cfg_scale(sigma, v_pos.dim()) * (v_pos - v_neg)

    def cfg_scale(self, sigma: torch.Tensor, dims: int) -> float | torch.Tensor:
        """The CFG scale ``g`` of rows at ``sigma`` [B], as a number or a tensor broadcasting over ``dims``-dimensional
        velocities: ``model.guidance_scale`` (a two-expert model's low-noise rows: ``model.guidance_scale_2``)."""
        return self.config.guidance_scale


class PackedFlowModel(FlowModel):
    """A family whose pipeline packs 2x2 latent patches into tokens (FLUX, Qwen-Image).

    The sampler's latent of one sample is the grid of tokens ``[h/2, w/2, 4 C]`` the transformer sees,
    ``h x w = height / f x width / f`` for the VAE's factor ``f``; the transformer reads it flattened row by row,
    ``[(h/2) (w/2), 4 C]``, the pipeline's ``_pack_latents`` layout (the grid keeps the image's shape with its
    tokens: :meth:`token_grid`). These pipelines pass
    ``sigmas = linspace(1, 1/n, n)`` to the scheduler, which then applies the dynamic shift
    ``mu(image_seq_len)`` (and the terminal stretch, if configured).
    """

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        cond = self.encode_without_cfg(prompts)
        if self.use_cfg:
            negative = self.encode_without_cfg(self.negative_prompts(prompts))
            cond.update({NEGATIVE + k: v for k, v in negative.items()})
        return cond

    def negative_prompts(self, prompts: list[str]) -> list[str]:
        """What CFG's negative branch encodes for ``prompts``: ``model.negative_prompt`` for each (an editing family
        keeps each row's input image with it)."""
        return [self.config.negative_prompt] * len(prompts)

    @abstractmethod
    def encode_without_cfg(self, prompts: list[str]) -> Conditioning:
        """The prompts' conditioning tensors (the negative prompt is encoded by the same call)."""

    def latent_shape(self, size: ImageSize) -> tuple[int, ...]:
        return (*size.latent(self.pipe.vae_scale_factor * 2), self.transformer.config.in_channels)

    def image_seq_len(self, size: ImageSize) -> int:
        return size.tokens(self.pipe.vae_scale_factor * 2)

    def transformer_velocity(self, z: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The velocity of the grid ``z`` [B, h/2, w/2, 4C]: :meth:`token_velocity` of its tokens, row by row."""
        return self.token_velocity(z.flatten(1, 2), self.token_grid(z), sigma, cond).view(z.shape)

    @abstractmethod
    def token_velocity(self, tokens: torch.Tensor, grid: tuple[int, int], sigma: torch.Tensor,
                       cond: Conditioning) -> torch.Tensor:
        """The transformer's output for the generated image's ``tokens`` [B, rows cols, 4C], a ``grid`` of
        ``(rows, cols)`` tokens."""

    def schedule_kwargs(self, num_steps: int) -> dict:
        return linspace_sigmas(num_steps)

    def guidance(self, z: torch.Tensor) -> torch.Tensor | None:
        """The guidance embedding's value per sample of ``z``, ``model.flux_guidance``, for a guidance-distilled
        transformer (``guidance_embeds``: FLUX.1 [dev], FLUX.2 [dev]); None for one without the embedding."""
        if not self.transformer.config.get("guidance_embeds", False):
            return None
        return torch.full((z.shape[0],), self.config.flux_guidance, device=z.device, dtype=torch.float32)

    @staticmethod
    def token_grid(z: torch.Tensor) -> tuple[int, int]:
        """``(rows, cols)`` of the grid of packed latents ``z`` [B, rows, cols, 4C]."""
        return z.shape[1], z.shape[2]

    def unpacked(self, z: torch.Tensor) -> torch.Tensor:
        """Packed latents [B, h/2, w/2, 4C] -> the VAE's latent layout, through the pipeline's ``_unpack_latents``."""
        rows, cols = self.token_grid(z)
        factor = self.pipe.vae_scale_factor
        return self.pipe._unpack_latents(z.flatten(1, 2), rows * 2 * factor, cols * 2 * factor, factor)
