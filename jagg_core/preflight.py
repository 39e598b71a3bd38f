"""Checks a run config against the world before anything is launched: rewards, prompts, trackers, random archs.

Both the CLI (``--dry-run`` and before training) and the app (before Start) call
:func:`check_references`; it loads no model and, for the built-in prompt sets and rewards, imports
no deep-learning library, so a mistake is reported in about a second.
"""

from __future__ import annotations

from .config import RunConfig


def check_references(config: RunConfig) -> None:
    """The rewards (names, options), the prompts, the trackers' packages and a random-weight model's arch exist;
    raises :class:`~jagg_core.errors.UserError`."""
    from .archs import is_random_model, parse_random_model
    from .prompts import load_prompts, split_prompts
    from .rewards.catalog import check_reward_specs
    from .tracking import check_trackers
    if is_random_model(config.model.name):
        parse_random_model(config.model.name)
    check_reward_specs(config.rewards)
    check_trackers(config.train.report_to)
    split_prompts(load_prompts(config.prompts.source), config.prompts.eval_count, config.prompts.split_seed)
