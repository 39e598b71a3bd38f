"""FLUX.2 [klein] (``Flux2KleinPipeline``): packed 2x2-patchified latents, Qwen3 text states, timestep = sigma.

- **Latents.** The VAE's latent [C, h, w] is patchified 2x2 into [4C, h/2, w/2] and packed into the token
  sequence [(h/2)(w/2), 4C] the transformer sees (the sampler's space, as FLUX.1's). Image token ids are
  (t, row, col, layer) = (0, i, j, 0), text token ids (0, 0, 0, l), both 2-D.
- **Conditioning.** The Qwen3 hidden states of layers 9, 18 and 27 (the pipeline's ``text_encoder_out_layers``)
  of the chat-templated prompt, padded to ``model.max_sequence_length`` and concatenated along the channels:
  ``prompt_embeds`` [B, L, 3 D]. The transformer attends to every token, padding included, as in the pipeline.
- **Time.** The transformer is called with ``timestep = sigma`` (it scales by 1000 itself); its output is the
  velocity ``v = noise - x0``. A guidance-distilled transformer (``guidance_embeds``, FLUX.2 [dev]) also takes
  ``guidance = model.flux_guidance`` (the pipeline's ``guidance_scale``), [klein] none.
- **Schedule.** ``sigmas = linspace(1, 1/n, n)`` with the dynamic shift ``mu = compute_empirical_mu(seq_len, n)``
  of the pipeline (it depends on the step count too).
- **Guidance.** The undistilled (base) models take CFG ``v_neg + g (v_pos - v_neg)`` with ``model.negative_prompt``
  (the pipeline encodes "" unless given ``negative_prompt_embeds``); a step-distilled model (``is_distilled`` in
  its model_index.json, FLUX.2 [klein] 4B) takes none.
- **Decode.** Unpack, undo the VAE's batch-norm statistics ``z * sqrt(running_var + eps) + running_mean``,
  unpatchify, ``vae.decode``, map [-1, 1] to [0, 1].
"""

from __future__ import annotations

import torch
from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
from transformers import Qwen3ForCausalLM

from ..config import ModelConfig
from ..edit_prompts import EditPrompt
from ..errors import UserError
from ..image_size import ImageSize
from .base import Conditioning, PackedFlowModel
from .editing import EditingFlowModel
from .family import Family
from .in_memory_parts import text_hidden_layers_read, tiny_qwen3_config, tiny_qwen3_tokenizer
from .text_windows import MAX_SEQUENCE_LENGTH, TextWindow, chat_tokens

#: As diffusers' FLUX.2 [klein] LoRA training script (examples/dreambooth/train_dreambooth_lora_flux2_klein.py):
#: the double-stream blocks' attention projections and the single-stream blocks' fused QKV-MLP input projection;
#: each single-stream block's ``attn.to_out`` is added by name (see :attr:`Flux2KleinModel.default_lora_targets`).
DOUBLE_STREAM_AND_FUSED_TARGETS = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj")


class Flux2KleinModel(PackedFlowModel):
    family = "flux2"

    def __init__(self, pipe, config: ModelConfig, device: torch.device | str = "cpu", **placement):
        if config.guidance_scale > 1.0 and pipe.config.get("is_distilled", False):
            raise UserError(f"model '{config.name}' is a step-distilled FLUX.2 [klein], which takes no CFG; set "
                            "model.guidance_scale=1 or use a FLUX.2 [klein] base model")
        super().__init__(pipe, config, device, **placement)

    @property
    def default_lora_targets(self) -> tuple[str, ...]:
        """The training script's targets; its ``single_transformer_blocks.{i}.attn.to_out`` for every
        single-stream block of this transformer (the script names 24, the 9B model's count)."""
        singles = self.transformer.config.num_single_layers
        return DOUBLE_STREAM_AND_FUSED_TARGETS + tuple(f"single_transformer_blocks.{i}.attn.to_out"
                                                       for i in range(singles))

    def encode_without_cfg(self, prompts: list[str]) -> Conditioning:
        embeds, _text_ids = self.pipe.encode_prompt(prompt=list(prompts), device=self.device,
                                                    max_sequence_length=self.config.max_sequence_length)
        return {"prompt_embeds": embeds}

    def text_windows(self) -> list[TextWindow]:
        """Qwen3 reads ``model.max_sequence_length`` tokens of the prompt in its chat template, without thinking."""
        return [TextWindow("Qwen3", self.config.max_sequence_length,
                           chat_tokens(self.pipe.tokenizer, enable_thinking=False), MAX_SEQUENCE_LENGTH)]

    def dynamic_shift(self, num_steps: int, size: ImageSize) -> float:
        return compute_empirical_mu(image_seq_len=self.image_seq_len(size), num_steps=num_steps)

    @staticmethod
    def grid_ids(time: int, grid: tuple[int, int], device: torch.device) -> torch.Tensor:
        """(t, h, w, l) ids [rows cols, 4] of a ``grid`` of ``(rows, cols)`` image tokens in row-major order."""
        zero, rows, cols = (torch.tensor([time], device=device), torch.arange(grid[0], device=device),
                            torch.arange(grid[1], device=device))
        return torch.cartesian_prod(zero, rows, cols, torch.zeros(1, dtype=torch.long, device=device))

    def token_velocity(self, tokens: torch.Tensor, grid: tuple[int, int], sigma: torch.Tensor,
                       cond: Conditioning) -> torch.Tensor:
        return self.flux2_forward(tokens, grid, sigma, cond, [])

    def flux2_forward(self, tokens: torch.Tensor, grid: tuple[int, int], sigma: torch.Tensor, cond: Conditioning,
                      reference_ids: list[torch.Tensor]) -> torch.Tensor:
        """The transformer's output for ``tokens``: the generated image's ``grid`` of tokens at ids (0, i, j, 0), then
        the reference images' tokens at ``reference_ids`` (none for a text-to-image run); the text's at (0, 0, 0, l)."""
        dtype = self.transformer.dtype
        embeds = cond["prompt_embeds"]
        zero, device = torch.zeros(1, dtype=torch.long, device=tokens.device), tokens.device
        image_ids = self.grid_ids(0, grid, device)
        text_ids = torch.cartesian_prod(zero, zero, zero, torch.arange(embeds.shape[1], device=device))
        return self.transformer(hidden_states=tokens.to(dtype), timestep=sigma.to(dtype),
                                guidance=self.guidance(tokens), encoder_hidden_states=embeds.to(dtype),
                                txt_ids=text_ids, img_ids=torch.cat([image_ids, *reference_ids]),
                                return_dict=False)[0].float()

    def conditioning_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"prompt_embeds": (self.config.max_sequence_length, self.transformer.config.joint_attention_dim)}

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        patches = z.permute(0, 3, 1, 2)  # [B, 4C, h/2, w/2]
        stats = {"device": patches.device, "dtype": patches.dtype}
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(**stats)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(**stats)
        latents = self.pipe._unpatchify_latents(patches * std + mean)
        images = vae.decode(latents.to(vae.dtype), return_dict=False)[0]
        return (images.float() / 2 + 0.5).clamp(0, 1)


class Flux2ReferenceImages(EditingFlowModel):
    """FLUX.2 editing with ``model.input_images`` reference images, as its pipelines' ``__call__(image=...)``
    (listed before the family's model, e.g. ``Flux2KleinEditModel(Flux2ReferenceImages, Flux2KleinModel)``): the
    instruction is encoded as any prompt (the text encoder sees text alone); reference image k (from 0) is
    VAE-encoded, patchified and batch-norm normalised (the pipeline's ``_encode_vae_image``) and packed, and its
    tokens follow the generated image's with ids (t, h, w, l) = (10 + 10 k, i, j, 0) (``_prepare_image_ids``)."""

    #: the time coordinate of reference image k is REFERENCE_T_STEP (1 + k), as the pipelines' ``scale``
    REFERENCE_T_STEP = 10

    def encode_without_cfg(self, prompts: list[EditPrompt]) -> Conditioning:
        return super().encode_without_cfg([row.instruction for row in prompts])

    def pack_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pipe._pack_latents(latents)

    def joint_velocity(self, tokens: torch.Tensor, grid: tuple[int, int], sigma: torch.Tensor,
                       cond: Conditioning) -> torch.Tensor:
        reference = self.input_image_grid
        reference_ids = [self.grid_ids(self.REFERENCE_T_STEP * (1 + k), reference, tokens.device)
                         for k in range(self.input_images)]
        return self.flux2_forward(tokens, grid, sigma, cond, reference_ids)


class Flux2KleinEditModel(Flux2ReferenceImages, Flux2KleinModel):
    """FLUX.2 [klein] with reference images (``Flux2KleinPipeline(image=...)``)."""


def build_tiny_flux2() -> Flux2KleinPipeline:
    """FLUX.2 [klein]-like, undistilled (CFG allowed): a tiny Qwen3 causal LM deep enough for the hidden layers the
    pipeline stacks, the FLUX.2 VAE (2x2 patchified latents, batch-norm statistics, set to non-trivial values
    here) and a dynamically shifted scheduler."""
    tokenizer, text_hidden, z_dim = tiny_qwen3_tokenizer(), 16, 4
    text_encoder = Qwen3ForCausalLM(tiny_qwen3_config(tokenizer, text_hidden,
                                                      text_hidden_layers_read(Flux2KleinPipeline)))
    vae = AutoencoderKLFlux2(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, layers_per_block=1, latent_channels=z_dim,
                             norm_num_groups=4, sample_size=32, use_quant_conv=False, use_post_quant_conv=False)
    channels = vae.bn.num_features
    vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, channels))
    vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, channels))
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=channels, num_layers=1, num_single_layers=2,
                                          attention_head_dim=16, num_attention_heads=2,
                                          joint_attention_dim=3 * text_hidden, timestep_guidance_channels=32,
                                          axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    return Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=False)


FAMILY = Family(label="FLUX.2 [klein]", pipeline="Flux2KleinPipeline", model=Flux2KleinModel,
                edit_model=Flux2KleinEditModel, max_input_images=3, tiny_builders={"tiny-flux2": build_tiny_flux2},
                archs={"flux2-klein-4b": "black-forest-labs/FLUX.2-klein-4B"},
                negative_prompt_argument="negative_prompt_embeds")
