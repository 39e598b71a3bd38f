"""Checks a run config against the world before anything is launched: the base model, rewards, prompts, trackers.

Both the CLI (``--dry-run`` and before training) and the app (before Start) call
:func:`check_references`; it loads no model (a Hub model's ``model_index.json`` alone is fetched) and, for the
built-in prompt sets, rewards and models, imports no deep-learning library, so a mistake is reported in about a second.
"""

from __future__ import annotations

from pathlib import Path

from .config import ModelConfig, RunConfig


def check_references(config: RunConfig) -> None:
    """The base model, the rewards and judges (names, options, no judge equal to a training reward), the prompts and
    the trackers' packages exist; raises :class:`~jagg_core.errors.UserError`."""
    from .judges import check_judges
    from .prompts import run_prompts
    from .rewards.catalog import check_reward_specs
    from .tracking import check_trackers
    check_model(config.model)
    check_reward_specs(config.rewards)
    check_judges(config)
    check_trackers(config.train.report_to)
    run_prompts(config.prompts)


def check_model(model: ModelConfig) -> None:
    """The base model can be loaded by name: a random-weight arch, a preset's model (its configs ship in
    :mod:`jagg_core.archs`), a tiny model, or a pipeline folder or Hub id with a ``model_index.json``."""
    from .archs import arch_for_model, is_random_model, parse_random_model
    from .model_index import model_source, read_model_index, tiny_models
    if is_random_model(model.name):
        parse_random_model(model.name)
        return
    if arch_for_model(model.name) is not None:
        return
    source = model_source(model.name)
    if "/" not in source and not Path(source).is_dir() and source in tiny_models():
        return
    read_model_index(source, model.revision)
