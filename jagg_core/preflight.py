"""Checks a run config against the world before anything is launched: the base model, rewards, prompts, trackers.

Both the CLI (``--dry-run`` and before training) and the app (before Start) call
:func:`check_references`; it loads no model (of a Hub model, ``model_index.json`` alone is fetched, and the list of
its files with their sizes) and, for the built-in prompt sets, rewards and models, imports no deep-learning library,
so a mistake is reported in about a second. A Hub model still to download is measured against the free space of the
Hugging Face cache's disk (:mod:`jagg_core.download`).
"""

from __future__ import annotations

from pathlib import Path

from .config import ModelConfig, RunConfig
from .download import DownloadPlan, check_cached, check_disk_room, plan_download


def check_references(config: RunConfig, disk: bool = True) -> DownloadPlan | None:
    """The base model, the rewards and judges (names, options, no judge equal to a training reward), the prompts and
    the trackers' packages exist; raises :class:`~jagg_core.errors.UserError`. Returns the base model's
    :class:`~jagg_core.download.DownloadPlan` (``.left``: bytes still to download), None when it is not a Hub
    model or the Hub is offline. ``disk`` false (a memory plan, a dry run, an export): no refusal for the cache's disk
    room, nor for a Hub model offline that the cache lacks."""
    from .judges import check_judges
    from .prompts import run_prompts
    from .rewards.catalog import check_reward_specs
    from .tracking import check_trackers
    plan = check_model(config.model, disk)
    check_reward_specs(config.rewards)
    check_judges(config)
    check_trackers(config.train.report_to)
    run_prompts(config.prompts)
    return plan


def check_model(model: ModelConfig, disk: bool = True) -> DownloadPlan | None:
    """The base model can be loaded by name: a random-weight arch, a tiny model, or a pipeline folder or Hub id with
    a ``model_index.json`` (offline, from the cache; a preset's model passes offline, its configs ship in
    :mod:`jagg_core.archs`). Online, a Hub model's :class:`~jagg_core.download.DownloadPlan` is returned once the
    cache's disk is known to have room for what is left to download; offline, a Hub model is in the cache (neither
    checked with ``disk`` false: a memory plan, a dry run, an export)."""
    from .archs import arch_for_model, is_random_model, parse_random_model
    from .hubclient import hub_offline
    from .model_index import model_source, read_model_index, tiny_models
    if is_random_model(model.name):
        parse_random_model(model.name)
        return None
    source = model_source(model.name)
    if "/" not in source and not Path(source).is_dir() and source in tiny_models():
        return None
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
