"""``geneval``: GenEval's checks of an image against its prompt (Ghosh et al. 2023, arXiv 2310.11513), the reward of
Flow-GRPO's GenEval task, with an open-vocabulary detector in place of GenEval's COCO one.

A prompt's requirements (:mod:`jagg_core.object_prompts`: its objects with their counts and colours, and the
relation of the first to the second) are checked on the image:

* **detection**: a zero-shot object detector (transformers ``AutoModelForZeroShotObjectDetection`` with its
  ``AutoProcessor``; Grounding DINO tiny by default) is asked for one object at a time (the text ``"{noun}."``); the
  boxes scoring above ``options.threshold`` are kept, a box overlapping a kept one of a higher score by an IoU above
  ``options.nms_iou`` dropped (one object found twice), at most ``options.max_objects``; then a box that holds two
  or more of the others, each at least :data:`GROUP_INSIDE` inside it, is dropped too: an open-vocabulary detector
  asked for "dog" may box a group of dogs beside each of them, which NMS keeps (the boxes barely overlap by IoU);
* **count**: an object with "a"/"an"/"one" is met with one box or more; with two or more, with exactly as many boxes;
* **colour**: each box of an object with a colour is cut out and classified by CLIP (ViT-L/14, as GenEval) among
  GenEval's ten colours, ``argmax_c cos(E_img(box), E_txt("a photo of a {c} {noun}"))``; met when at least the
  object's count of boxes have its colour;
* **relation** (left of, right of, above, below), GenEval's rule on the boxes' centres ``c`` and sizes ``s = (w, h)``:
  the offset ``d = c_A - c_B`` of the first object's box from the second's, shortened on each axis by
  ``m (s_A + s_B)`` (``m = options.position_margin``, GenEval's 0.1), ``d' = sign(d) max(|d| - m (s_A + s_B), 0)``,
  and its direction ``u = d' / |d|``: left of when ``u_x < -1/2``, right of when ``u_x > 1/2``, above when
  ``u_y < -1/2``, below when ``u_y > 1/2`` (y grows downward; boxes that overlap past the margins have none); met
  when a pair of boxes, one of each object, has it.

The score is the fraction of the prompt's checks that are met (its counts, colours and relation), in ``[0, 1]``:
Flow-GRPO's partial GenEval reward; 1 is GenEval's "correct", and with ``options.strict`` the score is 1 or 0 (GenEval's
accuracy). Where it differs from GenEval: the detector reads any
noun (GenEval's Mask2Former knows COCO's 80 classes), and a colour is read from the box, not a segmentation mask.
"""

from __future__ import annotations

from functools import cached_property

import torch
from PIL import Image

from ..errors import UserError
from ..hubclient import hub_model
from ..images import to_pil
from ..object_prompts import COLOURS, PromptRequirements, read_prompts
from .base import Reward
from .clip import clip_image_embeds, clip_text_embeds, load_clip

#: the share of a box's area inside another for the other to hold it (:func:`without_groups`)
GROUP_INSIDE = 0.9
#: the relations between two boxes that a prompt can ask for (:func:`box_relations`)
BOX_RELATIONS = ("left of", "right of", "above", "below")


def load_detector(model_id: str, device: torch.device):
    """``(model, processor)`` of a zero-shot object detector, in eval mode on ``device``, without gradients."""
    from transformers import AutoModelForZeroShotObjectDetection, AutoProcessor

    with hub_model(model_id):
        try:
            model = AutoModelForZeroShotObjectDetection.from_pretrained(model_id)
        except ValueError as err:  # a configuration class the auto class does not map
            raise UserError(f"'{model_id}' is not a zero-shot object detector ({str(err).splitlines()[0][:120]}); "
                            "the geneval reward needs one, such as IDEA-Research/grounding-dino-tiny "
                            "(options.model_id)") from None
        processor = AutoProcessor.from_pretrained(model_id)
    return model.eval().requires_grad_(False).to(device), processor


def without_duplicates(boxes: torch.Tensor, scores: torch.Tensor, iou_above: float, most: int) -> torch.Tensor:
    """The boxes [K, 4] (x0, y0, x1, y1) in order of score, each dropped that overlaps a kept one by an IoU above
    ``iou_above`` (greedy non-maximum suppression), the first ``most`` kept."""
    kept: list[torch.Tensor] = []
    for index in scores.argsort(descending=True).tolist():
        box = boxes[index]
        if all(box_iou(box, other) <= iou_above for other in kept):
            kept.append(box)
        if len(kept) == most:
            break
    return torch.stack(kept) if kept else boxes.new_zeros((0, 4))


def without_groups(boxes: torch.Tensor) -> torch.Tensor:
    """The boxes [K, 4] but each that holds two or more of the others: a box ``G`` holds ``B`` when at least
    :data:`GROUP_INSIDE` of ``B``'s area lies inside ``G``, ``|B n G| >= GROUP_INSIDE |B|``."""
    def holds(group: torch.Tensor, box: torch.Tensor) -> bool:
        area = float((box[2] - box[0]) * (box[3] - box[1]))
        return area > 0 and box_intersection(group, box) >= GROUP_INSIDE * area

    kept = [k for k, group in enumerate(boxes)
            if sum(holds(group, box) for j, box in enumerate(boxes) if j != k) < 2]
    return boxes[kept]


def box_intersection(a: torch.Tensor, b: torch.Tensor) -> float:
    """The area two boxes (x0, y0, x1, y1) share."""
    width = (torch.minimum(a[2], b[2]) - torch.maximum(a[0], b[0])).clamp(min=0)
    height = (torch.minimum(a[3], b[3]) - torch.maximum(a[1], b[1])).clamp(min=0)
    return float(width * height)


def box_iou(a: torch.Tensor, b: torch.Tensor) -> float:
    """Intersection over union of two boxes (x0, y0, x1, y1)."""
    inter = box_intersection(a, b)
    union = float((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1])) - inter
    return inter / union if union > 0 else 0.0


def box_relations(a: torch.Tensor, b: torch.Tensor, margin: float) -> set[str]:
    """The relations of box ``a`` to box ``b`` (module docstring: GenEval's rule), a subset of
    :data:`BOX_RELATIONS`."""
    centre_a, centre_b = (a[:2] + a[2:]) / 2, (b[:2] + b[2:]) / 2
    size_a, size_b = a[2:] - a[:2], b[2:] - b[:2]
    offset = centre_a - centre_b
    shortened = offset.sign() * (offset.abs() - margin * (size_a + size_b)).clamp(min=0)
    if not bool(shortened.abs().gt(1e-3).any()):
        return set()
    dx, dy = (shortened / offset.norm()).tolist()
    found = {"left of": dx < -0.5, "right of": dx > 0.5, "above": dy < -0.5, "below": dy > 0.5}
    return {relation for relation, holds in found.items() if holds}


def pixel_box(box: torch.Tensor, picture: Image.Image) -> tuple[int, int, int, int]:
    """``box`` (x0, y0, x1, y1) as whole pixels inside ``picture``, at least one pixel wide and high."""
    x0, y0 = min(max(int(box[0]), 0), picture.width - 1), min(max(int(box[1]), 0), picture.height - 1)
    x1 = min(max(round(float(box[2])), x0 + 1), picture.width)
    y1 = min(max(round(float(box[3])), y0 + 1), picture.height)
    return x0, y0, x1, y1


class GenEval(Reward):
    """The fraction of a prompt's GenEval checks an image meets (module docstring)."""

    name = "geneval"

    @cached_property
    def detector(self):
        return load_detector(self.options.model_id, self.device)

    @cached_property
    def colour_clip(self):
        return load_clip(self.options.colour_model_id, self.options.colour_model_id, self.device)

    def __call__(self, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        wanted = read_prompts(prompts, f"the {self.name} reward")
        pictures = to_pil(images)
        found = self.detect(pictures, [[item.noun for item in requirements.objects] for requirements in wanted])
        return torch.tensor([self.score(requirements, boxes, picture)
                             for requirements, boxes, picture in zip(wanted, found, pictures)], dtype=torch.float32)

    @torch.no_grad()
    def detect(self, pictures: list[Image.Image], nouns: list[list[str]]) -> list[dict[str, torch.Tensor]]:
        """For each picture, each of its nouns' boxes [K, 4] (pixels, x0 y0 x1 y1), the detector asked for one noun at
        a time, ``options.batch_size`` (picture, noun) queries a forward pass."""
        model, processor = self.detector
        queries = [(index, noun) for index, names in enumerate(nouns) for noun in dict.fromkeys(names)]
        found: list[dict[str, torch.Tensor]] = [{} for _ in pictures]
        for start in range(0, len(queries), self.options.batch_size):
            batch = queries[start:start + self.options.batch_size]
            shown = [pictures[index] for index, _ in batch]
            encoded = processor(images=shown, text=[[noun] for _, noun in batch], padding=True,
                                return_tensors="pt").to(self.device)
            outputs = model(**encoded)
            results = processor.post_process_grounded_object_detection(  # Grounding DINO's and OWL's alike
                outputs, threshold=self.options.threshold,
                target_sizes=[(picture.height, picture.width) for picture in shown])
            for (index, noun), result in zip(batch, results):
                found[index][noun] = without_groups(without_duplicates(
                    result["boxes"].float().cpu(), result["scores"].float().cpu(), self.options.nms_iou,
                    self.options.max_objects))
        return found

    def score(self, requirements: PromptRequirements, boxes: dict[str, torch.Tensor], picture: Image.Image) -> float:
        """The fraction of ``requirements``' checks that ``picture``, with its ``boxes`` by noun, meets (strict: 1 when
        it meets them all, else 0)."""
        met = 0
        for item in requirements.objects:
            count = len(boxes[item.noun])
            met += count == item.count if item.exact else count >= item.count
            if item.colour is not None:
                met += self.coloured(picture, boxes[item.noun], item.noun, item.colour) >= item.count
        if requirements.relation is not None:
            first, second = (boxes[item.noun] for item in requirements.objects)
            met += any(requirements.relation in box_relations(a, b, self.options.position_margin)
                       for a in first for b in second)
        return float(met == requirements.checks()) if self.options.strict else met / requirements.checks()

    def coloured(self, picture: Image.Image, boxes: torch.Tensor, noun: str, colour: str) -> int:
        """How many of ``boxes`` CLIP reads as ``colour`` among :data:`~jagg_core.object_prompts.COLOURS`."""
        if not len(boxes):
            return 0
        crops = [picture.crop(pixel_box(box, picture)) for box in boxes]
        texts = clip_text_embeds(self.colour_clip, [f"a photo of a {c} {noun}" for c in COLOURS])
        read = (clip_image_embeds(self.colour_clip, crops, "pad") @ texts.T).argmax(-1)
        return int((read == COLOURS.index(colour)).sum())
