"""Image tensors to pictures: the one conversion used by rewards, the run directory's samples and the bench."""

from __future__ import annotations

import textwrap

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """``[N, 3, H, W]`` floats in ``[0, 1]`` -> ``N`` RGB PIL images (rounded to 8 bits)."""
    array = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8)
    return [Image.fromarray(np.ascontiguousarray(a.permute(1, 2, 0).cpu().numpy())) for a in array]


def captioned_grid(images: list[Image.Image], captions: list[str], title: str, columns: int = 8,
                   cell: int = 128) -> Image.Image:
    """The images tiled ``columns`` to a row, each scaled to ``cell`` pixels (small ones with sharp pixels) with its
    caption under it, and ``title`` above: one picture of an eval to compare with another iteration's."""
    font = ImageFont.load_default(size=10)
    line_height, lines = 12, 3
    wrap = max(8, cell // 6)  # characters per caption line
    header, footer = 22, line_height * lines + 4
    rows = -(-len(images) // columns)
    width = cell * min(columns, len(images))
    sheet = Image.new("RGB", (width, header + rows * (cell + footer)), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((4, 4), title, fill="black", font=ImageFont.load_default(size=14))
    for i, (image, caption) in enumerate(zip(images, captions)):
        x, y = (i % columns) * cell, header + (i // columns) * (cell + footer)
        scaled = image.convert("RGB").resize((cell, cell), Image.NEAREST if image.width < cell else Image.LANCZOS)
        sheet.paste(scaled, (x, y))
        for n, text in enumerate(textwrap.wrap(caption, wrap)[:lines]):
            draw.text((x + 2, y + cell + 2 + n * line_height), text, fill="black", font=font)
    return sheet
