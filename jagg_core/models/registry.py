"""The tables derived from the families' declarations (``FAMILY`` in each ``jagg_core/models/<family>.py``, found by
:func:`jagg_core.family_names.declared_families`): which :class:`FlowModel` runs a pipeline class, and the tiny
test models built in memory."""

from __future__ import annotations

from importlib import import_module

import torch

from ..config import ModelConfig
from ..errors import UserError
from ..family_names import declared_families, family_of_pipeline
from .base import FlowModel
from .family import Family

#: family file name -> its declaration
DECLARATIONS: dict[str, Family] = {declared.module: import_module(f"{__package__}.{declared.module}").FAMILY
                                   for declared in declared_families()}
#: diffusers pipeline class name -> the FlowModel that runs it
FAMILIES: dict[str, type[FlowModel]] = {family.pipeline: family.model for family in DECLARATIONS.values()}
#: tiny test model name -> builder of its pipeline
TINY_BUILDERS = {name: builder for family in DECLARATIONS.values() for name, builder in family.tiny_builders.items()}


def check_pipeline(pipeline_class: str, name: str) -> None:
    """A family declares the pipeline class (``model_index.json``'s ``_class_name``) of ``model.name``: else a
    :class:`UserError`."""
    if pipeline_class not in FAMILIES:
        supported = ", ".join(sorted(FAMILIES))
        raise UserError(f"model '{name}' is a {pipeline_class}; supported pipelines: {supported}")


def family_for(pipeline_class: str, config: ModelConfig) -> type[FlowModel]:
    """The FlowModel that runs a pipeline class for ``config`` (:func:`check_pipeline`): its family's
    ``edit_model`` for a run with input images (``model.input_images``) of a family that also edits, else its
    ``model``. An input-image count the family does not take is a one-line :class:`UserError` here, for every
    family."""
    check_pipeline(pipeline_class, config.name)
    declared = family_of_pipeline(pipeline_class)
    family = DECLARATIONS[declared.module]
    input_images = declared.input_images(config.input_images)
    if family.edit_model is not None and input_images:
        return family.edit_model
    return family.model


def build_tiny_pipeline(name: str, seed: int = 0):
    """Build the tiny pipeline ``name`` (``tiny-sd3``, ...) with weights drawn from ``seed``."""
    if name not in TINY_BUILDERS:
        raise UserError(f"unknown tiny model '{name}'; available: {', '.join(TINY_BUILDERS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TINY_BUILDERS[name]()
