"""``temporal_consistency``: how little a video changes from one frame to the next, by CLIP image embeddings.

For a video of ``F`` frames with unit-normalised CLIP image embeddings ``e_1 .. e_F``::

    r(video) = (1 / (F - 1)) sum_{f=1}^{F-1} cos(e_f, e_{f+1})

in ``[-1, 1]``: 1 for a still video, lower the more consecutive frames differ in content. It reads every frame (not
``sampling.reward_frames`` of them) and needs a video model and at least 2 frames. Alone it rewards still videos;
pair it with an image reward on the frames (its weight sets how much motion is traded for smoothness).
"""

from __future__ import annotations

import torch

from ..errors import UserError
from .clip import ClipReward

#: frames embedded by one CLIP call
EMBED_BATCH = 64


class TemporalConsistency(ClipReward):
    """The mean cosine similarity of consecutive frames' CLIP image embeddings (CLIP ViT-L/14 by default)."""

    name = "temporal_consistency"
    takes_videos = True

    def __call__(self, videos: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        if videos.ndim != 5 or videos.shape[1] < 2:
            raise UserError("the temporal_consistency reward scores videos of 2 frames or more: use a video model "
                            "(Wan) with sampling.num_frames >= 5")
        count, frames = videos.shape[:2]
        embeds = torch.cat([self.image_embeds(part) for part in videos.flatten(0, 1).split(EMBED_BATCH)])
        embeds = embeds.view(count, frames, -1)
        return (embeds[:, 1:] * embeds[:, :-1]).sum(dim=-1).mean(dim=1).cpu()
