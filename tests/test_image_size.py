"""Images that are not square: ``sampling.resolution`` as WIDTHxHEIGHT, from the config to the run's samples, its
model card, Try it and the page's field. (That every family samples a non-square size exactly as its diffusers
pipeline does is in the families' own tests: ``test_euler_ode_reproduces_pipeline`` at a landscape size.)"""

from __future__ import annotations

import re

import pytest
import yaml
from PIL import Image

from app.form import KNOBS
from jagg_core.config import ModelConfig, SamplingConfig
from jagg_core.errors import UserError
from jagg_core.image_size import ImageSize, parse_resolution
from jagg_core.model_card import build_model_card, read_run
from jagg_core.rundir import RunDirectory

from conftest import run_cli

#: height 32, width 64: twice as wide as high
LANDSCAPE = "64x32"


@pytest.mark.parametrize(("written", "kept", "size"), [
    (512, 512, ImageSize(512, 512)), ("512", 512, ImageSize(512, 512)), ("512x512", 512, ImageSize(512, 512)),
    ("832x480", "832x480", ImageSize(height=480, width=832)), (" 480 X 832 ", "480x832", ImageSize(832, 480)),
])
def test_a_resolution_is_a_side_or_width_by_height_and_is_kept_one_way(written, kept, size):
    sampling = SamplingConfig(resolution=written)
    assert sampling.resolution == kept and sampling.size == size
    assert parse_resolution(sampling.size.config_value()) == size
    model = ModelConfig(condition_resolution=written)  # an editing run's input images: the same kinds of size
    assert model.condition_resolution == kept and model.condition_size == size


@pytest.mark.parametrize(("written", "message"), [
    (30, "resolution must be a multiple of 16, got 30"),
    ("830x480", "resolution must be a multiple of 16, got width 830"),
    ("832x4096", "resolution must be 16 to 2048 pixels, got height 4096"),
    ("832 by 480", "resolution must be a side in pixels (512) or WIDTHxHEIGHT (832x480), got '832 by 480'"),
    (1.5, "resolution must be a side in pixels (512) or WIDTHxHEIGHT (832x480), got 1.5"),
])
def test_a_bad_resolution_is_one_line_saying_what_is_allowed(written, message):
    result = run_cli("--preset", "tiny-sd3", "--set", f"sampling.resolution={written}", "--dry-run")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr


def test_a_smaller_size_keeps_the_shape_in_whole_multiples_of_16():
    assert ImageSize(480, 832).scaled_to(512) == ImageSize(288, 512)  # 295.4 -> 288
    assert ImageSize(1024, 1024).scaled_to(768) == ImageSize(768, 768)
    assert ImageSize(16, 2048).scaled_to(256) == ImageSize(16, 256)  # never below 16


@pytest.mark.parametrize("size, picture, shaped", [
    (ImageSize.square(512), (1920, 1080), ImageSize(384, 688)),  # 16:9 at 512 x 512's area
    (ImageSize.square(512), (300, 300), ImageSize.square(512)),  # a square picture: the size itself
    (ImageSize(480, 832), (832, 480), ImageSize(480, 832)),
    (ImageSize(480, 832), (480, 832), ImageSize(832, 480)),      # the same area turned
    (ImageSize.square(32), (60, 20), ImageSize(16, 48)),          # 3:1
    (ImageSize.square(1024), (100, 1), ImageSize(96, 2048)),     # within the sides' range
])
def test_a_size_shaped_like_a_picture_keeps_its_area_in_the_pictures_shape(size, picture, shaped):
    assert size.shaped_like(*picture) == shaped
    assert shaped.height % 16 == shaped.width % 16 == 0


def test_a_landscape_run_trains_and_its_samples_grid_card_and_try_it_are_landscape(tmp_path):
    """A FLUX run at 64x32 (the packed family, whose tokens keep their grid): its samples are 64 wide and 32 high,
    its grid and Try it's picture keep that shape, its card's snippet samples at it, its plan says it."""
    run_dir = tmp_path / "run"
    result = run_cli("--preset", "tiny-sd3", "--set", "model.name=tiny-flux", "--set", f"sampling.resolution={LANDSCAPE}",
                     "--set", "train.iterations=1", "--set", "train.sample_every=1", "--set", "sampling.num_steps=4",
                     "--set", "backward.window=2", "--set", "prompts.eval_count=2", "--output-dir", str(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    run = RunDirectory(run_dir)
    assert yaml.safe_load(run.config_file.read_text())["sampling"]["resolution"] == LANDSCAPE
    assert [r["iteration"] for r in run.read_metrics()] == [0, 1]
    for path in run.samples(1).images:
        with Image.open(path) as sample:
            assert sample.size == (64, 32)
    with Image.open(run.grid_file(1)) as grid:
        assert grid.width == 2 * 128 and grid.height < 128 + 80, grid.size  # two cells 128 x 64 and captions
    card = build_model_card(read_run(run_dir), "alice/wide").text
    assert "**Sampling:** 64x32 px" in card and " height=32, width=64," in card
    assert "**Input images:**" not in card  # a text-to-image run's

    from jagg_core.generate import generate
    pair = generate(run_dir, "a wide red circle")
    assert pair.width == 2 * 256 and pair.height < 128 + 80, pair.size  # two cells 256 x 128, title and captions

    plan = run_cli("--preset", "tiny-sd3", "--set", "model.name=tiny-flux", "--set", f"sampling.resolution={LANDSCAPE}",
                   "--plan")
    assert plan.returncode == 0 and f"(flux, {LANDSCAPE} px)" in plan.stdout, plan.stdout + plan.stderr


@pytest.mark.parametrize("key", ["sampling.resolution", "model.condition_resolution"])
def test_the_pages_size_fields_offer_sizes_and_take_ones_own(key):
    knob = next(knob for knob in KNOBS if knob.key == key)
    assert knob.kind == "size" and ("832x480", "832x480") in knob.choices and ("512", "512") in knob.choices
    assert knob.to_config("512") == 512 and knob.to_config("1024x576") == "1024x576"
    assert knob.from_config(512) == "512" and knob.from_config("832x480") == "832x480"
    with pytest.raises(UserError, match=re.escape(f"'{knob.label}' needs a value")):
        knob.to_config("")


@pytest.mark.parametrize("command", [("--plan",), ("--output-dir", "RUN")])
def test_a_size_beyond_the_transformers_positions_is_one_line_before_sampling(command, tmp_path):
    """The embedded shapes model's SD3 position embedding covers 8 patches a side, 32 px: 64x32 is refused by the
    plan and by a run as it loads, in one line naming the limit (it was a traceback from inside diffusers)."""
    command = [str(tmp_path / "run") if part == "RUN" else part for part in command]
    result = run_cli("--set", "sampling.resolution=64x32", *command)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        "jagg_core.run: error: sampling.resolution 64x32 is too large for jagg-shapes: its position embedding covers "
        "8 patches a side (pos_embed_max_size), 32 px at most; lower sampling.resolution"), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
