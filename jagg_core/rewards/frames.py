"""Rewards on video samples: an image reward scores some frames of each video, a video reward the whole video.

For videos ``[N, F, 3, H, W]`` and an image reward ``r``, the video's score is the mean over the
``K = min(sampling.reward_frames, F)`` frames :func:`jagg_core.video.frame_indices` chooses (evenly spaced from the
first frame to the last), each scored with the video's prompt::

    r(video) = (1 / K) sum_k r(frame_{i_k})

A video reward (``Reward.takes_videos``, e.g. ``temporal_consistency``) is called with the videos themselves.
Images ``[N, 3, H, W]`` go to every reward as they are. An editing reward (``takes_inputs``) of an image-to-video
run is given each frame's input image, its video's (``inputs``).
"""

from __future__ import annotations

import torch

from ..video import frame_indices
from .base import Reward


def _scores(values) -> torch.Tensor:
    return torch.as_tensor(values).detach().float().cpu().reshape(-1)


def score_samples(reward: Reward, samples: torch.Tensor, prompts: list[str], reward_frames: int,
                  inputs: torch.Tensor | None = None) -> torch.Tensor:
    """``reward``'s scores of the samples (images or videos, see the module docstring), float32 on the CPU;
    ``inputs``: the samples' input images [N, 3, H, W], given to an editing reward as its third argument."""
    if samples.ndim == 4 or reward.takes_videos:
        return _scores(reward(samples, prompts, *([] if inputs is None else [inputs])))
    chosen = frame_indices(samples.shape[1], reward_frames)
    frames = samples[:, chosen].flatten(0, 1)
    each_frames = [] if inputs is None else [inputs.repeat_interleave(len(chosen), dim=0)]
    scores = _scores(reward(frames, [p for p in prompts for _ in chosen], *each_frames))
    if scores.shape[0] != frames.shape[0]:
        raise ValueError(f"reward '{reward.name}' returned {scores.shape[0]} scores for {frames.shape[0]} frames")
    return scores.view(samples.shape[0], len(chosen)).mean(dim=1)
