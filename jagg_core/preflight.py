"""Checks a run config against the world before anything is launched: the base model, rewards, prompts, trackers.

Both the CLI (``--dry-run`` and before training) and the app (before Start) call
:func:`check_references`; it loads no model (of a Hub model, ``model_index.json`` alone is fetched, and the list of
its files with their sizes) and, for the built-in prompt sets, rewards and models, imports no deep-learning library,
so a mistake is reported in about a second. A Hub model still to download is measured against the free space of the
Hugging Face cache's disk (:mod:`jagg_core.download`).
"""

from __future__ import annotations

import json
from pathlib import Path

from .config import ModelConfig, RunConfig
from .download import DownloadPlan, check_cached, check_disk_room, plan_download
from .errors import UserError, require_packages
from .family_names import DeclaredFamily, declared_families, family_of_pipeline


def check_references(config: RunConfig, disk: bool = True) -> DownloadPlan | None:
    """The base model, the rewards and judges (names, options, no judge equal to a training reward, a video reward on
    videos), the prompts and the trackers' packages exist, and the rewards and judges can read the prompts; raises
    :class:`~jagg_core.errors.UserError`. Returns the base model's :class:`~jagg_core.download.DownloadPlan`
    (``.left``: bytes still to download), None when it is not a Hub model or the Hub is offline. ``disk`` false (a
    memory plan, a dry run, an export): no refusal for the cache's disk room, nor for a Hub model offline that the
    cache lacks, nor for a reward's package missing here."""
    from .judges import check_judges
    from .prompts import run_prompts
    from .rewards.catalog import check_prompts_readable, check_reward_packages, check_reward_specs, check_video_rewards
    from .tracking import check_trackers
    plan = check_model(config.model, disk)
    check_flow_shift(config.model)
    check_reward_specs(config.rewards)
    check_judges(config)
    check_video_rewards(config)
    if disk:  # a launch: the rewards' models will load
        check_reward_packages([spec.name for spec in [*config.rewards, *config.eval.judges]])
    check_trackers(config.train.report_to)
    train, held_out = run_prompts(config.prompts)
    check_prompt_kind(model_family(config.model), [*train, *held_out], config.model.input_images)
    check_prompts_readable(config, train, held_out)
    return plan


def dynamic_shift_refusal(name: str) -> str:
    """The one line refusing ``model.flow_shift`` for the model ``name``, whose schedule shifts with the image size."""
    return (f"model.flow_shift sets a fixed schedule shift, but '{name}' shifts its schedule with the image size (its "
            "scheduler's use_dynamic_shifting): unset model.flow_shift")


def check_flow_shift(model: ModelConfig) -> None:
    """``model.flow_shift`` is refused before launch for a model whose scheduler shifts the schedule with the image
    size (``use_dynamic_shifting``: FLUX.1-dev, FLUX.2, Qwen-Image), where its scheduler config is at hand: a real
    arch's (a preset's Hub id, ``random:<arch>``) or a folder's; loading the model refuses the others."""
    from .archs import arch_folder, arch_for_model
    from .model_index import model_source
    if model.flow_shift is None:
        return
    arch = arch_for_model(model.name)
    folder = arch_folder(arch) if arch is not None else Path(model_source(model.name)).expanduser()
    try:
        scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    except (OSError, ValueError):
        return
    if isinstance(scheduler, dict) and scheduler.get("use_dynamic_shifting"):
        raise UserError(dynamic_shift_refusal(model.name))


def model_family(model: ModelConfig) -> DeclaredFamily | None:
    """The declared family of ``model.name``, without torch: a real arch's (a preset's Hub id, ``random:<arch>``), a
    tiny model's, else the one whose pipeline is the ``_class_name`` of the model's ``model_index.json`` (a folder,
    or the Hub's, from its cache when offline); None when that index cannot be read (:func:`check_model` says why)."""
    from .archs import arch_for_model
    from .model_index import model_source, read_model_index, tiny_models
    families = declared_families()
    if (arch := arch_for_model(model.name)) is not None:
        return next(family for family in families if arch in family.archs)
    if model.name in tiny_models():
        return next(family for family in families if model.name in family.tiny_models)
    try:
        pipeline = read_model_index(model_source(model.name), model.revision)["_class_name"]
    except UserError:
        return None
    return family_of_pipeline(pipeline)


def input_images_a_row(model: ModelConfig) -> int | None:
    """The input images a prompt row of ``model`` has (``model.input_images`` as its family reads it: 0 for a run that
    generates from text), None when its family cannot be looked up (:func:`model_family`)."""
    family = model_family(model)
    return None if family is None else family.input_images(model.input_images)


def check_prompt_kind(family: DeclaredFamily | None, prompts: list[str], input_images: int | None = None) -> None:
    """An image-editing run's prompts are editing rows (an instruction and as many input images as
    ``model.input_images`` says, no more than the family takes), and only its are: else a training would fail once
    the model is loaded, or train a text-to-image model on the rows' texts."""
    from .edit_prompts import EditPrompt, edit_rows
    if family is None:
        return
    count = family.input_images(input_images)
    if count:
        edit_rows(prompts, family.label, count, generates_from_text_too=family.also_edits,
                  does=family.does_with_images)
    elif any(isinstance(prompt, EditPrompt) for prompt in prompts):
        editors = ", ".join(f.label for f in declared_families() if f.edits_images and not f.image_to_video)
        also = " or ".join(f.edit_label or f.label for f in declared_families() if f.also_edits)
        also = f"; or {also} with model.input_images=1" if also else ""
        animators = ", ".join(f.label for f in declared_families() if f.edits_images and f.image_to_video)
        animates = f", or an image-to-video one ({animators})" if animators else ""
        raise UserError(f"prompts.source holds image-editing rows (an instruction and an input image), but the "
                        f"{family.label} run generates from text alone; choose a text prompt set, or an "
                        f"image-editing model.name ({editors}{also}){animates}")


def check_packages(model: ModelConfig) -> None:
    """The packages the real pipeline of ``model`` needs beyond requirements.txt (its family's ``requires``, for its
    processor) are installed: a tiny or random-weight model has stand-ins for what needs them."""
    if family := model_family(model):
        require_packages(family.requires, f"the {family.label} pipeline of model '{model.name}' (its processor)")


def check_model(model: ModelConfig, disk: bool = True) -> DownloadPlan | None:
    """The base model can be loaded by name: a random-weight arch, a tiny model, or a pipeline folder or Hub id with
    a ``model_index.json`` (offline, from the cache; a preset's model passes offline, its configs ship in
    :mod:`jagg_core.archs`). Online, a Hub model's :class:`~jagg_core.download.DownloadPlan` is returned once the
    cache's disk is known to have room for what is left to download; offline, a Hub model is in the cache (neither
    checked with ``disk`` false: a memory plan, a dry run, an export), and for a launch the packages its pipeline needs
    (:func:`check_packages`)."""
    from .archs import arch_for_model, is_random_model, parse_random_model
    from .hubclient import hub_offline
    from .model_index import model_source, read_model_index, tiny_models
    if is_random_model(model.name):
        parse_random_model(model.name)
        return None
    source = model_source(model.name)
    if "/" not in source and not Path(source).is_dir() and source in tiny_models():
        return None
    if disk:  # a launch: the pipeline's processor will load
        check_packages(model)
    local = Path(source).expanduser().is_dir()
    offline = not local and hub_offline()  # asked once: it may wait on a name lookup
    if offline and disk:  # a launch: the weights must already be here
        check_cached(source, model.revision)
        return None
    if local or offline:
        if arch_for_model(model.name) is None:
            read_model_index(source, model.revision)
        return None
    plan = plan_download(source, model.revision)
    if plan is not None and disk:
        check_disk_room(plan)
    return plan
