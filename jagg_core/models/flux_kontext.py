"""FLUX.1 Kontext (``FluxKontextPipeline``): FLUX.1 [dev] editing an input image.

Everything is FLUX.1's (:mod:`.flux`: T5 + pooled CLIP conditioning of the instruction, guidance embedding,
timestep = sigma, true CFG), plus the input image (:mod:`.editing`): its packed latents follow the noisy tokens in
the sequence, with image ids ``(1, row, col)`` where the generated image's are ``(0, row, col)``, as
``FluxKontextPipeline.prepare_latents`` makes them. The pipeline's own ``__call__`` also resizes the input to one of
Kontext's preferred resolutions (``_auto_resize``, the one nearest the input's shape); here it is
``model.condition_resolution``, which may be one of them (``PREFERRED_KONTEXT_RESOLUTIONS``: 1024x1024, 1184x880,
1248x832, ...).
"""

from __future__ import annotations

import torch
from diffusers import FluxKontextPipeline

from .base import Conditioning
from .editing import EditingFlowModel
from .family import Family
from .flux import FluxModel, build_tiny_flux


class FluxKontextModel(EditingFlowModel, FluxModel):
    family = "flux-kontext"

    def encode_without_cfg(self, prompts: list[str]) -> Conditioning:
        return super().encode_without_cfg([row.instruction for row in prompts])

    def joint_velocity(self, tokens: torch.Tensor, grid: tuple[int, int], sigma: torch.Tensor,
                       cond: Conditioning) -> torch.Tensor:
        condition_ids = self.image_ids(self.input_image_grid, tokens.device)
        condition_ids[:, 0] = 1
        image_ids = torch.cat([self.image_ids(grid, tokens.device), condition_ids])
        return self.flux_forward(tokens, sigma, cond, image_ids)


def build_tiny_flux_kontext() -> FluxKontextPipeline:
    """tiny-flux's components in FluxKontextPipeline (FLUX.1 Kontext [dev] has FLUX.1 [dev]'s architecture)."""
    return FluxKontextPipeline(**build_tiny_flux().components)


FAMILY = Family(label="FLUX.1 Kontext", pipeline="FluxKontextPipeline", model=FluxKontextModel,
                tiny_builders={"tiny-flux-kontext": build_tiny_flux_kontext},
                archs={"flux-kontext": "black-forest-labs/FLUX.1-Kontext-dev"}, edits_images=True,
                cfg_argument="true_cfg_scale", guidance_argument="guidance_scale",
                resizes_to_its_area=True)
