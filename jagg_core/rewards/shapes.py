"""``shapes``: a verifiable, GenEval-like reward for the coloured-shapes world of ``jagg-shapes``.

The prompt must follow ``"a {colour} {shape} on a {colour} background, {position}"`` (see
:mod:`jagg_core.shapes_world`). The image's pixels are analysed, without any model:

* background colour: the per-channel median of the 2-pixel border;
* shape mask: pixels closer to the shape's colour than to the background, where the shape's
  colour is the median of the pixels far (> 0.25 in RGB) from the background;
* shape kind: the mask's fill of its bounding box (circle ~0.79, square ~1, triangle ~0.54) and
  the share of it in the box's top half (triangle ~0.27, others ~0.5);
* position: the mask's centroid.

Each of the four parts scores the probability of the prompt's class under a soft nearest-
prototype classifier, ``softmax(-distance^2 / temperature)`` over the palette colours, the
shape prototypes or the five position anchors, so a part is ~1 when clearly right, ~0 when
clearly wrong and in between when ambiguous. An image without a shape (fewer than 3 mask
pixels) scores 0 on shape colour, kind and position. The score is the mean of the four parts.
Vectorised in torch; about 0.1 ms an image at 32x32 on one CPU core.

``shapes_fidelity``: a judge of the same world that measures what ``shapes`` does not, whether the image still
looks like the world's images, as the mean of two parts in [0, 1]:

* purity: the mean over pixels of ``exp(-d^2 / temperature)``, ``d`` the RGB distance from the pixel to the nearer
  of the caption's two colours (noise, stray colours, smears and grid artefacts lower it; a drawn image's
  antialiased edge costs about 0.05);
* size: the shape's area (pixels nearer the caption's shape colour than its background colour) against the
  world's drawings, whose shapes span 0.36..0.48 of the image: ``exp(-max(0, |ln(area / area_0.42)| - ln(1.31))^2
  / (2 0.3^2))``, 1 inside the world's range of sizes.
"""

from __future__ import annotations

import torch

from ..shapes_world import COLOURS, POSITIONS, SHAPES, read_captions
from .base import Reward

PARTS = ("colour", "shape", "background", "position")
BORDER = 2
FAR_FROM_BACKGROUND = 0.25
MIN_PIXELS = 3
COLOUR_TEMPERATURE = 0.02
SHAPE_TEMPERATURE = 0.005
POSITION_TEMPERATURE = 0.01
#: the area of each shape drawn at the world's middle size (0.42 of the image), as a fraction of the image
CANONICAL_AREA = {"circle": 3.14159 / 4 * 0.42 ** 2, "square": 0.42 ** 2, "triangle": 0.42 ** 2 / 2}
#: the world's drawings span 0.36..0.48 of the image: areas within this factor of the canonical one
SIZE_RANGE = 1.31
SIZE_TOLERANCE = 0.3
#: (fill of the bounding box, share of the mask in the box's top half) of each shape.
SHAPE_PROTOTYPES = {"circle": (0.79, 0.5), "square": (1.0, 0.5), "triangle": (0.54, 0.27)}

_PALETTE = torch.tensor([COLOURS[c] for c in COLOURS], dtype=torch.float32) / 255.0
_ANCHORS = torch.tensor([POSITIONS[p] for p in POSITIONS], dtype=torch.float32)
_PROTOTYPES = torch.tensor([SHAPE_PROTOTYPES[s] for s in SHAPES], dtype=torch.float32)


def _soft_class(points: torch.Tensor, prototypes: torch.Tensor, target: torch.Tensor,
                temperature: float) -> torch.Tensor:
    """``softmax(-|point - prototype|^2 / temperature)[target]`` for each row of ``points``."""
    logits = -torch.cdist(points, prototypes).square() / temperature
    return logits.softmax(-1).gather(1, target[:, None])[:, 0]


def _targets(prompts: list[str]) -> dict[str, torch.Tensor]:
    colours, positions = list(COLOURS), list(POSITIONS)
    rows = [(colours.index(scene.colour), SHAPES.index(scene.shape), colours.index(scene.background),
             positions.index(scene.position)) for scene in read_captions(prompts)]
    table = torch.tensor(rows, dtype=torch.long).reshape(-1, 4)
    return dict(zip(PARTS, table.unbind(1)))


def shape_scores(images: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
    """The four part scores, each float32 ``[N]`` in [0, 1]: ``colour, shape, background, position``.

    ``images``: float ``[N, 3, H, W]`` in [0, 1]; ``prompts``: N captions of the shapes grammar.
    """
    if images.ndim != 4 or images.shape[1] != 3 or images.shape[0] != len(prompts):
        raise ValueError(f"expected images [N,3,H,W] and N prompts, got {tuple(images.shape)} and {len(prompts)}")
    targets = _targets(prompts)
    x = images.detach().float().cpu().clamp(0, 1)
    n, _, h, w = x.shape
    pixels = x.flatten(2).transpose(1, 2)  # [N, HW, 3]

    border = torch.ones(h, w, dtype=torch.bool)
    border[BORDER:h - BORDER, BORDER:w - BORDER] = False
    background = x[:, :, border].median(-1).values  # [N, 3]

    far = (pixels - background[:, None]).norm(dim=-1) > FAR_FROM_BACKGROUND  # [N, HW]
    shape_colour = torch.where(far[..., None], pixels, torch.nan).nanmedian(1).values.nan_to_num(0.0)
    mask = ((pixels - shape_colour[:, None]).norm(dim=-1) < (pixels - background[:, None]).norm(dim=-1)) & far.any(
        1, keepdim=True)
    mask = mask.view(n, h, w)
    area = mask.sum((1, 2)).float()
    present = area >= MIN_PIXELS

    rows, cols = mask.any(2), mask.any(1)  # [N, H], [N, W]
    ys, xs = torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32)
    top = torch.where(rows, ys, float(h)).min(1).values
    bottom = torch.where(rows, ys, -1.0).max(1).values
    left = torch.where(cols, xs, float(w)).min(1).values
    right = torch.where(cols, xs, -1.0).max(1).values
    box_h, box_w = (bottom - top + 1).clamp(min=1), (right - left + 1).clamp(min=1)
    fill = area / (box_h * box_w)
    middle = (top + bottom) / 2
    upper = (mask & (ys[None, :, None] < middle[:, None, None])).sum((1, 2)) \
        + 0.5 * (mask & (ys[None, :, None] == middle[:, None, None])).sum((1, 2))
    top_share = upper / area.clamp(min=1)
    centroid = torch.stack([(mask.sum(1) * (xs + 0.5)).sum(1) / w, (mask.sum(2) * (ys + 0.5)).sum(1) / h], 1)
    centroid = centroid / area.clamp(min=1)[:, None]

    scores = {
        "colour": _soft_class(shape_colour, _PALETTE, targets["colour"], COLOUR_TEMPERATURE),
        "shape": _soft_class(torch.stack([fill, top_share], 1), _PROTOTYPES, targets["shape"], SHAPE_TEMPERATURE),
        "background": _soft_class(background, _PALETTE, targets["background"], COLOUR_TEMPERATURE),
        "position": _soft_class(centroid, _ANCHORS, targets["position"], POSITION_TEMPERATURE),
    }
    for part in ("colour", "shape", "position"):
        scores[part] = torch.where(present, scores[part], 0.0)
    return scores


class ShapesReward(Reward):
    """Mean of the shape-colour, shape-kind, background-colour and position scores, in [0, 1]."""

    name = "shapes"

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        scores = shape_scores(images, prompts)
        return torch.stack([scores[p] for p in PARTS]).mean(0)


class ShapesFidelity(Reward):
    """The judge ``shapes_fidelity``: the mean of colour purity and shape size (module docstring), in [0, 1]."""

    name = "shapes_fidelity"

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        targets = _targets(prompts)
        x = images.detach().float().cpu().clamp(0, 1)
        pixels = x.flatten(2).transpose(1, 2)  # [N, HW, 3]
        shape_colour, background = _PALETTE[targets["colour"]], _PALETTE[targets["background"]]
        to_shape = (pixels - shape_colour[:, None]).norm(dim=-1)
        to_background = (pixels - background[:, None]).norm(dim=-1)
        purity = torch.exp(-torch.minimum(to_shape, to_background).square() / COLOUR_TEMPERATURE).mean(1)
        area = (to_shape < to_background).float().mean(1)
        expected = torch.tensor([CANONICAL_AREA[SHAPES[k]] for k in targets["shape"].tolist()])
        off = ((area.clamp(min=1e-6) / expected).log().abs() - torch.log(torch.tensor(SIZE_RANGE))).clamp(min=0)
        size = torch.exp(-off.square() / (2 * SIZE_TOLERANCE ** 2))
        return (purity + size) / 2
