"""Image editing: prompt rows of (instruction, input image), the rewards' ``inputs``, and the FLUX.1 Kontext and
Qwen-Image-Edit families against their own diffusers pipelines (Euler ODE vs ``__call__``, LoRA reload, training,
memory plan, presets)."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import io
import re
import sys
import types

import numpy as np
import pytest
import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus
from PIL import Image

from conftest import loop_latents, noise, pipeline_latents, run_cli, snippet_arguments, tiny_config
from jagg_core import metrics
from jagg_core.config import LoraConfig, ModelConfig, RewardSpec, list_presets, load_config
from jagg_core.edit_prompts import EditPrompt, input_images, instruction_of, png_bytes
from jagg_core.errors import UserError
from jagg_core.hub import write_model_card
from jagg_core.image_size import ImageSize
from jagg_core.memory_meter import measured_peak
from jagg_core.memory_plan import plan_memory
from jagg_core.models import build_tiny_pipeline, load_flow_model
from jagg_core.models.base import NEGATIVE
from jagg_core.models.editing import IMAGE_LATENTS
from jagg_core.models.text_embeddings import load_embeddings, save_embeddings
from jagg_core.prompts import builtin_prompt_sets, load_prompts, split_prompts
from jagg_core.rewards import CombinedReward, build_reward
from jagg_core.rewards.base import Reward
from jagg_core.rewards.catalog import NoOptions
from jagg_core.rewards.jpeg import JpegCompressibility
from jagg_core.rundir import RunDirectory
from jagg_core.trainer import Trainer

#: the tiny editing models, and what else makes a run of one edit: FLUX.2 [klein] generates from text unless given
#: model.input_images
EDIT_RUNS = {"tiny-flux-kontext": {}, "tiny-qwen-edit": {}, "tiny-qwen-edit-plus": {},
             "tiny-flux2": {"input_images": 1}}
EDIT_MODELS = list(EDIT_RUNS)
RES, CONDITION, STEPS = 32, 32, 3
SIZE = ImageSize.square(RES)
LANDSCAPE = ImageSize(height=32, width=64)
#: the input image's side where a pipeline refuses CONDITION (Flux2KleinPipeline takes 64 px and more)
PIPELINE_CONDITION = {"tiny-flux2": 64}
#: text tokens: the longest example instruction, with the tiny Qwen-Image-Edit tokenizer's template tokens, fits
TEXT = 64
EDIT_SET = "edits"


def png(path, colour, size=(40, 24)) -> None:
    Image.new("RGB", size, colour).save(path)


@pytest.fixture
def image_folder(tmp_path):
    png(tmp_path / "red.png", (200, 30, 30))
    (tmp_path / "sub").mkdir()
    png(tmp_path / "sub" / "blue.png", (30, 30, 200))
    (tmp_path / "prompts.csv").write_text("file,prompt\nred.png,make it  blue\nsub/blue.png,make it blue\n"
                                          "red.png,add a hat\nred.png,   \n")
    return tmp_path


def rows(count: int = 2) -> list[EditPrompt]:
    """Editing rows of the built-in example set with instructions of different lengths."""
    prompts = load_prompts(EDIT_SET)
    return [prompts[0], max(prompts, key=len)][:count]


# ----- prompt rows -----------------------------------------------------------------------------------------------
def test_an_image_folder_gives_one_row_per_instruction_keyed_by_its_image(image_folder):
    prompts = load_prompts(str(image_folder))
    assert [p.instruction for p in prompts] == ["make it blue", "make it blue", "add a hat"]
    assert all(isinstance(p, EditPrompt) and p.startswith(p.instruction + " [") for p in prompts)
    assert prompts[0] != prompts[1], "the same instruction on two images is two rows"
    assert [p.label for p in prompts] == ["red.png", "sub/blue.png", "red.png"]
    square = prompts[1].image(ImageSize.square(16))
    assert square.size == (16, 16) and square.getpixel((8, 8)) == (30, 30, 200)
    clone = copy.deepcopy(prompts[0])
    assert clone == prompts[0] and clone.images_bytes == prompts[0].images_bytes
    assert [instruction_of(str(p)) for p in prompts] == [p.instruction for p in prompts]  # as in a run's files
    assert instruction_of("a cat [on a mat]") == "a cat [on a mat]"
    (image_folder / "prompts.csv").unlink()
    (image_folder / "prompts.jsonl").write_text('{"file": "red.png", "prompt": "make it blue"}\n')
    assert load_prompts(str(image_folder)) == prompts[:1]


def test_an_input_image_is_centre_cropped_to_the_sizes_shape_not_squashed():
    """Thirds of a 3:1 picture, red, green and blue: a 3:1 size keeps all three, a square or a portrait its
    centre."""
    stripes = Image.new("RGB", (60, 20), (200, 30, 30))
    stripes.paste((30, 160, 60), (20, 0, 40, 20))
    stripes.paste((30, 30, 200), (40, 0, 60, 20))
    row = EditPrompt("make it blue", png_bytes(stripes), "stripes.png")
    wide = row.image(ImageSize(height=16, width=48))
    assert wide.size == (48, 16)
    assert [wide.getpixel((x, 8)) for x in (2, 24, 45)] == [(200, 30, 30), (30, 160, 60), (30, 30, 200)]
    for size in (ImageSize.square(16), ImageSize(height=32, width=16)):
        centre = row.image(size)
        assert centre.size == (size.width, size.height)
        assert np.abs(np.asarray(centre, dtype=int) - (30, 160, 60)).max() <= 10  # green, bicubic at the edges


def test_a_photo_is_read_upright_as_its_exif_orientation_says():
    """A phone's portrait photo is often stored landscape with an EXIF orientation (6: turn 90 degrees clockwise):
    its run's input and Try it's shape read it as it is seen, as diffusers' ``load_image`` does."""
    from jagg_core.generate import shaped_like_picture

    stored = Image.new("RGB", (40, 20), (200, 30, 30))
    stored.paste((30, 30, 200), (20, 0, 40, 20))  # left red, right blue: seen upright, top red, bottom blue
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    stored.save(buffer, format="PNG", exif=exif)
    row = EditPrompt("make it green", buffer.getvalue(), "photo.png")
    seen = np.asarray(row.image(ImageSize(height=32, width=16)), dtype=int)
    assert np.abs(seen[:12] - (200, 30, 30)).max() <= 2 and np.abs(seen[-12:] - (30, 30, 200)).max() <= 2
    config = tiny_config("tiny-flux-kontext", sampling__resolution=32, model__condition_resolution=64)
    shaped = shaped_like_picture(config, buffer.getvalue())
    assert (shaped.sampling.size, shaped.model.condition_size) == (ImageSize(48, 16), ImageSize(96, 48))


@pytest.mark.parametrize("files, match", [
    ({}, "needs a prompts.csv or prompts.jsonl"),
    ({"prompts.csv": "image,prompt\nred.png,x\n"}, "needs a 'file' column"),
    ({"prompts.jsonl": '{"file": "red.png"}\n'}, "line 1 .* must be an object with a 'file' key and a 'prompt' key"),
    ({"prompts.csv": "file,prompt\nmissing.png,x\n"}, "row 1 .* image 'missing.png' is not a file inside"),
    ({"prompts.csv": "file,prompt\n../outside.png,x\n"}, "image '../outside.png' is not a file inside"),
    ({"prompts.csv": "file,prompt\nnotes.txt,x\n", "notes.txt": "hello"}, "image 'notes.txt' is not a readable image"),
    ({"prompts.csv": "file,prompt\nred.png,\n"}, "holds no prompts"),
])
def test_a_bad_image_folder_is_one_line(tmp_path, files, match):
    folder = tmp_path / "set"
    folder.mkdir()
    png(folder / "red.png", (200, 30, 30))
    png(tmp_path / "outside.png", (0, 0, 0))
    for name, text in files.items():
        (folder / name).write_text(text)
    with pytest.raises(UserError, match=match) as err:
        load_prompts(str(folder))
    assert "\n" not in str(err.value)


def test_a_hub_dataset_with_an_image_column(monkeypatch):
    class Dataset:
        column_names = ["edit", "good", "bad", "caption"]
        num_rows = 2

        def __getitem__(self, column):
            blue = Image.new("RGB", (8, 8), "blue")
            return {"edit": ["make it red", "make it green"], "caption": ["a", "b"],
                    "good": [blue, {"bytes": png_bytes(blue), "path": None}],
                    "bad": [blue, {"bytes": b"not an image", "path": None}]}[column]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda name, split: Dataset()))
    edits = load_prompts("hf://user/edits:edit,good")
    assert [p.instruction for p in edits] == ["make it red", "make it green"]
    assert [p.label for p in edits] == ["row 1", "row 2"]
    assert edits[0].image(ImageSize.square(4)).getpixel((2, 2)) == (0, 0, 255)
    with pytest.raises(UserError, match="row 2 of Hub dataset 'user/edits' is not a readable image"):
        load_prompts("hf://user/edits:edit,bad")
    with pytest.raises(UserError, match="has no column 'image'; it has: edit, good, bad, caption"):
        load_prompts("hf://user/edits:edit,image")
    assert load_prompts("hf://user/edits:caption") == ["a", "b"]


def test_the_builtin_example_set_splits_like_any_prompt_set():
    assert EDIT_SET in builtin_prompt_sets()
    prompts = load_prompts(EDIT_SET)
    train, held_out = split_prompts(prompts, 4, seed=0)
    assert all(isinstance(p, EditPrompt) for p in train + held_out) and not set(train) & set(held_out)


# ----- rewards see the input images ------------------------------------------------------------------------------
class InputsProbe(Reward):
    """Scores each image by its mean distance to its input image."""

    name = "inputs_probe"
    takes_inputs = True

    def __call__(self, images, prompts, inputs=None):
        return (images - inputs).abs().mean(dim=(1, 2, 3))


def test_an_editing_reward_gets_the_input_images_at_the_outputs_size_and_old_rewards_do_not():
    prompts = rows()
    expected = input_images(prompts, ImageSize(height=16, width=32))  # a landscape output's
    assert expected.shape == (2, 3, 16, 32) and 0 <= expected.min() and expected.max() <= 1
    combined = CombinedReward([InputsProbe(options=NoOptions()), JpegCompressibility()], [1.0, 0.0], ["probe", "jpeg"])
    images = torch.rand(2, 3, 16, 32, generator=torch.Generator().manual_seed(0))
    _, parts = combined(images, prompts)
    torch.testing.assert_close(parts["probe"], (images - expected).abs().mean(dim=(1, 2, 3)))
    _, unchanged = combined(expected, prompts)
    assert unchanged["probe"].abs().max() == 0
    assert input_images(["a red circle"], ImageSize.square(16)) is None


def test_clip_directional_is_the_cosine_of_the_image_and_text_directions(tiny_clip):
    folder, _ = tiny_clip
    reward = build_reward(RewardSpec(name="clip_directional", options={"model_id": folder}))
    image = rows(1)[0].images_bytes[0]
    prompts = [EditPrompt("make it red", image, "a"), EditPrompt("add snow", image, "b")]
    inputs = input_images(prompts, ImageSize.square(32))
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    scores = reward(images, prompts, inputs)
    image_direction = reward.image_embeds(images) - reward.image_embeds(inputs)
    text_direction = reward.text_embeds(["make it red", "add snow"]) - reward.text_embeds(["a photo"])
    expected = (image_direction * text_direction).sum(-1) / (image_direction.norm(dim=-1) * text_direction.norm(dim=-1))
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    assert scores.abs().max() <= 1 and reward(inputs, prompts, inputs).abs().max() == 0
    with pytest.raises(UserError, match="clip_directional reward scores edits"):
        CombinedReward([reward], [1.0], ["clip_directional"])(images, ["make it red", "add snow"])


# ----- the families against their pipelines ----------------------------------------------------------------------
def load(name: str, **overrides):
    return load_flow_model(ModelConfig(**{"name": name, "max_sequence_length": TEXT,
                                          "condition_resolution": PIPELINE_CONDITION.get(name, CONDITION),
                                          **EDIT_RUNS.get(name, {}), **overrides}))


def editing_config(name: str, **overrides):
    """:func:`conftest.tiny_config` of an editing run of the tiny model ``name``."""
    return tiny_config(name, **{f"model__{key}": value for key, value in EDIT_RUNS[name].items()}, **overrides)


@pytest.mark.parametrize("name", EDIT_MODELS)
def test_each_row_is_encoded_once_with_its_image_latents(name, monkeypatch):
    model = load(name, guidance_scale=3.0, negative_prompt="blurry")
    first, second = rows()
    same_text = EditPrompt(first.instruction, second.images_bytes, "other")
    encoded, encode = [], model.encode_prompts
    monkeypatch.setattr(model, "encode_prompts", lambda prompts: encoded.extend(prompts) or encode(prompts))
    cond = model.conditioning([first, same_text, first])
    assert encoded == [first, same_text]  # a row twice in a batch: encoded once
    # (side / (2 x the VAE's factor))^2
    tokens = model.image_seq_len(model.config.condition_size)
    assert cond[IMAGE_LATENTS].shape == (3, tokens, model.transformer.config.in_channels)
    assert torch.equal(cond[IMAGE_LATENTS], cond[NEGATIVE + IMAGE_LATENTS])
    assert torch.equal(cond[IMAGE_LATENTS][0], cond[IMAGE_LATENTS][2])
    assert not torch.equal(cond[IMAGE_LATENTS][0], cond[IMAGE_LATENTS][1])
    shapes = model.conditioning_shapes()
    assert all(cond[key].shape[1:] == shapes[key] for key in shapes)
    model.encode_and_cache([same_text])
    monkeypatch.setattr(model, "encode_prompts", lambda prompts: pytest.fail("a kept row encoded again"))
    model.conditioning([same_text])
    with pytest.raises(UserError, match=f"the {model.family} model edits images, but the prompt 'a red circle'"):
        load(name).conditioning(["a red circle"])


@pytest.mark.parametrize("name", EDIT_MODELS)
def test_a_landscape_input_size_is_encoded_to_the_shapes_the_plan_counts(name):
    """The input image's latents and (Qwen-Image-Edit) its vision tokens at a landscape ``condition_resolution``:
    the tokens of its own grid, the shapes :meth:`conditioning_shapes` gives the memory plan."""
    side = PIPELINE_CONDITION.get(name, CONDITION)
    model = load(name, condition_resolution=f"{2 * side}x{side}")
    cond, shapes = model.conditioning(rows(1)), model.conditioning_shapes()
    assert {key: cond[key].shape[1:] for key in shapes} == shapes
    assert cond[IMAGE_LATENTS].shape[1] == model.image_seq_len(ImageSize(height=side, width=2 * side))


def test_the_plus_text_encoder_reads_the_input_at_its_384_px_area_in_the_inputs_shape():
    """The Plus pipeline's ``calculate_dimensions(CONDITION_IMAGE_SIZE, width / height)``, sides of multiples of 32."""
    assert load("tiny-qwen-edit-plus").vision_size == ImageSize.square(384)
    assert load("tiny-qwen-edit-plus", condition_resolution="832x480").vision_size == ImageSize(height=288, width=512)


@pytest.mark.parametrize(("name", "guidance_scale"), [("tiny-flux-kontext", 1.0), ("tiny-qwen-edit", 3.0)])
def test_the_rows_conditioning_is_saved_for_a_resume_and_tied_to_the_input_size(name, guidance_scale, tmp_path):
    """With CFG too, whose negative branch's image latents are the row's (on a CPU the cache once kept them as one
    tensor, which safetensors refused to save: the run stopped at set-up)."""
    model = load(name, guidance_scale=guidance_scale)
    prompts = rows()
    model.encode_and_cache(prompts)
    path = tmp_path / "text_embeddings.safetensors"
    save_embeddings(path, model.cached_embeddings, model.config)
    saved = load_embeddings(path, prompts, model.config)
    assert IMAGE_LATENTS in saved[prompts[0]] and (NEGATIVE + IMAGE_LATENTS in saved[prompts[0]]) == model.use_cfg
    assert all(torch.equal(value, model.cached_embeddings[p][key]) for p in prompts for key, value in saved[p].items())
    assert load_embeddings(path, prompts, model.config.model_copy(update={"condition_resolution": 16})) is None


@pytest.fixture
def qwen_edit_condition_size(monkeypatch):
    """QwenImageEditPipeline resizes its input to ``calculate_dimensions(1024 * 1024, ratio)``, QwenImageEditPlus's
    to ``calculate_dimensions`` of ``VAE_IMAGE_SIZE`` (1024 * 1024) for its VAE and of ``CONDITION_IMAGE_SIZE``
    (384 * 384) for its text encoder (which the model reads too); here all to the model's
    ``model.condition_resolution``, so that no resampling differs. Call it with the model."""
    def keep(model) -> None:
        size = model.config.condition_size
        monkeypatch.setattr(pipeline_qwenimage_edit, "calculate_dimensions",
                            lambda area, ratio: (size.width, size.height, None))
        monkeypatch.setattr(pipeline_qwenimage_edit_plus, "calculate_dimensions",
                            lambda area, ratio: (size.width, size.height))
    return keep


@pytest.mark.parametrize("name", EDIT_MODELS)
@pytest.mark.parametrize(("guidance_scale", "size", "portrait_input"),
                         [(1.0, SIZE, False), (3.0, SIZE, False), (3.0, LANDSCAPE, True)],
                         ids=["square", "square-cfg", "landscape-cfg-portrait-input"])
def test_euler_ode_reproduces_pipeline(name, guidance_scale, size, portrait_input, qwen_edit_condition_size):
    """z_{i+1} = z_i + (sigma_{i+1} - sigma_i) v(z_i, sigma_i, c) on two rows at once equals the pipeline's own
    ``__call__`` on each row from the same noise and input image (true CFG included): square, and a landscape output
    of a portrait input (each grid its own shape: a transposed one would differ)."""
    side = PIPELINE_CONDITION.get(name, CONDITION)
    condition = f"{side}x{2 * side}" if portrait_input else side
    model = load(name, guidance_scale=guidance_scale, negative_prompt="ugly", flux_guidance=2.5,
                 condition_resolution=condition)
    qwen_edit_condition_size(model)
    prompts = rows()
    z0 = noise(model, len(prompts), seed=1, size=size)
    sigmas, cond = model.sigmas(STEPS, size), model.conditioning(prompts)
    z = z0
    with torch.no_grad():
        for i in range(STEPS):
            z = z + (sigmas[i + 1] - sigmas[i]) * model.velocity(z, sigmas[i], cond)
        images = model.decode(z)

    family = snippet_arguments(model, size)  # the model card's (Kontext's: the sizes kept, as the sampler keeps them)
    for i, row in enumerate(prompts):
        final = {}

        def keep_latents(pipe, step, timestep, tensors):
            final["latents"] = tensors["latents"]
            return {}

        output = model.pipe(image=row.image(model.config.condition_size), prompt=row.instruction,
                            num_inference_steps=STEPS, latents=pipeline_latents(model, z0[i:i + 1]),
                            height=size.height, width=size.width, output_type="pt",
                            callback_on_step_end=keep_latents, **family)
        torch.testing.assert_close(model.pipe.scheduler.sigmas, sigmas, atol=1e-6, rtol=0)
        torch.testing.assert_close(loop_latents(model, z[i:i + 1]), final["latents"].float(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(images[i:i + 1], output.images.float(), atol=1e-4, rtol=1e-4)


# ----- rows of several input images (Qwen-Image-Edit-2509/2511) --------------------------------------------------
COLOURS = {"red": (200, 30, 30), "blue": (30, 30, 200), "green": (30, 160, 60), "white": (240, 240, 240)}


@pytest.fixture
def two_image_folder(tmp_path):
    """An image folder whose rows name two images each ('Picture 1' first), in prompts.csv."""
    folder = tmp_path / "pairs"
    folder.mkdir()
    for name, colour in COLOURS.items():
        png(folder / f"{name}.png", colour)
    pairs = [(a, b) for a in COLOURS for b in COLOURS if a != b]
    (folder / "prompts.csv").write_text("file,prompt\n" + "".join(
        f"{a}.png;{b}.png,swap colours\n" for a, b in pairs))
    return folder


def test_a_row_may_name_several_images_and_a_single_image_rows_text_stays_as_it_was(two_image_folder, image_folder):
    rows = load_prompts(str(two_image_folder))
    assert len(rows) == 12 and rows[0].label == "red.png+blue.png" and len(rows[0].images_bytes) == 2
    first, second = rows[0].images(ImageSize.square(8))
    assert first.getpixel((4, 4)) == COLOURS["red"] and second.getpixel((4, 4)) == COLOURS["blue"]
    assert rows[0] != rows[3], "the same images in the other order are another row"  # blue;red is row 3
    assert copy.deepcopy(rows[0]).images_bytes == rows[0].images_bytes
    (two_image_folder / "prompts.csv").unlink()
    (two_image_folder / "prompts.jsonl").write_text('{"file": ["red.png", "blue.png"], "prompt": "mix"}\n')
    assert load_prompts(str(two_image_folder))[0].images_bytes == rows[0].images_bytes
    single = load_prompts(str(image_folder))[0]  # the text, and so caches and resumes, of a one-image row
    digest = hashlib.sha256((image_folder / "red.png").read_bytes()).hexdigest()[:10]
    assert single == f"make it blue [red.png {digest}]"


def test_the_plus_model_reads_every_input_image_as_the_pipeline_does(two_image_folder, qwen_edit_condition_size):
    """Two input images a row: the text encoder reads 'Picture 1' and 'Picture 2', their latents follow the noisy
    tokens one after the other with a grid each in img_shapes; the Euler ODE equals the pipeline's __call__ given
    both images, with true CFG."""
    model = load("tiny-qwen-edit-plus", input_images=2, guidance_scale=3.0, negative_prompt="ugly")
    qwen_edit_condition_size(model)
    prompts = load_prompts(str(two_image_folder))[:2]
    z0 = noise(model, len(prompts), seed=2)
    sigmas, cond = model.sigmas(STEPS, SIZE), model.conditioning(prompts)
    assert cond[IMAGE_LATENTS].shape[1] == 2 * model.image_seq_len(ImageSize.square(CONDITION))
    z = z0
    with torch.no_grad():
        for i in range(STEPS):
            z = z + (sigmas[i + 1] - sigmas[i]) * model.velocity(z, sigmas[i], cond)
    for i, row in enumerate(prompts):
        final = {}

        def keep_latents(pipe, step, timestep, tensors):
            final["latents"] = tensors["latents"]
            return {}

        model.pipe(image=row.images(ImageSize.square(CONDITION)), prompt=row.instruction, num_inference_steps=STEPS,
                   latents=pipeline_latents(model, z0[i:i + 1]), height=RES, width=RES, output_type="latent",
                   true_cfg_scale=3.0, negative_prompt="ugly", max_sequence_length=TEXT,
                   callback_on_step_end=keep_latents)
        torch.testing.assert_close(loop_latents(model, z[i:i + 1]), final["latents"].float(), atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # the second picture matters
        swapped = model.velocity(z0, sigmas[0], model.conditioning(load_prompts(str(two_image_folder))[3:5]))
        assert not torch.allclose(swapped, model.velocity(z0, sigmas[0], cond))


@pytest.mark.parametrize("name, input_images, rows, message", [
    ("tiny-flux-kontext", 2, "pairs", "model.input_images is 2, but the FLUX.1 Kontext model takes 1 input image(s)"),
    ("tiny-qwen-edit-plus", 1, "pairs", "has 2 input image(s), but model.input_images is 1"),
    ("tiny-qwen-edit-plus", 2, EDIT_SET, "has 1 input image(s), but model.input_images is 2"),
    ("tiny-qwen-edit", 0, EDIT_SET, "model.input_images is 0, but the Qwen-Image-Edit model takes 1 input image(s)"),
    ("tiny-flux2", 1, "shapes", "the FLUX.2 [klein] model edits images (model.input_images is 1), but the prompt '"),
    ("tiny-flux2", 1, "shapes", "; or unset model.input_images to generate from text"),
    ("tiny-flux2", 0, EDIT_SET, "but the FLUX.2 [klein] run generates from text alone"),
    ("tiny-flux2", "null", EDIT_SET, "but the FLUX.2 [klein] run generates from text alone"),
])
def test_rows_of_another_number_of_images_than_the_model_takes_are_one_line_before_launch(
        name, input_images, rows, message, two_image_folder, offline):
    from jagg_core.preflight import check_references
    source = str(two_image_folder) if rows == "pairs" else rows
    config = tiny_config(name, prompts__source=source, model__input_images=input_images,
                         model__max_sequence_length=TEXT)
    with pytest.raises(UserError, match=re.escape(message)):
        check_references(config)
    if " takes " in message:  # a count the model refuses too
        with pytest.raises(UserError, match=re.escape(message)):
            load(name, input_images=input_images)


def test_a_two_image_run_trains_and_its_plan_counts_the_second_image(two_image_folder, tmp_path, offline):
    settings = {"prompts__source": str(two_image_folder), "model__max_sequence_length": TEXT,
                "model__condition_resolution": 16}
    config = tiny_config("tiny-qwen-edit-plus", model__input_images=2, **settings)
    trainer = Trainer(config, tmp_path / "run")
    trainer.setup()
    trainer.fit()
    assert [r["iteration"] for r in RunDirectory(tmp_path / "run").read_metrics()] == [0, 1, 2]
    card = write_model_card(tmp_path / "run", "alice/pairs").text  # the snippet passes both pictures
    assert 'pipe(image=[load_image("picture1.png"), load_image("picture2.png")], prompt="swap colours",\n' in card
    assert ("- **Input images:** centre-cropped to 16 px (`model.condition_resolution`); the pipeline resizes every "
            "input to about 1024 x 1024 pixels in its own shape") in card  # which no argument changes
    from jagg_core.generate import generate
    tried = generate(tmp_path / "run", "swap colours", images=[two_image_folder / "red.png",
                                                               two_image_folder / "blue.png"])
    first, second, base, adapted = cells(tried, 4)  # one row: picture 1, picture 2, the base model, the adapter
    assert (first == COLOURS["red"]).all() and (second == COLOURS["blue"]).all() and base.shape == adapted.shape
    from app.ui import Studio  # the page's Try it: Input image and Picture 2, through the generate process
    studio = Studio(tmp_path)
    assert [update["visible"] for update in studio.try_inputs("run")] == [True, True, False, True]  # and whole
    image, message = studio.generate("run", "latest adapter", "swap colours", 0, str(two_image_folder / "blue.png"),
                                     str(two_image_folder / "red.png"))
    assert message.endswith(": the 2 input images, the base model's edit and the adapter's"), message
    first, second, _, _ = cells(Image.open(image), 4)
    assert (first == COLOURS["blue"]).all() and (second == COLOURS["red"]).all()
    _, message = studio.generate("run", "latest adapter", "swap colours", 0, str(two_image_folder / "blue.png"))
    assert message == ("**Not generated:** the run's model (Qwen-Image-Edit-2509/2511) edits images: give the 2 "
                       "images the instruction applies to (--image PATH 2 times, 'Picture 1' first; on the page, "
                       "Input image and Picture 2)"), message
    one = plan_memory(tiny_config("tiny-qwen-edit-plus", **{**settings, "prompts__source": EDIT_SET}))
    assert plan_memory(config).total > one.total


def test_a_local_kontext_folder_loads_as_its_family(tmp_path):
    """(Qwen-Image-Edit's folder would need torchvision: its processor loads a video processor too.)"""
    model = load("tiny-flux-kontext")
    model.pipe.save_pretrained(tmp_path)
    reloaded = load_flow_model(ModelConfig(name=str(tmp_path), max_sequence_length=TEXT,
                                           condition_resolution=CONDITION))
    assert type(reloaded) is type(model)
    z, sigma = noise(model, 1), torch.tensor(0.7)
    with torch.no_grad():
        expected = model.velocity(z, sigma, model.conditioning(rows(1)))
        torch.testing.assert_close(reloaded.velocity(z, sigma, reloaded.conditioning(rows(1))), expected,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", EDIT_MODELS)
def test_saved_lora_reloads_in_a_fresh_pipeline(name, tmp_path):
    model = load(name)
    params = model.add_lora(LoraConfig(rank=4, alpha=8.0))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in params:
            param.add_(0.2 * torch.randn(param.shape, generator=generator))
    z, sigma, cond = noise(model, 2), torch.tensor([0.8, 0.3]), model.conditioning(rows())
    with torch.no_grad():
        trained = model.velocity(z, sigma, cond)
        with model.adapters_disabled():
            assert not torch.allclose(model.velocity(z, sigma, cond), trained, atol=1e-3)
    model.save_lora(tmp_path)
    fresh = build_tiny_pipeline(name)
    fresh.load_lora_weights(str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(type(model)(fresh, model.config).velocity(z, sigma, cond), trained,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", EDIT_MODELS)
def test_two_training_iterations_and_the_adapter_loads_in_diffusers(name, tmp_path, offline):
    config = editing_config(name, prompts__source=EDIT_SET, model__condition_resolution=16,
                       model__max_sequence_length=TEXT)
    trainer = Trainer(config, tmp_path / "run")
    trainer.setup()
    trainer.fit()
    run = RunDirectory(tmp_path / "run")
    metrics_rows = run.read_metrics()
    assert [r["iteration"] for r in metrics_rows] == [0, 1, 2]
    assert all(r[metrics.SKIPPED] is False for r in metrics_rows[1:])
    assert run.read_status()["state"] == "finished"
    fresh = build_tiny_pipeline(name, seed=config.train.seed)
    fresh.load_lora_weights(str(run.lora_dir))
    prompts = list(trainer.model.cached_embeddings)[:2]
    z, sigma = noise(trainer.model, 2), torch.tensor([0.7, 0.3])
    with torch.no_grad():
        trained = trainer.model.velocity(z, sigma, trainer.model.conditioning(prompts))
        with trainer.model.adapters_disabled():
            base = trainer.model.velocity(z, sigma, trainer.model.conditioning(prompts))
        reloaded = type(trainer.model)(fresh, trainer.model.config).velocity(z, sigma,
                                                                             trainer.model.conditioning(prompts))
    assert not torch.allclose(trained, base)
    torch.testing.assert_close(reloaded, trained, rtol=1e-4, atol=1e-5)

    card = write_model_card(run.path, "alice/edit-lora")  # an edit's card: image-to-image, the call with an input
    assert card.data.pipeline_tag == "image-to-image" and "widget" not in card.data.to_dict()
    # the call at the size it was trained at
    call = re.search(r'image = pipe\(image=load_image\("input.png"\), prompt="(.*)", height=32, width=32,', card.text)
    assert call and call[1] in {row.instruction for row in load_prompts(EDIT_SET)}
    assert "from diffusers.utils import load_image" in card.text


@pytest.mark.parametrize("name", EDIT_MODELS)
def test_the_memory_plan_counts_the_input_image_and_meets_the_measured_peak(name, tmp_path, offline):
    settings = {"prompts__source": EDIT_SET, "model__max_sequence_length": TEXT}
    config = editing_config(name, model__condition_resolution=CONDITION, **settings)
    trainer = Trainer(config, tmp_path)
    trainer.setup()
    measured, planned = measured_peak(trainer), plan_memory(config)
    assert planned.family == trainer.model.family
    assert "prompts and their input images for the text-embedding cache" in trainer.run.log_file.read_text()
    assert 0.75 <= planned.total / measured <= 1.25, f"planned {planned.total:.3g} B, measured {measured:.3g} B"
    assert plan_memory(editing_config(name, model__condition_resolution=16, **settings)).total < planned.total


def test_the_family_and_so_the_kind_of_prompts_a_model_takes_is_known_before_it_loads(tmp_path, offline):
    """From a preset's Hub id or a random arch, a tiny name, or a folder's model_index.json; an index that cannot be
    read (a Hub model offline and not cached) leaves the check to the model's own."""
    from jagg_core.preflight import model_family

    folder = tmp_path / "my-kontext"
    folder.mkdir()
    (folder / "model_index.json").write_text('{"_class_name": "FluxKontextPipeline"}')
    names = ["black-forest-labs/FLUX.1-Kontext-dev", "random:qwen-image-edit@1", "tiny-qwen-edit", str(folder),
             "stabilityai/stable-diffusion-3.5-medium", "tiny-sd3", "jagg-shapes", "nobody/uncached-model"]
    families = [model_family(ModelConfig(name=name)) for name in names]
    assert [family and (family.label, family.edits_images) for family in families] == [
        ("FLUX.1 Kontext", True), ("Qwen-Image-Edit", True), ("Qwen-Image-Edit", True), ("FLUX.1 Kontext", True),
        ("SD3/SD3.5", False), ("SD3/SD3.5", False), ("SD3/SD3.5", False), None]


@pytest.mark.parametrize("name, label", [("Qwen/Qwen-Image-Edit-2511", "Qwen-Image-Edit-2509/2511"),
                                         ("Qwen/Qwen-Image-Edit", "Qwen-Image-Edit"),
                                         ("black-forest-labs/FLUX.2-dev", "FLUX.2 [dev]")])
def test_a_pipeline_whose_processor_needs_torchvision_asks_for_it_before_a_launch(name, label, monkeypatch, offline):
    """Their processors (Qwen2-VL's video processor, Pixtral's) need torchvision, which requirements.txt leaves to the
    GPU machine's torch build; a plan or a dry run loads no processor, and tiny or random models have stand-ins."""
    from jagg_core import preflight

    installed = {"torchvision": False}
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda package, *args: (
        find_spec("json") if installed.get(package) else None) if package in installed else find_spec(package, *args))
    with pytest.raises(UserError, match=rf"the {re.escape(label)} pipeline of model '{name}' \(its processor\) "
                                        r"needs torchvision, which is not installed: pip install torchvision"):
        preflight.check_model(ModelConfig(name=name))
    preflight.check_model(ModelConfig(name=name), disk=False)
    for stand_in in ("tiny-qwen-edit-plus", "random:qwen-image-edit-2511@1", "random:flux2-dev@2"):
        preflight.check_model(ModelConfig(name=stand_in))
    installed["torchvision"] = True  # then the launch's next check: the weights of an offline Hub model
    with pytest.raises(UserError, match="the Hub is unreachable and it is not in the local cache"):
        preflight.check_model(ModelConfig(name=name))


# ----- presets -----------------------------------------------------------------------------------------------------
EDIT_PRESETS = [p for p in list_presets() if p.startswith(("flux-kontext-", "qwen-image-edit-"))]


def test_the_editing_presets_are_listed_and_validate(offline):
    assert any(p.startswith("flux-kontext-") and p.endswith("-24gb") for p in EDIT_PRESETS)
    assert any(p.startswith("qwen-image-edit-") for p in EDIT_PRESETS)
    assert all(p in run_cli("--list-presets").stdout for p in EDIT_PRESETS)
    for preset in EDIT_PRESETS:
        result = run_cli("--preset", preset, "--dry-run")
        assert result.returncode == 0, result.stderr
        config = load_config(preset=preset)
        assert all(isinstance(p, EditPrompt) for p in load_prompts(config.prompts.source))
        assert any(r.name == "clip_directional" for r in config.rewards)


def test_the_example_set_is_small_pngs():
    for prompt in load_prompts(EDIT_SET):
        with Image.open(io.BytesIO(prompt.images_bytes[0])) as picture:
            assert picture.format == "PNG" and max(picture.size) <= 128
    assert np.asarray(rows(1)[0].image(ImageSize.square(8))).shape == (8, 8, 3)


def test_the_page_takes_an_image_folder_inside_the_prompt_dirs(image_folder, tmp_path, monkeypatch):
    from app.form import build_config, preset_form

    form = preset_form("tiny-sd3")
    form.model, form.prompt_set = "tiny-flux-kontext", str(image_folder)
    form.knobs["prompts.eval_count"] = 1
    monkeypatch.delenv("JAGG_PROMPT_DIRS", raising=False)
    with pytest.raises(UserError, match="or image folder in a folder listed in"):
        build_config(form, tmp_path)
    monkeypatch.setenv("JAGG_PROMPT_DIRS", str(image_folder))
    assert build_config(form, tmp_path).prompts.source == str(image_folder)


# ----- Try it: one's own instruction and input image ----------------------------------------------------------------
@pytest.fixture(scope="module")
def edit_run(tmp_path_factory):
    """A run folder (in a runs folder of its own) of tiny FLUX.1 Kontext trained for one iteration."""
    runs = tmp_path_factory.mktemp("runs")
    config = tiny_config("tiny-flux-kontext", prompts__source=EDIT_SET, model__condition_resolution=16,
                         model__max_sequence_length=TEXT, train__iterations=1, sampling__resolution=RES)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        trainer = Trainer(config, runs / "kontext-20250101-000000")
        trainer.setup()
        trainer.fit()
    return runs / "kontext-20250101-000000"


def cells(picture: Image.Image, count: int) -> list[np.ndarray]:
    """The ``count`` square images of a one-row captioned grid (under its title), as arrays."""
    cell = picture.width // count
    top = 22  # the grid's title band
    return [np.asarray(picture.crop((i * cell, top, (i + 1) * cell, top + cell))) for i in range(count)]


def test_try_it_edits_ones_own_image_with_the_base_model_and_the_adapter(edit_run, tmp_path, offline):
    """``generate`` on an editing run: the input image (prepared as the run's own inputs), the base model's edit and
    the adapter's; the edit depends on the image. Without an image, or with an unreadable one, it is one line."""
    from jagg_core.generate import generate

    red, blue = tmp_path / "red.png", tmp_path / "blue.png"
    png(red, (200, 30, 30))
    png(blue, (30, 30, 200))
    edits = {path: generate(edit_run, "make it green", images=[path]) for path in (red, blue)}
    for path, colour in ((red, (200, 30, 30)), (blue, (30, 30, 200))):
        shown, base, adapted = cells(edits[path], 3)
        assert (shown == colour).all()  # centre-cropped and resized: one colour throughout
        assert base.shape == adapted.shape == shown.shape
    assert not np.array_equal(cells(edits[red], 3)[1], cells(edits[blue], 3)[1])  # the model saw the image
    with pytest.raises(UserError, match=r"the run's model \(FLUX.1 Kontext\) edits images: give the image the "
                                        r"instruction applies to \(--image PATH"):
        generate(edit_run, "make it green")
    with pytest.raises(UserError, match=r"edits images: give the image the instruction applies to"):
        generate(edit_run, "make it green", images=[red, blue])  # the run's rows have one (model.input_images)
    (tmp_path / "bad.png").write_text("not an image")
    with pytest.raises(UserError, match="the input image .*bad.png is not a readable image"):
        generate(edit_run, "make it green", images=[tmp_path / "bad.png"])


def test_an_image_of_more_pixels_than_pil_opens_is_one_line(tmp_path, monkeypatch):
    """A PNG of 20000 x 10000 pixels is 600 KB; PIL refuses to open more than twice ``MAX_IMAGE_PIXELS`` (a
    decompression bomb): a prompt folder's image or Try it's upload says so in one line (the limit lowered here)."""
    from jagg_core.generate import input_image_bytes

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 400)
    png(tmp_path / "large.png", (30, 30, 200))  # 40 x 24 = 960 pixels, more than 2 x 400
    with pytest.raises(UserError, match=r"^the input image .*large.png has more pixels than an input image may have "
                                        r"\(800, PIL's guard against decompression bombs\); resize it$"):
        input_image_bytes(tmp_path / "large.png")
    (tmp_path / "prompts.csv").write_text("file,prompt\nlarge.png,make it red\n")
    with pytest.raises(UserError, match=r"image 'large.png' has more pixels than an input image may have"):
        load_prompts(str(tmp_path))


def test_try_it_edits_the_whole_picture_in_its_shape_and_with_shape_run_its_centre_as_the_run_did(edit_run, tmp_path,
                                                                                                      offline):
    """A 3:1 picture of red, green and blue thirds in a run of 32 px outputs and 16 px inputs: by default the output
    is 48 x 16 and the input 32 x 16 (the run's areas in the picture's shape, sides in multiples of 16), which shows
    all three colours; ``shape="run"`` samples the run's 32 x 32 from its 16 x 16 centre, green alone."""
    from jagg_core.generate import generate

    stripes = Image.new("RGB", (60, 20), (200, 30, 30))
    stripes.paste((30, 160, 60), (20, 0, 40, 20))
    stripes.paste((30, 30, 200), (40, 0, 60, 20))
    stripes.save(tmp_path / "stripes.png")
    whole, centre = (generate(edit_run, "make it blue", images=[tmp_path / "stripes.png"], shape=shape)
                     for shape in ("input", "run"))
    cell, top = whole.width // 3, 22  # the grid's cells are 256 px wide, each image at its own shape's height
    shown = np.asarray(whole.crop((0, top, cell, top + cell // 2)))  # the 32 x 16 input, scaled to 256 x 128
    assert [tuple(shown[64, x]) for x in (8, 128, 248)] == [(200, 30, 30), (30, 160, 60), (30, 30, 200)]
    edit = np.asarray(whole.crop((cell, top, 2 * cell, top + cell)))  # the 48 x 16 output: 256 x 85, white below
    assert not (edit[:85] == 255).all(axis=(1, 2)).any() and (edit[86:128] == 255).all()
    shown, edit = (np.asarray(centre.crop((i * cell, top, (i + 1) * cell, top + cell))) for i in (0, 1))
    assert (shown[:, 32:224] == (30, 160, 60)).all()  # 16 x 16 of green (bicubic rings at its edges)
    assert not (edit == 255).all(axis=(1, 2)).any()  # 32 x 32


def test_generates_out_is_a_picture_file_its_folder_made_and_else_one_line_before_sampling(edit_run, tmp_path,
                                                                                          capsys, offline):
    from jagg_core.generate import main

    png(tmp_path / "in.png", (200, 30, 30))
    args = [str(edit_run), "make it green", "--image", str(tmp_path / "in.png"), "--out"]
    for out, line in ((tmp_path / "pair", "name a picture file, such as pair.png"),
                      (tmp_path / "pair.txt", "name a picture file, such as pair.png")):
        with pytest.raises(SystemExit) as stopped:
            main([*args, str(out)])
        said = capsys.readouterr().err
        assert stopped.value.code == 2 and said == f"jagg_core.generate: error: --out {out}: {line} (or .jpg, .webp)\n"
    assert main([*args, str(tmp_path / "new" / "pair.png")]) == 0 and (tmp_path / "new" / "pair.png").is_file()


def test_try_it_on_the_page_sends_the_uploaded_image(edit_run, tmp_path):
    """The page's Try it runs ``python -m jagg_core.generate ... --image UPLOAD`` for an editing run (with ``--shape
    run`` when "Use the whole picture" is off); a second picture for a run of one image a row is refused in
    generate's line (a run of two: the two-image run's test)."""
    from app.ui import Studio

    studio = Studio(edit_run.parent)
    assert [update["visible"] for update in studio.try_inputs(edit_run.name)] == [True, False, False, True]
    upload = tmp_path / "upload.png"
    png(upload, (30, 200, 30))
    image, message = studio.generate(edit_run.name, "latest adapter", "make it red", 0, str(upload))
    assert message.endswith(": the input image, the base model's edit and the adapter's"), message
    assert (cells(Image.open(image), 3)[0] == (30, 200, 30)).all()
    assert (cells(Image.open(image), 3)[1][172:] == 255).all()  # the 5:3 upload edited at 48 x 32: 256 x 171 shown
    cropped, _ = studio.generate(edit_run.name, "latest adapter", "make it red", 0, str(upload), None, None, False)
    assert not (cells(Image.open(cropped), 3)[1] == 255).all(axis=(1, 2)).any()  # "whole picture" off: 32 x 32
    _, message = studio.generate(edit_run.name, "latest adapter", "make it red", 0, str(upload), str(upload))
    assert message.startswith("**Not generated:** the run's model (FLUX.1 Kontext) edits images: give the image "
                              "the instruction applies to (--image PATH; on the page, Input image)"), message


# ----- an editing prompt set uploaded through the page: a .zip of the image folder ------------------------------------
def zipped(path, files: dict[str, bytes]):
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def upload_form(upload, **changes):
    from app.form import PROMPTS_UPLOAD, Form, preset_form

    base = preset_form("tiny-sd3")
    return Form(**{**base.__dict__, "model": "tiny-flux-kontext", "prompt_mode": PROMPTS_UPLOAD,
                   "prompt_file": str(upload), **changes})


@pytest.mark.parametrize("top", ["", "my-set/"])  # zipped from inside the folder, or the folder itself (by macOS)
def test_an_uploaded_zip_of_an_image_folder_is_the_runs_editing_prompt_set(top, tmp_path, monkeypatch):
    from app.form import UPLOADED_IMAGE_FOLDER, build_config

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "uploads"))
    red, blue = io.BytesIO(), io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(red, format="PNG")
    Image.new("RGB", (8, 8), (30, 30, 200)).save(blue, format="PNG")
    (tmp_path / "uploads").mkdir()
    upload = zipped(tmp_path / "uploads" / "set.zip", {
        f"{top}prompts.csv": b"file,prompt\nred.png,make it blue\nimages/blue.png,make it red\nred.png,add a hat\n",
        f"{top}red.png": red.getvalue(), f"{top}images/blue.png": blue.getvalue(),
        f"__MACOSX/{top}._red.png": b"Finder's resource fork"})
    run_dir = tmp_path / "run"
    config = build_config(upload_form(upload, knobs={**upload_form(upload).knobs, "prompts.eval_count": 1}), run_dir)
    assert config.prompts.source == str(run_dir / UPLOADED_IMAGE_FOLDER / top.rstrip("/"))
    loaded = load_prompts(config.prompts.source)  # the run keeps its own copy: it resumes without the upload
    assert [(row.instruction, row.label) for row in loaded] == [("make it blue", "red.png"),
                                                                ("make it red", "images/blue.png"),
                                                                ("add a hat", "red.png")]
    assert loaded[1].images_bytes == (blue.getvalue(),)


@pytest.mark.parametrize("files, message", [
    ({"../evil.png": b"x", "prompts.csv": b"file,prompt\n"}, "holds '../evil.png', a path outside its folder"),
    ({"/etc/evil.png": b"x"}, "holds '/etc/evil.png', a path outside its folder"),
    ({"a.png": b"x", "b/prompts.csv": b"file,prompt\n", "c/prompts.csv": b"file,prompt\n"},
     "needs a prompts.csv or prompts.jsonl .* at its top or in its one top folder"),
    (None, "is not a readable .zip"),
])
def test_a_bad_uploaded_zip_is_one_line_and_nothing_leaves_the_run_folder(files, message, tmp_path, monkeypatch):
    from app.form import build_config

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "uploads"))
    (tmp_path / "uploads").mkdir()
    upload = tmp_path / "uploads" / "set.zip"
    if files is None:
        upload.write_bytes(b"PK not a zip")
    else:
        zipped(upload, files)
    with pytest.raises(UserError, match=message):
        build_config(upload_form(upload), tmp_path / "run")
    assert not [path for path in tmp_path.rglob("evil.png")]


def test_an_uploaded_zip_over_the_limits_is_refused_before_it_is_unpacked(tmp_path, monkeypatch):
    from app.form import build_config
    from jagg_core import prompts

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "uploads"))
    (tmp_path / "uploads").mkdir()
    monkeypatch.setattr(prompts, "MAX_ARCHIVE_BYTES", 1000)
    upload = zipped(tmp_path / "uploads" / "set.zip", {"prompts.csv": b"file,prompt\n", "big.png": bytes(2000)})
    with pytest.raises(UserError, match="holds 2 files, 2012 bytes unpacked; the limits are 100000 files and 1000"):
        build_config(upload_form(upload), tmp_path / "run")
    assert not (tmp_path / "run").exists()
