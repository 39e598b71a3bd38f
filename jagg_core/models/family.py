"""The declaration of a model family: everything about it, in its own file ``jagg_core/models/<family>.py``.

Each family file ends with ``FAMILY = Family(...)``. The tables the rest of the code looks models up in are derived
from these declarations: the pipeline -> :class:`FlowModel` registry and the tiny test models
(:mod:`.registry`), the real archs and their Hub ids (:mod:`jagg_core.archs`), the ``model.name`` description
(:mod:`jagg_core.config`). The torch-free parts read the literal fields (all but ``model`` and the builders
themselves) from the file's syntax tree (:mod:`jagg_core.family_names`), so write them as literals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..family_names import DEFAULT_DEPTH_KEY, EULER_SHIFT_KEY
from .base import FlowModel


@dataclass(frozen=True)
class Family:
    #: how the ``model.name`` description names the family's models, e.g. ``"SD3/SD3.5"``
    label: str
    #: the diffusers pipeline class name, as ``_class_name`` in a pipeline's ``model_index.json``
    pipeline: str
    #: how the family runs (its velocity, conditioning, decoding, LoRA targets)
    model: type[FlowModel]
    #: in-memory test models: ``model.name`` -> builder of the pipeline (random weights, drawn by the caller's seed)
    tiny_builders: dict[str, Callable[[], object]]
    #: real architectures: folder of :mod:`jagg_core.archs` (configs only) -> the Hub id whose configs it holds
    archs: dict[str, str] = field(default_factory=dict)
    #: the key of the block count in the transformer's config (what ``random:<arch>@<layers>`` sets)
    depth_key: str = DEFAULT_DEPTH_KEY
    #: an image-editing family: prompted by an instruction and an input image (:mod:`jagg_core.edit_prompts`)
    edits_images: bool = False
    #: a family that generates from text and also edits (FLUX.2 [klein] and [dev]): the FlowModel of its runs whose
    #: ``model.input_images`` is 1 or more, which are prompted as an image-editing family's
    edit_model: type[FlowModel] | None = None
    #: input images a prompt row of an editing run may have (``model.input_images``)
    max_input_images: int = 1
    #: the diffusers pipeline class that runs an ``edit_model``'s adapter where ``pipeline`` does not (Wan's
    #: image-to-video: ``WanImageToVideoPipeline``), named in its model card's snippet
    edit_pipeline: str = ""
    #: its runs with input images make videos that start from each row's image (Wan 2.2 TI2V-5B), where an editing
    #: family's edit them: what messages say of such runs and their prompt rows
    image_to_video: bool = False
    #: which of its models take input images, as messages name them where not all of them do (Wan: only Wan 2.2
    #: TI2V-5B among the ``WanPipeline`` models); empty: the whole family (``label``)
    edit_label: str = ""
    #: packages beyond requirements.txt that loading the real pipeline needs (its processor's), checked before launch
    requires: tuple[str, ...] = ()
    #: how the pipeline's ``__call__`` is told to sample as the run did (the model card's snippet,
    #: :meth:`jagg_core.family_names.DeclaredFamily.pipeline_arguments`): the argument of the CFG scale ("": the
    #: pipeline has no CFG), whose value is ``model.guidance_scale + cfg_offset`` (Z-Image's ``s = g - 1``)
    cfg_argument: str = "guidance_scale"
    cfg_offset: float = 0.0
    #: the argument of the guidance embedding's value, ``model.flux_guidance`` (guidance-distilled FLUX); "": none
    guidance_argument: str = ""
    #: the argument of CFG's negative prompt: ``negative_prompt`` (its text), or ``negative_prompt_embeds`` where the
    #: pipeline takes it only as its ``encode_prompt`` embeddings (FLUX.2 [klein]: "" unless they are given)
    negative_prompt_argument: str = "negative_prompt"
    #: the key of the schedule's shift (``model.flow_shift``) in the config of the family's pipelines' scheduler:
    #: ``shift``, the flow-matching Euler scheduler's, whose steps are the sampler's; or another scheduler's (Wan's
    #: UniPC: ``flow_shift``), for which the snippet swaps in the Euler scheduler at that shift
    scheduler_shift_key: str = EULER_SHIFT_KEY
    #: its pipeline scales the output to an area of its own (``max_area``, 1024²) and each input image to a
    #: preferred resolution unless told not to (FLUX.1 Kontext): the snippet passes the trained size's area and
    #: ``_auto_resize=False``, as the sampler keeps both sizes
    resizes_to_its_area: bool = False
    #: the area (pixels) its pipeline resizes every input image to, in the input's shape, whatever its size
    #: (Qwen-Image-Edit's ``calculate_dimensions(1024 * 1024, ratio)``; no argument changes it): the model card says
    #: so beside the size the run read them at; 0: the pipeline keeps the input's size, or is told to
    pipeline_input_area: int = 0
