"""The model families declared in ``jagg_core/models/<family>.py``, read without importing them (no torch).

A family file declares ``FAMILY = Family(...)`` (:class:`jagg_core.models.family.Family`). This module reads the
declaration's literal fields from the file's syntax tree, so that the torch-free code derives its tables from that
one declaration: the ``model.name`` description (:mod:`jagg_core.config`), the arch table
(:mod:`jagg_core.archs`), the tiny model names the CLI checks a ``model.name`` against. :mod:`jagg_core.models`
imports the files for the rest; ``tests/test_structure.py`` checks that both readings agree.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import UserError

if TYPE_CHECKING:
    from .config import ModelConfig
    from .image_size import ImageSize

MODELS_DIR = Path(__file__).resolve().parent / "models"
#: the name a family file binds its declaration to
DECLARATION = "FAMILY"
#: the key of the block count in most transformer configs (a family declares another as its ``depth_key``)
DEFAULT_DEPTH_KEY = "num_layers"
#: what a run with input images does with them, as messages say it (:attr:`DeclaredFamily.does_with_images`)
EDITS_IMAGES = "edits images"
MAKES_VIDEOS_FROM_IMAGES = "makes videos from an input image"
#: the declaration's fields that say how its pipeline samples as the run did (the model card's snippet)
SAMPLING_FIELDS = ("cfg_argument", "cfg_offset", "guidance_argument", "negative_prompt_argument", "scheduler_shift_key",
                   "resizes_to_its_area", "pipeline_input_area")
#: the pipelines' argument of CFG's negative prompt text
TEXT_NEGATIVE_PROMPT = "negative_prompt"
#: the scheduler config's key of the shift of the flow-matching Euler scheduler, whose steps the sampler takes
EULER_SHIFT_KEY = "shift"


@dataclass(frozen=True)
class DeclaredFamily:
    """The literal fields of one family's declaration (see :class:`jagg_core.models.family.Family`)."""

    module: str  # the family file's name in jagg_core.models, e.g. "sd3"
    label: str
    pipeline: str
    tiny_models: tuple[str, ...]
    archs: dict[str, str]
    depth_key: str
    edits_images: bool
    also_edits: bool  # generates from text, and edits with input images (it declares an ``edit_model``)
    max_input_images: int
    requires: tuple[str, ...]
    edit_pipeline: str  # the pipeline class of its runs with input images, where it is not ``pipeline``
    image_to_video: bool  # its runs with input images make videos that start from them
    edit_label: str  # which of its models take input images, where not all of them do ("": the whole family)
    cfg_argument: str = "guidance_scale"  # the pipeline's argument of the CFG scale ("": it has no CFG)
    cfg_offset: float = 0.0  # that argument's value is model.guidance_scale + cfg_offset
    guidance_argument: str = ""  # the pipeline's argument of the guidance embedding's value ("": none)
    negative_prompt_argument: str = "negative_prompt"  # or negative_prompt_embeds: it takes only those
    scheduler_shift_key: str = EULER_SHIFT_KEY  # the shift's key in its scheduler's config (shift: the Euler one)
    resizes_to_its_area: bool = False  # its pipeline scales the output to max_area, the input unless told
    pipeline_input_area: int = 0  # the area its pipeline resizes every input image to, whatever its size (0: none)

    @property
    def does_with_images(self) -> str:
        """What its runs with input images do with them, as messages say it."""
        return MAKES_VIDEOS_FROM_IMAGES if self.image_to_video else EDITS_IMAGES

    def input_images(self, setting: int | None) -> int:
        """The input images of a prompt row of this family's run whose ``model.input_images`` is ``setting``
        (None: unset): an image-editing family's 1 (unset) to :attr:`max_input_images`; a family that also edits
        (FLUX.2) 0 (unset: it generates from text) to its most; 0 for a text-to-image family, which ignores
        the setting. A count outside those is a :class:`~jagg_core.errors.UserError`."""
        if not (self.edits_images or self.also_edits):
            return 0
        count = setting if setting is not None else int(self.edits_images)
        least = int(self.edits_images)
        if not least <= count <= self.max_input_images:
            takes = f"{least} to {self.max_input_images}" if least < self.max_input_images else least
            raise UserError(f"model.input_images is {count}, but the {self.label} model takes {takes} input "
                            "image(s) a prompt row")
        return count

    def pipeline_arguments(self, model: ModelConfig, size: ImageSize) -> dict[str, object]:
        """The arguments of the family's pipeline ``__call__`` (beyond the prompt, size and steps) that sample as the
        sampler does with ``model``, a run's model config, at ``size``, where the pipelines' defaults differ from it
        (CFG scales of 3.5 to 7, text windows of 256 or 512 tokens): the text window ``max_sequence_length``, the
        guidance embedding's value, the CFG scale (``guidance_scale + cfg_offset``; the low-noise one,
        ``guidance_scale_2``, where set), when a step is guided the negative prompt (its text, or where the pipeline
        takes only its embeddings a :class:`PromptEmbeddings` of it; none for "", the pipeline's own), and where the
        pipeline would resize the output and the input images, ``max_area`` (``size``'s) and ``_auto_resize``."""
        arguments: dict[str, object] = {"max_sequence_length": model.max_sequence_length}
        if self.resizes_to_its_area:
            arguments |= {"max_area": size.height * size.width, "_auto_resize": False}
        if self.guidance_argument:
            arguments[self.guidance_argument] = model.flux_guidance
        if self.cfg_argument:
            arguments[self.cfg_argument] = model.guidance_scale + self.cfg_offset
        if model.guidance_scale_2 is not None:
            arguments["guidance_scale_2"] = model.guidance_scale_2
        if model.uses_cfg and self.negative_prompt_argument == TEXT_NEGATIVE_PROMPT:
            arguments[TEXT_NEGATIVE_PROMPT] = model.negative_prompt
        elif model.uses_cfg and model.negative_prompt:
            arguments[self.negative_prompt_argument] = PromptEmbeddings(model.negative_prompt)
        return arguments


@dataclass(frozen=True)
class PromptEmbeddings:
    """A pipeline argument that is a prompt's embeddings, ``pipe.encode_prompt(text, max_sequence_length=...)[0]``
    (FLUX.2 [klein]'s negative prompt: the pipeline encodes "" unless it is given them)."""

    text: str


def _declaration(path: Path) -> ast.Call | None:
    """The ``Family(...)`` call bound to ``FAMILY`` at the top level of ``path``, if any."""
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and [getattr(target, "id", None) for target in node.targets] == [DECLARATION]):
            return node.value
    return None


def _read(path: Path, call: ast.Call) -> DeclaredFamily:
    fields = {keyword.arg: keyword.value for keyword in call.keywords}
    literal = {name: ast.literal_eval(fields[name]) for name in ("label", "pipeline", "archs", "depth_key",
                                                                 "edits_images", "max_input_images", "requires",
                                                                 "edit_pipeline", "image_to_video", "edit_label",
                                                                 *SAMPLING_FIELDS)
               if name in fields}
    return DeclaredFamily(module=path.stem, label=literal["label"], pipeline=literal["pipeline"],
                          tiny_models=tuple(ast.literal_eval(key) for key in fields["tiny_builders"].keys),
                          archs=literal.get("archs", {}), depth_key=literal.get("depth_key", DEFAULT_DEPTH_KEY),
                          edits_images=literal.get("edits_images", False), also_edits="edit_model" in fields,
                          max_input_images=literal.get("max_input_images", 1), requires=literal.get("requires", ()),
                          edit_pipeline=literal.get("edit_pipeline", ""),
                          image_to_video=literal.get("image_to_video", False),
                          edit_label=literal.get("edit_label", ""),
                          **{name: literal[name] for name in SAMPLING_FIELDS if name in literal})


@cache
def declared_families() -> tuple[DeclaredFamily, ...]:
    """Every declared family, in the order of their file names."""
    return tuple(_read(path, call) for path in sorted(MODELS_DIR.glob("*.py"))
                 if (call := _declaration(path)) is not None)


def family_of_pipeline(pipeline: str) -> DeclaredFamily | None:
    """The declared family whose pipeline class is named ``pipeline`` (a ``model_index.json``'s ``_class_name``)."""
    return next((family for family in declared_families() if family.pipeline == pipeline), None)


def tiny_model_names() -> list[str]:
    """Every in-memory test model, e.g. ``tiny-sd3``."""
    return [name for family in declared_families() for name in family.tiny_models]


def declared_hub_ids() -> dict[str, str]:
    """Every real arch (a folder of :mod:`jagg_core.archs`) -> the Hub id whose configs it holds."""
    return {arch: repo for family in declared_families() for arch, repo in family.archs.items()}


def other_depth_keys() -> tuple[str, ...]:
    """The block-count keys families declare besides :data:`DEFAULT_DEPTH_KEY` (Z-Image's ``n_layers``)."""
    return tuple(dict.fromkeys(family.depth_key for family in declared_families()
                               if family.depth_key != DEFAULT_DEPTH_KEY))
