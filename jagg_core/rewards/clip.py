"""Rewards computed from CLIP embeddings (transformers ``CLIPModel`` + ``CLIPProcessor``).

With unit-normalised embeddings ``e_img`` and ``e_txt``:

* ``clip_score``: ``cos(e_img, e_txt)`` with CLIP ViT-L/14, in ``[-1, 1]``.
* ``pickscore``:  ``exp(logit_scale) * cos(e_img, e_txt)`` with PickScore_v1 (a fine-tuned
  CLIP-H/14, Kirstain et al. 2023), about 18-24 for typical images.
* ``aesthetic``:  ``MLP(e_img)`` with the LAION improved aesthetic predictor (an MLP on CLIP
  ViT-L/14 image embeddings trained on SAC + LOGOS + AVA ratings), about 1-10.
* ``clip_directional`` (an editing reward, InstructPix2Pix's CLIP directional similarity with the instruction in
  place of the caption pair): ``cos(e_img(out) - e_img(in), e_txt(instruction) - e_txt(reference_text))`` with
  CLIP ViT-L/14, in ``[-1, 1]``: whether the image changed the way the instruction says, relative to a neutral
  caption (``reference_text``, default "a photo"); an output equal to its input scores 0.

Options (:mod:`.catalog`): ``model_id`` / ``processor_id`` (and the aesthetic ``head``) accept a
Hub id or a local folder (file), so a model saved with ``save_pretrained`` works too. ``fit``: a wide or tall sample
is read whole, centred on a square of the processor's mean colour (``pad``, the default), or cut to its centre square
by the processor's crop (``crop``); see :func:`jagg_core.images.fitted_to_square`.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import torch
from PIL import Image
from torch import nn

from ..errors import UserError
from ..hubclient import download, hub_model
from ..images import fitted_to_square, to_pil
from .base import Reward

def load_clip(model_id: str, processor_id: str, device: torch.device):
    """``(CLIPModel, CLIPProcessor)`` in eval mode on ``device``, without gradients."""
    from transformers import CLIPModel, CLIPProcessor

    with hub_model(model_id):
        model = CLIPModel.from_pretrained(model_id)
    with hub_model(processor_id):
        processor = CLIPProcessor.from_pretrained(processor_id)
    return model.eval().requires_grad_(False).to(device), processor


@torch.no_grad()
def clip_image_embeds(clip, pictures: list[Image.Image], fit: str) -> torch.Tensor:
    """Unit-normalised image embeddings [N, D] of ``pictures`` by ``clip = (CLIPModel, CLIPProcessor)``, each
    fitted to the model's square input by ``fit`` (:func:`jagg_core.images.fitted_to_square`)."""
    model, processor = clip
    pictures = fitted_to_square(pictures, fit, processor.image_processor.image_mean)
    pixels = processor(images=pictures, return_tensors="pt")["pixel_values"].to(model.device)
    return nn.functional.normalize(model.get_image_features(pixel_values=pixels).pooler_output.float(), dim=-1)


@torch.no_grad()
def clip_text_embeds(clip, texts: list[str]) -> torch.Tensor:
    """Unit-normalised text embeddings [N, D] of ``texts``, cut to the model's window."""
    model, processor = clip
    tokens = processor(text=texts, padding=True, truncation=True,
                       max_length=model.config.text_config.max_position_embeddings, return_tensors="pt")
    features = model.get_text_features(input_ids=tokens["input_ids"].to(model.device),
                                       attention_mask=tokens["attention_mask"].to(model.device)).pooler_output
    return nn.functional.normalize(features.float(), dim=-1)


class ClipReward(Reward):
    """Shared CLIP plumbing: the model is loaded on first use; embeddings are unit-normalised."""

    @cached_property
    def clip(self):
        return load_clip(self.options.model_id, self.options.processor_id or self.options.model_id, self.device)

    def image_embeds(self, images: torch.Tensor) -> torch.Tensor:
        return clip_image_embeds(self.clip, to_pil(images), self.options.fit)

    def text_embeds(self, prompts: list[str]) -> torch.Tensor:
        return clip_text_embeds(self.clip, prompts)

    def similarity(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """``cos(e_img_i, e_txt_i)`` for each image and its own prompt."""
        return (self.image_embeds(images) * self.text_embeds(prompts)).sum(-1).cpu()


class ClipScore(ClipReward):
    """``cos(e_img, e_txt)`` with CLIP ViT-L/14."""

    name = "clip_score"

    def __call__(self, images, prompts):
        return self.similarity(images, prompts)


class PickScore(ClipReward):
    """``exp(logit_scale) * cos(e_img, e_txt)`` with PickScore_v1 and its CLIP-H processor."""

    name = "pickscore"

    def __call__(self, images, prompts):
        scale = self.clip[0].logit_scale.exp().float().cpu()
        return scale * self.similarity(images, prompts)


class AestheticHead(nn.Module):
    """The LAION improved aesthetic predictor MLP: 768 -> 1024 -> 128 -> 64 -> 16 -> 1."""

    def __init__(self, dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(dim, 1024), nn.Dropout(0.2),
            nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.layers(embeds).squeeze(-1)


def load_aesthetic_head(head: str, dim: int, device: torch.device) -> AestheticHead:
    """The MLP from a local ``.pth`` file or ``OWNER/REPO/FILENAME`` on the Hub."""
    path = Path(head)
    if not path.is_file():
        repo_id, _, filename = head.rpartition("/")
        if not repo_id:
            raise UserError(f"the aesthetic head '{head}' is neither a file nor OWNER/REPO/FILENAME on the Hub")
        path = download(repo_id, filename, f"download the aesthetic head {head}")
    model = AestheticHead(dim)
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return model.eval().requires_grad_(False).to(device)


class Aesthetic(ClipReward):
    """``MLP(e_img)``: the LAION improved aesthetic predictor on CLIP ViT-L/14 image embeddings."""

    name = "aesthetic"

    @cached_property
    def head(self) -> AestheticHead:
        return load_aesthetic_head(self.options.head, self.clip[0].config.projection_dim, self.device)

    @torch.no_grad()
    def __call__(self, images, prompts):
        return self.head(self.image_embeds(images)).float().cpu()


class ClipDirectional(ClipReward):
    """``cos(e_img(out) - e_img(in), e_txt(instruction) - e_txt(reference_text))``: an editing reward (module doc)."""

    name = "clip_directional"
    takes_inputs = True

    def __call__(self, images, prompts, inputs=None):
        if inputs is None:
            raise UserError("the clip_directional reward scores edits, but the prompts have no input images; give "
                            "prompts.source an image folder or hf://DATASET:TEXT_COLUMN,IMAGE_COLUMN")
        instructions = [getattr(prompt, "instruction", prompt) for prompt in prompts]
        image_direction = self.image_embeds(images) - self.image_embeds(inputs)
        text_direction = self.text_embeds(instructions) - self.text_embeds([self.options.reference_text])
        return nn.functional.cosine_similarity(image_direction, text_direction, dim=-1).cpu()
