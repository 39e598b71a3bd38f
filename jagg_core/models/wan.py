"""Wan 2.1 and Wan 2.2 TI2V-5B text-to-video (``WanPipeline``), and Wan 2.2 TI2V-5B image-to-video
(``WanImageToVideoPipeline``): video latents [C, F', h, w], timestep = 1000 sigma, UMT5 text states.

One sample is ``sampling.num_frames = 4k + 1`` frames; the VAE (``AutoencoderKLWan``) encodes the first frame
alone and every later group of 4 as one latent frame, so ``F' = (num_frames - 1) / 4 + 1``, and each frame
``s`` times smaller per side (``h x w = height / s x width / s``, ``s = vae.config.scale_factor_spatial``: 8 for
Wan 2.1's VAE, whose frames are 832x480; 16 for Wan 2.2's, 2x2 pixel patches into 48 channels, whose frames are
1280x704). The transformer patches ``(1, 2, 2)``: ``F' h w / 4`` tokens.
The sampler, GRPO and JAGG treat the latent as an opaque tensor of :meth:`WanModel.latent_shape`.

Wan 2.2 TI2V-5B's pipeline (``expand_timesteps``) gives the transformer one timestep per token, ``t`` times a mask
that is 0 on the tokens of a conditioning first frame (image-to-video) and 1 elsewhere: in text-to-video every
token's timestep is the step's ``t``, so the velocity passes ``t`` once per sample, the same modulation of every
token without the per-token copies (``[B, tokens, 6, dim]``: at 1280x704 x 33 frames, 7,920 tokens, 0.29 GB a
sample in bf16, and a 0.58 GB float32 sum of it in every block). Image-to-video (``model.input_images: 1``) is
:class:`WanImageToVideoModel`; Wan 2.1's image-to-video models are their own family (:mod:`.wan_i2v`).

Wan 2.2 T2V-A14B has two experts of the Wan 2.1 14B shape: the pipeline's ``transformer`` gives the velocity at the
high-noise steps, timestep ``1000 sigma >= boundary_ratio * 1000``, and ``transformer_2`` below (0.875: with
flow_shift 3 and 10 steps, the first 3). The LoRA trains one of them, ``model.expert`` (a LoRA per expert is what
diffusers loads, ``load_into_transformer_2=True`` for the second); the other samples with its base weights, and
only the trained expert's steps are trained (:meth:`WanModel.trained_steps`: GRPO's placement, NFT's and AWM's
draws happen within them). ``model.expert: both`` puts a LoRA in each and trains every step, each through its
expert; GRPO's spans are cut at the switch (:meth:`WanModel.expert_switch`), so no JAGG window spans two experts.

Sigmas: the pipeline's default scheduler is UniPC with ``flow_shift``; the sampler takes Euler steps on the
flow-matching schedule of ``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` (what diffusers' Wan training
scripts swap in), ``sigma = s t / (1 + (s - 1) t)`` for t evenly spaced from 1 towards 0.

Decoding un-normalises with the VAE's per-channel statistics, ``x = z * latents_std + latents_mean``, and returns
frames ``[B, F, 3, H, W]`` in [0, 1]. CFG is the pipeline's: ``v = v_neg + g (v_pos - v_neg)`` with
``model.negative_prompt``.
"""

from __future__ import annotations

import torch
from PIL import Image
from diffusers import (AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline,
                       WanTransformer3DModel)
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from transformers import UMT5Config, UMT5EncoderModel

from ..config import ModelConfig
from ..edit_prompts import EditPrompt, edit_rows
from ..errors import UserError
from ..family_names import MAKES_VIDEOS_FROM_IMAGES
from ..image_size import ImageSize
from .base import NEGATIVE, Conditioning, FlowModel
from .editing import IMAGE_LATENTS
from .family import Family
from .in_memory_parts import tiny_t5_tokenizer
from .text_windows import MAX_SEQUENCE_LENGTH, TextWindow, tokens_of

#: the image encoder's states of a row's first frame (Wan 2.1 image-to-video), which the transformer's
#: cross-attention reads beside the text's
IMAGE_STATES = "image_embeds"


class WanModel(FlowModel):
    family = "wan"
    is_video = True
    # default_lora_targets: the base class's to_q/to_k/to_v/to_out.0, which in Wan are the projections of every
    # block's self-attention (attn1) and cross-attention to the text (attn2).

    def __init__(self, pipe, config: ModelConfig, device: torch.device | str = "cpu", *, num_frames: int = 1,
                 **placement):
        if pipe.transformer_2 is not None and (pipe.transformer is None or pipe.config.boundary_ratio is None):
            raise UserError(f"model '{config.name}' has a transformer_2 but not both experts and a boundary_ratio; a "
                            "two-expert Wan 2.2 pipeline (A14B) needs transformer, transformer_2 and boundary_ratio")
        group = pipe.vae_scale_factor_temporal
        if (num_frames - 1) % group:
            raise UserError(f"sampling.num_frames is {num_frames}; this Wan VAE needs {group}k + 1 frames")
        super().__init__(pipe, config, device, num_frames=num_frames, **placement)

    def euler_scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        """``FlowMatchEulerDiscreteScheduler(shift=flow_shift)`` for the pipeline's UniPC (or DPM-Solver) scheduler
        with flow sigmas (``model.flow_shift`` when set); a flow-matching Euler scheduler as it is."""
        config = self.pipe.scheduler.config
        if "flow_shift" not in config:
            return super().euler_scheduler()
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=config["num_train_timesteps"],
                                               shift=self.config.flow_shift or config["flow_shift"])

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        """UMT5 states of each prompt, zero past its last token, padded to ``model.max_sequence_length``."""
        embeds, negative = self.pipe.encode_prompt(
            prompt=prompts, negative_prompt=[self.config.negative_prompt] * len(prompts) if self.use_cfg else None,
            do_classifier_free_guidance=self.use_cfg, max_sequence_length=self.config.max_sequence_length,
            device=self.device)
        cond = {"prompt_embeds": embeds}
        if self.use_cfg:
            cond[NEGATIVE + "prompt_embeds"] = negative
        return cond

    def text_windows(self) -> list[TextWindow]:
        """UMT5 reads ``model.max_sequence_length`` tokens of the prompt as the pipeline cleans it (``prompt_clean``:
        HTML entities and runs of whitespace)."""
        count = tokens_of(self.pipe.tokenizer)
        return [TextWindow("UMT5", self.config.max_sequence_length,
                           lambda texts: count([prompt_clean(text) for text in texts]), MAX_SEQUENCE_LENGTH)]

    def conditioning_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"prompt_embeds": (self.config.max_sequence_length, self.transformer.config.text_dim)}

    def latent_frames(self) -> int:
        """``F' = (num_frames - 1) / 4 + 1`` latent frames."""
        return (self.num_frames - 1) // self.pipe.vae_scale_factor_temporal + 1

    def latent_shape(self, size: ImageSize) -> tuple[int, ...]:
        rows, cols = size.latent(self.pipe.vae_scale_factor_spatial)
        return (self.transformer.config.out_channels, self.latent_frames(), rows, cols)

    def image_seq_len(self, size: ImageSize) -> int:
        """The tokens the transformer sees: ``F' h w / 4``."""
        rows, cols = size.latent(self.pipe.vae_scale_factor_spatial)
        patch_t, patch_h, patch_w = self.transformer.config.patch_size
        return (self.latent_frames() // patch_t) * (rows // patch_h) * (cols // patch_w)

    def transformer_velocity(self, z: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The timestep ``1000 sigma`` stays float32, as the pipeline passes its scheduler's timesteps; one a sample
        under Wan 2.2's per-token timesteps too (all equal in text-to-video: the module docstring)."""
        return self.transformer_output(z, sigma.float() * 1000, cond)

    # ----- two experts (Wan 2.2 A14B) ----------------------------------------------------
    @property
    def boundary_timestep(self) -> float | None:
        """``boundary_ratio * num_train_timesteps`` of a two-expert pipeline (None for one transformer): the high-noise
        expert (``transformer``) gives the velocity at timesteps ``t >= boundary``, the low-noise one
        (``transformer_2``) below, as the pipeline switches them."""
        if self.pipe.transformer_2 is None:
            return None
        return self.pipe.config.boundary_ratio * self.pipe.scheduler.config.num_train_timesteps

    def high_noise(self, timesteps: torch.Tensor) -> torch.Tensor:
        """Which of ``timesteps`` [B] the high-noise expert takes, ``t >= boundary`` (a two-expert model's)."""
        return timesteps >= self.boundary_timestep

    def expert_switch(self, sigmas: torch.Tensor) -> int | None:
        """The first low-noise step of ``sigmas`` [T + 1] (T when every step is the high-noise expert's), the first
        whose timestep ``1000 sigma`` is below the boundary; None for one transformer."""
        if self.boundary_timestep is None:
            return None
        return int(self.high_noise(sigmas[:-1].float() * 1000).sum())  # sigmas decrease

    def trained_steps(self, sigmas: torch.Tensor) -> range:
        """The trained expert's steps: those whose timestep ``1000 sigma`` is on its side of the boundary (the first
        steps for ``model.expert: high_noise``, the rest for ``low_noise``, all of them for ``both``); a schedule
        that gives it none is refused in one line."""
        high, steps = self.expert_switch(sigmas), super().trained_steps(sigmas)
        if high is None or self.config.expert == "both":
            return steps
        trained = range(0, high) if self.config.expert == "high_noise" else range(high, len(steps))
        if not trained:
            raise UserError(f"none of the {len(steps)} steps is the {self.config.expert} expert's (the experts switch "
                            f"at sigma {self.boundary_timestep / 1000:g}): train the other expert (model.expert) or "
                            "take more sampling.num_steps")
        return trained

    def cfg_scale(self, sigma: torch.Tensor, dims: int) -> float | torch.Tensor:
        """``model.guidance_scale`` at the high-noise rows, ``model.guidance_scale_2`` at the low-noise ones (the
        pipeline's ``guidance_scale_2``), as a [B, 1, ...] tensor when it is set."""
        scale_2 = self.config.guidance_scale_2
        if self.boundary_timestep is None or scale_2 is None:
            return super().cfg_scale(sigma, dims)
        scales = torch.where(self.high_noise(sigma.float() * 1000), self.config.guidance_scale, scale_2)
        return scales.view(-1, *[1] * (dims - 1))

    def transformer_output(self, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The float32 output for video latents [B, C, F', h, w] at ``timestep`` ([B], or [B, tokens] per token)
        under the text states of ``cond`` (and its image states, Wan 2.1 image-to-video's): the transformer's, or of
        a two-expert model each row's expert's (:attr:`boundary_timestep`), rows of both experts split between them
        and put back in order."""
        if self.boundary_timestep is None or timestep.is_meta:  # a memory plan's tensors have no values: it traces the trained one
            return self.expert_output(self.transformer, latents, timestep, cond)
        high = self.high_noise(timestep.reshape(len(timestep), -1).amax(1))
        rows = [high.nonzero()[:, 0], (~high).nonzero()[:, 0]]
        parts = [self.expert_output(expert, latents[index], timestep[index], {k: v[index] for k, v in cond.items()})
                 for expert, index in zip([self.pipe.transformer, self.pipe.transformer_2], rows) if len(index)]
        return torch.cat(parts)[torch.cat(rows).argsort()] if len(parts) > 1 else parts[0]

    def expert_output(self, transformer: torch.nn.Module, latents: torch.Tensor, timestep: torch.Tensor,
                      cond: Conditioning) -> torch.Tensor:
        """One transformer's float32 output (see :meth:`transformer_output`)."""
        dtype = transformer.dtype
        image_states = cond[IMAGE_STATES].to(dtype) if IMAGE_STATES in cond else None
        return transformer(hidden_states=latents.to(dtype), timestep=timestep,
                           encoder_hidden_states=cond["prompt_embeds"].to(dtype),
                           encoder_hidden_states_image=image_states, return_dict=False)[0].float()

    def latent_statistics(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The VAE's per-channel ``latents_mean`` and ``latents_std``, float32 [1, C, 1, 1, 1]."""
        config = self.pipe.vae.config
        stats = {"device": device, "dtype": torch.float32}
        return (torch.tensor(config.latents_mean, **stats).view(1, -1, 1, 1, 1),
                torch.tensor(config.latents_std, **stats).view(1, -1, 1, 1, 1))

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """``video = vae.decode(z * latents_std + latents_mean)`` (per-channel statistics) -> frames
        ``[B, F, 3, H, W]``, mapped from [-1, 1] to [0, 1]."""
        vae = self.pipe.vae
        mean, std = self.latent_statistics(z.device)
        video = vae.decode((z.float() * std + mean).to(vae.dtype), return_dict=False)[0]  # [B, 3, F, H, W]
        return (video.float() / 2 + 0.5).clamp(0, 1).transpose(1, 2)


class FirstFrameModel(WanModel):
    """What Wan's image-to-video models share (runs of ``model.input_images: 1``): a prompt row
    (:class:`~jagg_core.edit_prompts.EditPrompt`) is a text and its video's first frame, centre-cropped and resized to
    ``model.condition_resolution``, which is ``sampling.resolution``; the video has frames after it."""

    encodes_input_images = True
    #: its family generates from text alone too (a run without ``model.input_images``), as messages say
    generates_from_text_too = True

    def __init__(self, pipe, config: ModelConfig, device: torch.device | str = "cpu", *, num_frames: int = 1,
                 **placement):
        super().__init__(pipe, config, device, num_frames=num_frames, **placement)
        if self.latent_frames() < 2:
            raise UserError(f"sampling.num_frames is {num_frames}: image-to-video makes frames after the input image, "
                            f"set it to {self.pipe.vae_scale_factor_temporal + 1} or more")

    def check_size(self, size: ImageSize) -> None:
        """The input image is the videos' first frame: ``model.condition_resolution`` is ``sampling.resolution``."""
        super().check_size(size)
        if self.config.condition_size != size:
            raise UserError(f"model.condition_resolution is {self.config.condition_size.config_value()} but "
                            f"sampling.resolution is {size.config_value()}: an image-to-video run's input image is its "
                            f"videos' first frame; set model.condition_resolution={size.config_value()}")

    def prompt_texts(self, prompts: list[str]) -> list[str]:
        return [row.instruction for row in self.rows(prompts)]

    def rows(self, prompts: list[str]) -> list[EditPrompt]:
        """``prompts`` as rows of a text and an image (:func:`~jagg_core.edit_prompts.edit_rows`)."""
        return edit_rows(prompts, self.family, 1, generates_from_text_too=self.generates_from_text_too,
                         does=MAKES_VIDEOS_FROM_IMAGES)

    def first_frames(self, rows: list[EditPrompt]) -> list[Image.Image]:
        """Each row's image at ``model.condition_resolution``: its video's first frame."""
        return [row.image(self.config.condition_size) for row in rows]

    def preprocessed(self, images: list[Image.Image]) -> torch.Tensor:
        """First frames as the pipeline preprocesses them: [N, 3, H, W] in [-1, 1]."""
        size = self.config.condition_size
        return self.pipe.video_processor.preprocess(images, size.height, size.width)

    def normalised_latents(self, video: torch.Tensor) -> torch.Tensor:
        """Videos [N, 3, F, H, W] in [-1, 1] -> their VAE latents (the posterior's mode) normalised with the VAE's
        per-channel statistics, ``(E(x) - latents_mean) / latents_std``: float32 [N, C, F', h, w]."""
        vae = self.pipe.vae
        latents = vae.encode(video.to(vae.device, vae.dtype)).latent_dist.mode().float()
        mean, std = self.latent_statistics(latents.device)
        return (latents - mean) / std


class WanImageToVideoModel(FirstFrameModel):
    """Wan 2.2 TI2V-5B image-to-video, as ``WanImageToVideoPipeline`` with ``expand_timesteps``.

    The row's first frame, preprocessed to [-1, 1], is encoded by the VAE as a one-frame video and normalised, ``c =
    (E(x) - latents_mean) / latents_std``: ``image_latents`` [C, 1, h, w], cached with the text's states (under CFG the
    negative prompt's branch sees it too, as in the pipeline). The sampler's latent ``z`` is the video's other ``F' -
    1`` latent frames; every transformer call sees ``[c ; z]`` along the frame axis, with timestep 0 on ``c``'s tokens
    and ``1000 sigma`` on ``z``'s (the pipeline's ``first_frame_mask``), and the velocity is ``z``'s. The pipeline
    steps the whole latent but writes ``c`` over its first frame before every transformer call and at the end, so the
    same videos come out; decoding puts ``c`` first (:meth:`decode_samples`).
    """

    def __init__(self, pipe, config: ModelConfig, device: torch.device | str = "cpu", *, num_frames: int = 1,
                 **placement):
        if not pipe.config.get("expand_timesteps", False):
            raise UserError(f"model '{config.name}' is a Wan model that generates from text alone (image-to-video "
                            "with model.input_images=1 is Wan 2.2 TI2V-5B's): unset model.input_images")
        super().__init__(pipe, config, device, num_frames=num_frames, **placement)

    def encode_prompts(self, prompts: list[str]) -> Conditioning:
        rows = self.rows(prompts)
        cond = super().encode_prompts(self.prompt_texts(rows))
        cond[IMAGE_LATENTS] = self.input_pixel_latents(self.preprocessed(self.first_frames(rows)))
        if self.use_cfg:
            cond[NEGATIVE + IMAGE_LATENTS] = cond[IMAGE_LATENTS]
        return cond

    def input_pixel_latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """Preprocessed first frames [N, 3, H, W] in [-1, 1] -> ``c`` [N, C, 1, h, w], encoded as one-frame videos."""
        return self.normalised_latents(pixels.unsqueeze(2))

    def conditioning_shapes(self) -> dict[str, tuple[int, ...]]:
        channels, _, rows, cols = super().latent_shape(self.config.condition_size)
        return {**super().conditioning_shapes(), IMAGE_LATENTS: (channels, 1, rows, cols)}

    def latent_shape(self, size: ImageSize) -> tuple[int, ...]:
        """The generated ``F' - 1`` latent frames."""
        channels, frames, rows, cols = super().latent_shape(size)
        return (channels, frames - 1, rows, cols)

    def transformer_velocity(self, z: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        first = cond[IMAGE_LATENTS].to(z.dtype)
        _, patch_h, patch_w = self.transformer.config.patch_size
        first_tokens = (first.shape[-2] // patch_h) * (first.shape[-1] // patch_w)
        generated_tokens = z.shape[2] * first_tokens
        timestep = torch.cat([torch.zeros((z.shape[0], first_tokens), device=z.device),
                              (sigma.float() * 1000)[:, None].expand(-1, generated_tokens)], dim=1)
        return self.transformer_output(torch.cat([first, z], dim=2), timestep, cond)[:, :, 1:]

    def decode_samples(self, z: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The videos ``[c ; z]``: the input image's latent frame, then the generated ones."""
        return self.decode(torch.cat([cond[IMAGE_LATENTS].to(z.dtype), z], dim=2))


def tiny_wan_pipeline(vae: AutoencoderKLWan, flow_shift: float, pipeline_class=WanPipeline, *,
                      transformer_settings: dict | None = None, **parts):
    """A tiny UMT5 encoder and transformer around ``vae``; UniPC with flow sigmas and ``flow_shift``, as the
    Diffusers repos' schedulers; ``transformer_settings``: the transformer's beyond the tiny ones (an image-to-video
    one's input channels); ``parts``: the pipeline's other components and settings (``expand_timesteps``)."""
    tokenizer, text_hidden, z_dim = tiny_t5_tokenizer(), 32, vae.config.z_dim
    text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=text_hidden, d_kv=8, d_ff=64,
                                               num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                                               pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    transformer = WanTransformer3DModel(**{**dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                                  in_channels=z_dim, out_channels=z_dim, text_dim=text_hidden,
                                                  freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                                                  qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
                                           **(transformer_settings or {})})
    with torch.device("cpu"):  # its sigmas: it copies them to the CPU, which a meta pipeline's build cannot
        scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                            flow_shift=flow_shift)
    return pipeline_class(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=scheduler,
                          transformer=transformer, **parts)


def tiny_wan21_vae() -> AutoencoderKLWan:
    """The Wan 2.1 video VAE in small (4x frames, 8x pixels, per-channel latent mean/std)."""
    return AutoencoderKLWan(base_dim=4, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.05, 0.0],
                            latents_std=[1.5, 0.8, 1.2, 1.0])


def build_tiny_wan() -> WanPipeline:
    """Wan 2.1 T2V-like: the Wan 2.1 video VAE and the scheduler of Wan-AI/Wan2.1-T2V-1.3B-Diffusers (flow_shift 3)."""
    return tiny_wan_pipeline(tiny_wan21_vae(), flow_shift=3.0)


def build_tiny_wan22() -> WanPipeline:
    """Wan 2.2 TI2V-5B-like: the Wan 2.2 VAE (residual blocks, 2x2 pixel patches: 4x frames, 16x pixels),
    per-token timesteps (``expand_timesteps``) and Wan-AI/Wan2.2-TI2V-5B-Diffusers' flow_shift 5."""
    vae = AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                           out_channels=12, patch_size=2, scale_factor_spatial=16,
                           latents_mean=[0.1, -0.2, 0.05, 0.0, 0.3, -0.1, 0.0, 0.2],
                           latents_std=[1.5, 0.8, 1.2, 1.0, 0.9, 1.1, 1.3, 0.7])
    return tiny_wan_pipeline(vae, flow_shift=5.0, expand_timesteps=True)


def build_tiny_wan_a14b() -> WanPipeline:
    """Wan 2.2 T2V-A14B-like: two tiny experts of the same shape (``transformer`` for the high-noise steps,
    ``transformer_2`` for the low-noise ones, switched at Wan-AI/Wan2.2-T2V-A14B-Diffusers' boundary_ratio 0.875)
    around the Wan 2.1 video VAE, flow_shift 3."""
    pipe = tiny_wan_pipeline(tiny_wan21_vae(), flow_shift=3.0)
    low_noise = WanTransformer3DModel.from_config(pipe.transformer.config)
    return WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae, scheduler=pipe.scheduler,
                       transformer=pipe.transformer, transformer_2=low_noise, boundary_ratio=0.875)


FAMILY = Family(label="Wan 2.1 / Wan 2.2 video", pipeline="WanPipeline", model=WanModel,
                edit_model=WanImageToVideoModel, edit_pipeline="WanImageToVideoPipeline", image_to_video=True,
                edit_label="Wan 2.2 TI2V-5B",
                tiny_builders={"tiny-wan": build_tiny_wan, "tiny-wan22": build_tiny_wan22,
                               "tiny-wan-a14b": build_tiny_wan_a14b},
                archs={"wan21-t2v-1.3b": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
                       "wan21-t2v-14b": "Wan-AI/Wan2.1-T2V-14B-Diffusers",
                       "wan22-ti2v-5b": "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
                       "wan22-t2v-a14b": "Wan-AI/Wan2.2-T2V-A14B-Diffusers"}, scheduler_shift_key="flow_shift")
