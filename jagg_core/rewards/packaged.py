"""Rewards whose models come from their authors' PyPI packages (optional extras).

* ``hpsv2``: Human Preference Score v2 (Wu et al. 2023), ``cos(e_img, e_txt)`` of its
  fine-tuned OpenCLIP ViT-H/14, about 0.2-0.35. Package ``hpsv2``; weights ``xswu/HPSv2``.
* ``image_reward``: ImageReward (Xu et al. 2023), a BLIP-based preference model whose score is
  standardised over its training set (mean 0, std 1). Package ``image-reward``; weights
  ``THUDM/ImageReward``.

Both read a wide or tall sample whole by default (option ``fit``, as the CLIP rewards: :mod:`.clip`), centred on a
square of CLIP's mean colour, with which both models normalise, before their package's resize and centre crop.

The packages pin old versions of some dependencies, so they are not in requirements.txt.
"""

from __future__ import annotations

import importlib
from functools import cached_property

import torch
from transformers.image_utils import OPENAI_CLIP_MEAN  # both models normalise with CLIP's mean

from ..errors import UserError
from ..hubclient import download, hub_model
from ..images import fitted_to_square, to_pil
from .base import Reward

HPS_CHECKPOINTS = {"v2.0": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}


def import_extra(module: str, package: str, reward: str):
    """Import an optional package, or say in one line how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise UserError(f"reward '{reward}' needs the optional package '{package}' ({err}); "
                        f"run `pip install {package}`") from None


class HPSv2(Reward):
    """``cos(e_img, e_txt)`` of the HPS v2.x OpenCLIP ViT-H/14 (``version``: v2.0 or v2.1)."""

    name = "hpsv2"

    @cached_property
    def model(self):
        open_clip = import_extra("hpsv2.src.open_clip", "hpsv2", self.name)
        model, _, preprocess = open_clip.create_model_and_transforms("ViT-H-14", None, device=self.device,
                                                                     output_dict=True)
        path = download("xswu/HPSv2", HPS_CHECKPOINTS[self.options.version], "download the HPSv2 checkpoint")
        model.load_state_dict(torch.load(path, map_location="cpu")["state_dict"])
        return model.eval().requires_grad_(False).to(self.device), preprocess, open_clip.get_tokenizer("ViT-H-14")

    @torch.no_grad()
    def __call__(self, images, prompts):
        model, preprocess, tokenizer = self.model
        pictures = fitted_to_square(to_pil(images), self.options.fit, OPENAI_CLIP_MEAN)
        pixels = torch.stack([preprocess(picture) for picture in pictures]).to(self.device)
        outputs = model(pixels, tokenizer(prompts).to(self.device))
        return (outputs["image_features"] * outputs["text_features"]).sum(-1).float().cpu()


class ImageReward(Reward):
    """The ImageReward-v1.0 score of each image for its prompt."""

    name = "image_reward"

    @cached_property
    def model(self):
        package = import_extra("ImageReward", "image-reward", self.name)
        with hub_model("THUDM/ImageReward"):
            return package.load(self.options.model, device=self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def __call__(self, images, prompts):
        pictures = fitted_to_square(to_pil(images), self.options.fit, OPENAI_CLIP_MEAN)
        scores = [self.model.score(prompt, picture) for prompt, picture in zip(prompts, pictures)]
        return torch.tensor(scores, dtype=torch.float32)
