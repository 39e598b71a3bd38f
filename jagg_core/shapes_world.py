"""The coloured-shapes world: its vocabulary, caption grammar and drawing code.

One caption describes one image: ``"a {colour} {shape} on a {colour} background, {position}"``,
for example ``"a red circle on a blue background, top left"``. The shape and background colours
differ. The same drawing code makes the training set of the tiny pipeline
(:mod:`jagg_core.tiny.build`) and the known-content images of the ``shapes`` reward's tests.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from .errors import UserError

#: Palette, RGB in 0..255; chosen to be far apart from each other.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 230),
    "yellow": (245, 215, 40),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
#: Centre of the shape for each position, as fractions of the image width and height.
POSITIONS: dict[str, tuple[float, float]] = {
    "top left": (0.25, 0.25),
    "top right": (0.75, 0.25),
    "bottom left": (0.25, 0.75),
    "bottom right": (0.75, 0.75),
    "center": (0.5, 0.5),
}
GRAMMAR = "a {colour} {shape} on a {colour} background, {position}"
#: Every word a caption can contain, for the tokenizer's vocabulary.
WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(["a", "on", "background", ","] + list(COLOURS) + list(SHAPES)
                  + [w for p in POSITIONS for w in p.split()])
)

_CAPTION_RE = re.compile(
    r"^\s*a\s+(?P<colour>{c})\s+(?P<shape>{s})\s+on\s+a\s+(?P<background>{c})\s+background\s*,\s*"
    r"(?P<position>{p})\s*\.?\s*$".format(
        c="|".join(COLOURS), s="|".join(SHAPES), p="|".join(p.replace(" ", r"\s+") for p in POSITIONS)
    ),
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Scene:
    """What a caption says: the shape's colour and kind, the background colour, the position."""

    colour: str
    shape: str
    background: str
    position: str

    @property
    def caption(self) -> str:
        return f"a {self.colour} {self.shape} on a {self.background} background, {self.position}"


def parse_caption(caption: str) -> Scene | None:
    """The scene a caption describes, or None when it does not follow :data:`GRAMMAR`."""
    match = _CAPTION_RE.match(caption)
    if match is None:
        return None
    g = {k: v.lower() for k, v in match.groupdict().items()}
    return Scene(g["colour"], g["shape"], g["background"], " ".join(g["position"].split()))


def read_captions(prompts: list[str], reader: str = "the shapes reward") -> list[Scene]:
    """The scene of each prompt; the first that does not follow :data:`GRAMMAR` is a :class:`UserError` naming
    ``reader``, the reward or judge that needs the grammar."""
    scenes = []
    for prompt in prompts:
        scene = parse_caption(prompt)
        if scene is None:
            raise UserError(f"{reader} cannot read the prompt {str(prompt)[:80]!r}; it expects '{GRAMMAR}' with colour "
                            f"in {', '.join(COLOURS)}, shape in {', '.join(SHAPES)}, position in "
                            f"{', '.join(POSITIONS)}; the built-in prompt set shapes follows it")
        scenes.append(scene)
    return scenes


def all_scenes() -> list[Scene]:
    """Every scene of the grammar (shape colour != background colour), in a fixed order."""
    return [
        Scene(c, s, b, p)
        for c, b, s, p in itertools.product(COLOURS, COLOURS, SHAPES, POSITIONS)
        if c != b
    ]


def draw(scene: Scene, size: int = 32, scale: float = 0.42, offset: tuple[float, float] = (0.0, 0.0),
         supersample: int = 4) -> Image.Image:
    """Draw ``scene`` as an RGB image of ``size`` x ``size`` pixels, antialiased.

    ``scale`` is the shape's width as a fraction of the image; ``offset`` moves its centre by
    fractions of the image (the dataset jitters both; the defaults draw the canonical scene).
    """
    big = size * supersample
    image = Image.new("RGB", (big, big), COLOURS[scene.background])
    pen = ImageDraw.Draw(image)
    cx, cy = POSITIONS[scene.position]
    cx, cy = (cx + offset[0]) * big, (cy + offset[1]) * big
    half = scale * big / 2
    fill = COLOURS[scene.colour]
    if scene.shape == "circle":
        pen.ellipse([cx - half, cy - half, cx + half, cy + half], fill=fill)
    elif scene.shape == "square":
        pen.rectangle([cx - half, cy - half, cx + half, cy + half], fill=fill)
    elif scene.shape == "triangle":
        pen.polygon([(cx, cy - half), (cx + half, cy + half), (cx - half, cy + half)], fill=fill)
    else:
        raise ValueError(f"unknown shape {scene.shape!r}; expected one of {SHAPES}")
    return image.resize((size, size), Image.Resampling.BOX)


def draw_array(scene: Scene, **kwargs) -> np.ndarray:
    """:func:`draw` as a float32 array [3, H, W] in [0, 1]."""
    return np.asarray(draw(scene, **kwargs), dtype=np.float32).transpose(2, 0, 1) / 255.0
