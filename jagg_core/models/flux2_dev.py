"""FLUX.2 [dev] (``Flux2Pipeline``): FLUX.2's 32B transformer, read by a Mistral Small 3.1 encoder.

Everything is FLUX.2 [klein]'s (:mod:`.flux2`: packed 2x2-patchified latents, (t, h, w, l) position ids, the
empirical dynamic shift, the VAE's batch-norm statistics, the LoRA targets of diffusers' FLUX.2 training script),
except:

- **Conditioning.** The hidden states of layers 10, 20 and 30 of Mistral3 (the pipeline's
  ``text_encoder_out_layers``) on the prompt in Mistral's chat format after the pipeline's system message, padded
  to ``model.max_sequence_length`` (system tokens included, as the pipeline's ``encode_prompt``), concatenated along
  the channels: ``prompt_embeds`` [B, L, 3 x 5120].
- **Guidance.** [dev] is guidance-distilled: its transformer embeds ``guidance = model.flux_guidance`` (the
  pipeline's ``guidance_scale``, 4.0 there), and the pipeline has no CFG, so ``model.guidance_scale`` must stay 1.

With ``model.input_images`` (1-3) a run edits with reference images, as ``Flux2Pipeline(image=...)``
(:class:`~.flux2.Flux2ReferenceImages`); the pipeline's caption upsampling, which shows the images to Mistral,
is not used.
"""

from __future__ import annotations

from diffusers import Flux2Pipeline, Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2 import format_input
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE

from ..config import ModelConfig
from ..errors import UserError
from .family import Family
from .flux2 import Flux2KleinModel, Flux2ReferenceImages, build_tiny_flux2
from .in_memory_parts import text_hidden_layers_read, tiny_mistral3_encoder, tiny_mistral_tokenizer
from .text_windows import MAX_SEQUENCE_LENGTH, TextWindow

#: width of the tiny Mistral3 text encoder (the prompt embedding is three of its layers side by side)
TINY_MISTRAL_HIDDEN = 16


class Flux2DevModel(Flux2KleinModel):
    family = "flux2-dev"

    def __init__(self, pipe, config: ModelConfig, device="cpu", **placement):
        if config.guidance_scale > 1.0:
            raise UserError(f"model '{config.name}' is FLUX.2 [dev], guidance-distilled: it takes no CFG; set "
                            "model.guidance_scale=1 and its guidance with model.flux_guidance (the pipeline's 4.0)")
        super().__init__(pipe, config, device, **placement)

    def text_windows(self) -> list[TextWindow]:
        """Mistral reads ``model.max_sequence_length`` tokens of the conversation the pipeline makes: its system
        message, then the prompt (``format_input``)."""
        return [TextWindow("Mistral", self.config.max_sequence_length, self.text_tokens, MAX_SEQUENCE_LENGTH)]

    def text_tokens(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        conversations = format_input(texts, system_message=SYSTEM_MESSAGE)
        ids = self.pipe.tokenizer.apply_chat_template(conversations, add_generation_prompt=False, tokenize=True,
                                                      return_dict=True)["input_ids"]
        return [len(row) for row in ids]


class Flux2DevEditModel(Flux2ReferenceImages, Flux2DevModel):
    """FLUX.2 [dev] with reference images (``Flux2Pipeline(image=...)``)."""


def build_tiny_flux2_dev() -> Flux2Pipeline:
    """tiny-flux2's VAE and scheduler with a guidance-embedding transformer and a tiny Mistral3 encoder deep enough
    for the hidden layers the pipeline stacks, its tokenizer knowing the pipeline's system message."""
    components = build_tiny_flux2().components
    tokenizer = tiny_mistral_tokenizer(SYSTEM_MESSAGE)
    text_encoder = tiny_mistral3_encoder(tokenizer, TINY_MISTRAL_HIDDEN, text_hidden_layers_read(Flux2Pipeline))
    transformer = Flux2Transformer2DModel.from_config({**components["transformer"].config, "guidance_embeds": True,
                                                       "joint_attention_dim": 3 * TINY_MISTRAL_HIDDEN})
    return Flux2Pipeline(scheduler=components["scheduler"], vae=components["vae"], text_encoder=text_encoder,
                         tokenizer=tokenizer, transformer=transformer)


FAMILY = Family(label="FLUX.2 [dev]", pipeline="Flux2Pipeline", model=Flux2DevModel, edit_model=Flux2DevEditModel,
                max_input_images=3, tiny_builders={"tiny-flux2-dev": build_tiny_flux2_dev},
                archs={"flux2-dev": "black-forest-labs/FLUX.2-dev"}, requires=("torchvision",),
                cfg_argument="", guidance_argument="guidance_scale")
