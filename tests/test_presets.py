"""Every preset validates and names registered rewards and a loadable prompt set (its GPU memory comment is checked
against the plan in tests/test_memory.py)."""

from __future__ import annotations

import pytest

from jagg_core.config import list_presets, load_config
from jagg_core.prompts import load_prompts
from jagg_core.rewards import available_rewards, build_rewards

PRESETS = sorted(list_presets())


def test_the_recipes_of_the_issue_are_there():
    assert {"sd35-medium-pickscore", "sd35-medium-ocr", "flux-dev-hpsv2", "flux-schnell-aesthetic",
            "qwen-image-pickscore"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_valid_and_complete(name):
    config = load_config(preset=name)
    assert list_presets()[name], "a preset needs a one-line description"
    assert {r.name for r in config.rewards} <= set(available_rewards())
    build_rewards(config.rewards)  # options are accepted; models load only when called
    prompts = load_prompts(config.prompts.source)
    assert len(set(prompts)) > config.prompts.eval_count


def test_qwen_preset_quantizes_and_flux_dev_saves_memory():
    qwen, flux = load_config(preset="qwen-image-pickscore"), load_config(preset="flux-dev-hpsv2")
    assert qwen.model.quantize == "nf4"
    assert flux.train.optimizer == "adamw8bit" and flux.train.gradient_checkpointing
