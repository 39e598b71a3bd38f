"""The training and held-out captions of the tiny pipeline, and its jittered training images.

The held-out captions are exactly the eval prompts that :func:`jagg_core.prompts.split_prompts`
picks from the built-in ``shapes`` set with ``eval_count=64`` and ``split_seed=0``; the model
never sees them in training, so the eval reward measures generalisation to new combinations. A
run with ``split_seed=0`` and any ``eval_count`` up to 64 evaluates on the first ``eval_count``
of them (``random.Random(0).sample`` draws them one by one, in the same order).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from ..prompts import split_prompts
from ..shapes_world import POSITIONS, all_scenes, draw_array, parse_caption

EVAL_COUNT = 64
SPLIT_SEED = 0


def all_captions() -> list[str]:
    """Every caption of the grammar, in the fixed order of :func:`all_scenes`."""
    return [scene.caption for scene in all_scenes()]


def caption_split() -> tuple[list[str], list[str]]:
    """``(train, held_out)`` captions; ``held_out`` is the trainer's 64-prompt eval split."""
    return split_prompts(all_captions(), EVAL_COUNT, SPLIT_SEED)


def render_dataset(captions: list[str], copies: int, size: int, seed: int,
                   wrong_position: float = 0.0) -> tuple[torch.Tensor, list[str]]:
    """``copies`` jittered drawings of each caption: images ``[N, 3, size, size]`` in [0, 1].

    Each drawing varies the shape's size (0.36..0.48 of the image) and moves its centre by up to
    0.04 of the image, from a generator seeded with ``seed``. With probability ``wrong_position``
    a drawing puts the shape at one of the other four positions, drawn uniformly, while keeping
    its caption: caption noise, as in web alt-text, so that the trained model follows the
    position word only part of the time (the gap a reward fine-tune closes).
    """
    rng = np.random.default_rng(seed)
    scenes = [parse_caption(c) for c in captions]
    if None in scenes:
        raise ValueError(f"not a shapes caption: {captions[scenes.index(None)]!r}")
    images, labels = [], []
    for _ in range(copies):
        for scene in scenes:
            scale = float(rng.uniform(0.36, 0.48))
            offset = tuple(float(o) for o in rng.uniform(-0.04, 0.04, size=2))
            drawn = scene
            if rng.uniform() < wrong_position:
                others = [p for p in POSITIONS if p != scene.position]
                drawn = replace(scene, position=others[rng.integers(len(others))])
            images.append(draw_array(drawn, size=size, scale=scale, offset=offset))
            labels.append(scene.caption)
    return torch.from_numpy(np.stack(images)), labels
