"""The coloured-shapes world: caption grammar, tokenizer, the ``shapes`` reward, the ``jagg-shapes`` folder."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from jagg_core.errors import UserError
from jagg_core.prompts import load_prompts, split_prompts
from jagg_core.rewards.shapes import PARTS, ShapesReward, shape_scores
from jagg_core.tiny.dataset import EVAL_COUNT, SPLIT_SEED, all_captions, caption_split, render_dataset
from jagg_core.shapes_world import COLOURS, POSITIONS, SHAPES, WORDS, Scene, draw_array, parse_caption
from jagg_core.tiny.tokenizer import build_tokenizer

FOLDER = Path(__file__).resolve().parent.parent / "jagg_core" / "assets" / "jagg-shapes"
SCENES = [Scene("red", "circle", "blue", "top left"), Scene("yellow", "triangle", "black", "bottom right"),
          Scene("white", "square", "green", "center"), Scene("blue", "triangle", "white", "top right"),
          Scene("green", "circle", "yellow", "bottom left"), Scene("black", "square", "red", "top left")]


def images_of(scenes: list[Scene]) -> torch.Tensor:
    return torch.stack([torch.from_numpy(draw_array(s)) for s in scenes])


def other(options, value):
    """The next option after ``value`` (cyclically)."""
    options = list(options)
    return options[(options.index(value) + 1) % len(options)]


# --- grammar and tokenizer ----------------------------------------------------------------

def test_captions_parse_back_and_the_prompt_set_lists_them_all():
    captions = all_captions()
    assert len(captions) == len(set(captions)) == 6 * 5 * 3 * 5
    assert all(parse_caption(c).caption == c for c in captions)
    assert sorted(load_prompts("shapes")) == sorted(captions)
    assert parse_caption("A Red  circle on a blue background,top left.") == Scene("red", "circle", "blue", "top left")
    assert parse_caption("a red dog on a blue background, top left") is None


def test_held_out_captions_are_the_trainers_eval_split():
    train, held_out = caption_split()
    assert len(held_out) == EVAL_COUNT and not set(train) & set(held_out)
    prompts = load_prompts("shapes")
    assert held_out == split_prompts(prompts, EVAL_COUNT, SPLIT_SEED)[1]
    assert split_prompts(prompts, 8, SPLIT_SEED)[1] == held_out[:8]  # smaller eval sets stay held out


def test_training_drawings_put_the_given_share_of_shapes_at_another_position():
    captions = [s.caption for s in SCENES]
    for share in (0.0, 0.3, 1.0):
        images, labels = render_dataset(captions, copies=40, size=32, seed=0, wrong_position=share)
        assert labels == captions * 40
        parts = shape_scores(images, labels)
        assert parts["colour"].min() > 0.9 and parts["shape"].min() > 0.5  # only the position moves
        misplaced = (parts["position"] < 0.5).float().mean().item()
        assert misplaced == pytest.approx(share, abs=0.07), share
    again, _ = render_dataset(captions, copies=2, size=32, seed=0, wrong_position=0.3)
    assert torch.equal(again, render_dataset(captions, copies=2, size=32, seed=0, wrong_position=0.3)[0])


def test_tokenizer_has_one_token_per_word(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    reloaded = type(tokenizer).from_pretrained(tmp_path)
    ids = reloaded("a red circle on a blue background, top left").input_ids
    assert len(ids) == 2 + 10 and reloaded.unk_token_id not in ids[1:-1]
    assert all(len(reloaded.tokenize(w)) == 1 for w in WORDS)


# --- reward ------------------------------------------------------------------------------

def test_reward_is_registered():
    from jagg_core.rewards import available_rewards
    from jagg_core.rewards.catalog import reward_entry
    assert "shapes" in available_rewards() and reward_entry("shapes").load_class() is ShapesReward


def test_correct_drawings_score_high():
    scores = ShapesReward()(images_of(SCENES), [s.caption for s in SCENES])
    assert scores.dtype == torch.float32 and scores.shape == (len(SCENES),)
    assert (scores >= 0.9).all(), scores


def test_canonical_drawings_of_every_caption_score_high():
    scenes = [parse_caption(c) for c in all_captions()]
    parts = shape_scores(images_of(scenes), [s.caption for s in scenes])
    for part in PARTS:
        assert parts[part].min() > 0.75, part
    assert torch.stack([parts[p] for p in PARTS]).mean(0).min() >= 0.9


@pytest.mark.parametrize("part,field,options", [
    ("colour", "colour", COLOURS), ("shape", "shape", SHAPES),
    ("background", "background", COLOURS), ("position", "position", POSITIONS)])
def test_each_kind_of_wrong_drawing_ranks_below_the_correct_one(part, field, options):
    reward = ShapesReward()
    for scene in SCENES:
        wrong_value = other(options, getattr(scene, field))
        if field in ("colour", "background") and wrong_value in (scene.colour, scene.background):
            wrong_value = other(options, wrong_value)
        wrong = replace(scene, **{field: wrong_value})
        right_score, wrong_score = reward(images_of([scene, wrong]), [scene.caption] * 2)
        assert right_score > wrong_score + 0.15, (scene, wrong)
        assert shape_scores(images_of([wrong]), [scene.caption])[part] < 0.2, (scene, wrong)


def test_blank_and_noise_images_score_low():
    prompts = [SCENES[0].caption] * 2
    blank = torch.zeros(1, 3, 32, 32) + torch.tensor([40 / 255, 80 / 255, 230 / 255])[:, None, None]
    noise = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    scores = ShapesReward()(torch.cat([blank, noise]), prompts)
    assert scores[0] == pytest.approx(0.25, abs=0.01)  # right background, no shape
    assert scores[1] < 0.5


def test_reward_is_deterministic_and_batch_independent():
    images, prompts = images_of(SCENES), [s.caption for s in SCENES]
    reward = ShapesReward()
    together = reward(images, prompts)
    assert torch.equal(together, reward(images, prompts))
    assert torch.allclose(together[2:3], reward(images[2:3], prompts[2:3]))


def test_unreadable_prompt_names_it_and_the_grammar():
    with pytest.raises(UserError, match="a photo of a cat.*background"):
        ShapesReward()(torch.rand(1, 3, 32, 32), ["a photo of a cat"])


# --- pipeline folder ---------------------------------------------------------------------

def test_pipeline_folder_is_small():
    files = [f for f in FOLDER.rglob("*") if f.is_file()]
    assert (FOLDER / "model_index.json").is_file()
    assert sum(f.stat().st_size for f in files) < 25e6


def test_pipeline_folder_loads_offline_and_generates(monkeypatch):
    from diffusers import StableDiffusion3Pipeline

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe = StableDiffusion3Pipeline.from_pretrained(str(FOLDER), text_encoder_3=None, tokenizer_3=None)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(prompt=[SCENES[0].caption], num_inference_steps=4, guidance_scale=1.0, output_type="pt",
               generator=torch.Generator().manual_seed(0))
    images = out.images
    assert images.shape == (1, 3, 32, 32)
    assert torch.isfinite(images).all() and 0 <= images.min() and images.max() <= 1
