"""Evaluate a ``jagg-shapes`` pipeline folder: the ``shapes`` reward of ODE samples of held-out prompts.

    python -m jagg_core.tiny.evaluate [FOLDER] [--steps 20] [--seed 1234] [--max-sequence-length 256]
                                      [--guidance-scale 1.0] [--grid grid.png]

Samples one image per held-out caption (:func:`jagg_core.tiny.dataset.caption_split`) with the
pipeline's Euler ODE sampler, no classifier-free guidance, a fixed seed; prints the mean reward
and its four parts, and optionally saves a grid of the samples (8 per row, in caption order).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from diffusers import StableDiffusion3Pipeline
from PIL import Image

from ..rewards.shapes import PARTS, shape_scores
from . import PIPELINE_DIR
from .dataset import caption_split

EVAL_STEPS = 20
EVAL_SEED = 1234


def load_pipeline(folder: str | Path) -> StableDiffusion3Pipeline:
    """The pipeline in ``folder``; its null T5 components must be passed as None to diffusers."""
    return StableDiffusion3Pipeline.from_pretrained(str(folder), text_encoder_3=None, tokenizer_3=None)


@torch.no_grad()
def sample(pipe: StableDiffusion3Pipeline, prompts: list[str], steps: int, seed: int,
           guidance_scale: float = 1.0, max_sequence_length: int = 256) -> torch.Tensor:
    """ODE samples ``[N, 3, H, W]`` in [0, 1], one per prompt, from one seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    out = pipe(prompt=prompts, num_inference_steps=steps, guidance_scale=guidance_scale, generator=generator,
               max_sequence_length=max_sequence_length, output_type="pt")
    return out.images.float()


def save_grid(images: torch.Tensor, path: Path, columns: int = 8, zoom: int = 4) -> None:
    """Save ``images`` [N, 3, H, W] as one PNG, ``columns`` per row, enlarged ``zoom`` times."""
    n, _, h, w = images.shape
    rows = -(-n // columns)
    grid = np.zeros((rows * h, columns * w, 3), dtype=np.uint8)
    array = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for i, image in enumerate(array):
        r, c = divmod(i, columns)
        grid[r * h:(r + 1) * h, c * w:(c + 1) * w] = image
    Image.fromarray(grid).resize((columns * w * zoom, rows * h * zoom), Image.Resampling.NEAREST).save(path)


def evaluate(folder: str | Path, steps: int = EVAL_STEPS, seed: int = EVAL_SEED, guidance_scale: float = 1.0,
             max_sequence_length: int = 256, grid: Path | None = None) -> dict[str, float]:
    """Mean ``shapes`` reward (and parts) of ODE samples of the 64 held-out captions."""
    pipe = load_pipeline(folder)
    pipe.set_progress_bar_config(disable=True)
    _, prompts = caption_split()
    images = sample(pipe, prompts, steps, seed, guidance_scale, max_sequence_length)
    parts = shape_scores(images, prompts)
    result = {"reward": torch.stack([parts[p] for p in PARTS]).mean(0).mean().item()}
    result.update({part: parts[part].mean().item() for part in PARTS})
    if grid is not None:
        save_grid(images, grid)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jagg_core.tiny.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", type=Path, default=PIPELINE_DIR)
    parser.add_argument("--steps", type=int, default=EVAL_STEPS)
    parser.add_argument("--seed", type=int, default=EVAL_SEED)
    parser.add_argument("--guidance-scale", type=float, default=1.0)
    parser.add_argument("--max-sequence-length", type=int, default=256, help="zero T5 tokens (pipeline default 256)")
    parser.add_argument("--grid", type=Path, default=None, help="save the samples as a PNG grid here")
    args = parser.parse_args(argv)
    result = evaluate(args.folder, args.steps, args.seed, args.guidance_scale, args.max_sequence_length, args.grid)
    print(json.dumps({k: round(v, 4) for k, v in result.items()}))


if __name__ == "__main__":
    main()
