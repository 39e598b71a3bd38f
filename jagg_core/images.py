"""Image (and video frame) tensors to pictures: the one conversion used by rewards, the run directory's samples
and the bench."""

from __future__ import annotations

import textwrap

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont, ImageOps

from .video import STRIP_FRAMES, frame_indices


def to_uint8(pixels: torch.Tensor) -> torch.Tensor:
    """Floats in ``[0, 1]`` -> ``uint8`` (rounded to 8 bits), same shape."""
    return (pixels.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """``[N, 3, H, W]`` floats in ``[0, 1]`` -> ``N`` RGB PIL images (rounded to 8 bits)."""
    return [Image.fromarray(np.ascontiguousarray(a.permute(1, 2, 0).cpu().numpy())) for a in to_uint8(images)]


def fitted_to_square(pictures: list[Image.Image], fit: str, fill: tuple[float, float, float]) -> list[Image.Image]:
    """The pictures as a square-input model (CLIP and its relatives) is to read them. ``fit`` pad: each picture
    whole, centred on a square of its longest side filled with ``fill`` (RGB in ``[0, 1]``: the model's mean colour,
    which its normalisation maps to 0), so the model's resize and centre crop keep all of it (a letterbox, as
    OpenCLIP's ``ResizeMaxSize`` makes); a square picture is unchanged. ``fit`` crop: as they are, so the model's
    centre crop cuts the long side of a wide or tall picture to the short side's length (the sides are not scored)."""
    if fit == "crop":
        return pictures
    colour = tuple(round(255 * channel) for channel in fill)
    return [picture if picture.width == picture.height else
            ImageOps.pad(picture, (max(picture.size),) * 2, color=colour) for picture in pictures]


def captioned_grid(images: list[Image.Image], captions: list[str], title: str, columns: int = 8,
                   cell: int = 128) -> Image.Image:
    """The images tiled ``columns`` to a row, each scaled to ``cell`` pixels wide and its own shape's height (small
    ones with sharp pixels) with its caption under it, and ``title`` above: one picture of an eval to compare with
    another iteration's. A row is as tall as the tallest scaled image."""
    font = ImageFont.load_default(size=10)
    line_height, lines = 12, 3
    wrap = max(8, cell // 6)  # characters per caption line
    header, footer = 22, line_height * lines + 4
    heights = [max(1, round(cell * image.height / image.width)) for image in images]
    cell_height = max(heights, default=cell)
    rows = -(-len(images) // columns)
    width = cell * min(columns, len(images))
    sheet = Image.new("RGB", (width, header + rows * (cell_height + footer)), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((4, 4), title, fill="black", font=ImageFont.load_default(size=14))
    for i, (image, height, caption) in enumerate(zip(images, heights, captions)):
        x, y = (i % columns) * cell, header + (i // columns) * (cell_height + footer)
        scaled = image.convert("RGB").resize((cell, height), Image.NEAREST if image.width < cell else Image.LANCZOS)
        sheet.paste(scaled, (x, y))
        for n, text in enumerate(textwrap.wrap(caption, wrap)[:lines]):
            draw.text((x + 2, y + cell_height + 2 + n * line_height), text, fill="black", font=font)
    return sheet


def still_frames(samples: torch.Tensor) -> torch.Tensor:
    """Images ``[N, 3, H, W]`` as they are; videos ``[N, F, 3, H, W]`` -> their middle frames ``[N, 3, H, W]`` (the
    still a grid of samples shows)."""
    return samples if samples.ndim == 4 else samples[:, samples.shape[1] // 2]


def frame_strip(video: torch.Tensor, count: int) -> Image.Image:
    """``count`` frames of ``video`` ``[F, 3, H, W]``, evenly spaced (:func:`jagg_core.video.frame_indices`), side
    by side, time running left to right."""
    frames = video[frame_indices(video.shape[0], count)]
    return to_pil(torch.cat(list(frames), dim=-1)[None])[0]


def video_array(video: torch.Tensor) -> np.ndarray:
    """``[F, 3, H, W]`` floats in ``[0, 1]`` -> ``uint8 [F, H, W, 3]`` (rounded to 8 bits), the frames an MP4 gets."""
    return np.ascontiguousarray(to_uint8(video).permute(0, 2, 3, 1).cpu().numpy())


def sample_pictures(samples: torch.Tensor) -> tuple[list[Image.Image], list[np.ndarray] | None]:
    """What the run directory writes of a batch of samples: images ``[N, 3, H, W]`` -> ``(PIL images, None)``; videos
    ``[N, F, 3, H, W]`` -> ``(their frame strips, their frames as uint8 arrays for the MP4s)``."""
    if samples.ndim == 4:
        return to_pil(samples), None
    return [frame_strip(video, STRIP_FRAMES) for video in samples], [video_array(video) for video in samples]
