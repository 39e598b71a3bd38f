"""The size of the images (or video frames) a run samples: ``sampling.resolution``, a square's side (``512``) or
``WIDTHxHEIGHT`` (``832x480``, width first, as diffusers' model cards and most trainers write it).

:func:`parse_resolution` reads what a user wrote into the one canonical value the config keeps (an int for a square,
``"WxH"`` otherwise), and :class:`ImageSize` is the ``(height, width)`` the models, the sampler and the memory plan
compute with (height first, as tensors and the pipelines' ``height=, width=`` are laid out).
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

#: every side is a multiple of this: the largest VAE factor (8) times the largest patch (2) of the families
SIDE_MULTIPLE = 16
SIDE_RANGE = (16, 2048)
#: the sizes the page offers (one's own may be typed in): squares, and Wan 2.1's 832x480 and 16:9 landscapes and
#: portraits
COMMON_SIZES = ("256", "512", "768", "1024", "832x480", "480x832", "1024x576", "576x1024")
_WIDTH_BY_HEIGHT = re.compile(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*")


class ImageSize(NamedTuple):
    """Pixels of one image (or video frame): ``height`` rows by ``width`` columns."""

    height: int
    width: int

    @classmethod
    def square(cls, side: int) -> "ImageSize":
        return cls(side, side)

    @property
    def longest(self) -> int:
        return max(self)

    def latent(self, factor: int) -> tuple[int, int]:
        """``(height / factor, width / factor)``: the grid a VAE of spatial factor ``factor`` (times a patch) makes."""
        return self.height // factor, self.width // factor

    def tokens(self, factor: int) -> int:
        """Cells of :meth:`latent`'s grid: a transformer's image tokens when each covers ``factor`` pixels a side."""
        rows, cols = self.latent(factor)
        return rows * cols

    def scaled_to(self, longest: int) -> "ImageSize":
        """The same shape with its longer side ``longest``, each side rounded down to a multiple of 16 (at least 16)."""
        def side(pixels: int) -> int:
            return max(SIDE_MULTIPLE, pixels * longest // self.longest // SIDE_MULTIPLE * SIDE_MULTIPLE)
        return ImageSize(side(self.height), side(self.width))

    def shaped_like(self, width: int, height: int) -> "ImageSize":
        """About this size's area ``A`` in the shape ``width : height`` (a picture's), each side the nearest multiple
        of 16 within the sides' range: ``h = sqrt(A height / width)``, ``w = A / h``; a square picture gives a square
        of this area (this size itself, when it is one)."""
        area = self.height * self.width
        exact_height = math.sqrt(area * height / width)

        def side(pixels: float) -> int:
            return min(SIDE_RANGE[1], max(SIDE_RANGE[0], round(pixels / SIDE_MULTIPLE) * SIDE_MULTIPLE))
        return ImageSize(side(exact_height), side(area / exact_height))

    def config_value(self) -> str | int:
        """What ``sampling.resolution`` says for this size: the side of a square, else ``"WIDTHxHEIGHT"``."""
        return self.height if self.height == self.width else f"{self.width}x{self.height}"


def parse_resolution(value: object) -> ImageSize:
    """``512``, ``"512"`` or ``"832x480"`` (width x height) -> :class:`ImageSize`; ``ValueError`` in one line for
    anything else, a side out of range or not a multiple of 16."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"resolution must be a side in pixels (512) or WIDTHxHEIGHT (832x480), got {value!r}")
    text = str(value).strip()
    match = _WIDTH_BY_HEIGHT.fullmatch(text)
    if match:
        size = ImageSize(int(match[2]), int(match[1]))
    elif text.isdigit():
        size = ImageSize.square(int(text))
    else:
        raise ValueError(f"resolution must be a side in pixels (512) or WIDTHxHEIGHT (832x480), got {text[:40]!r}")
    low, high = SIDE_RANGE
    for name, side in (("width", size.width), ("height", size.height)):
        said = str(side) if size.height == size.width else f"{name} {side}"
        if not low <= side <= high:
            raise ValueError(f"resolution must be {low} to {high} pixels, got {said}")
        if side % SIDE_MULTIPLE:
            raise ValueError(f"resolution must be a multiple of {SIDE_MULTIPLE}, got {said}")
    return size
