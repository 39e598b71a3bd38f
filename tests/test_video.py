"""Text-to-video: the Wan family against its own diffusers pipeline (tiny-wan: Wan 2.1; tiny-wan22: Wan 2.2
TI2V-5B's VAE and per-token timesteps), rewards on video frames, the temporal-consistency reward, and a 2-iteration
run that writes MP4s and frame strips."""

from __future__ import annotations

import json
import warnings

import imageio_ffmpeg
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanImageToVideoPipeline, WanPipeline
from PIL import Image
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from app import live
from jagg_core.config import ModelConfig, RewardSpec, load_config, with_overrides
from jagg_core.edit_prompts import EditPrompt, input_images, png_bytes
from jagg_core.errors import UserError
from jagg_core.generate import generate
from jagg_core.image_size import ImageSize
from jagg_core import memory_plan
from jagg_core.memory_plan import CUDA_CONTEXT_GB, GB, cheapest_fit, plan_memory
from jagg_core.model_card import build_model_card, publish_files, read_run
from jagg_core.models import build_tiny_pipeline, load_flow_model
from jagg_core.models.meta import meta_pipeline
from jagg_core.models.editing import IMAGE_LATENTS
from jagg_core.models.wan import IMAGE_STATES, WanImageToVideoModel, WanModel
from jagg_core.models.wan_i2v import VIDEO_CONDITION, Wan21ImageToVideoModel
from jagg_core.rewards import CombinedReward, build_reward
from jagg_core.rewards.base import Reward
from jagg_core.rewards.catalog import NoOptions
from jagg_core.rundir import RunDirectory
from jagg_core.video import frame_indices

from conftest import (adapter_and_base_velocity, add_moved_lora, euler_ode, noise, pipeline_with_final_latents, run_cli,
                      snippet_arguments, tiny_config)

RES, FRAMES, STEPS = 32, 5, 3
SIZE = ImageSize.square(RES)
LANDSCAPE = ImageSize(height=32, width=64)  # as Wan 2.1's own 832x480
PROMPTS = ["a red ball rolling", "two blue cubes spinning on a green floor"]


def load(num_frames: int = FRAMES, name: str = "tiny-wan", **overrides):
    return load_flow_model(ModelConfig(name=name, max_sequence_length=16, **overrides), num_frames=num_frames)


# ----- the family ---------------------------------------------------------------------------------
def test_tiny_wan_is_a_video_family_with_wans_latent_layout():
    model = load()
    assert model.family == "wan" and model.is_video and model.num_frames == FRAMES
    # 16 channels -> 4 in tiny-wan; 5 frames -> 1 + 4/4 = 2 latent frames; 32 px / 8 = 4
    assert model.latent_shape(SIZE) == (4, 2, 4, 4)
    assert model.image_seq_len(SIZE) == 2 * 2 * 2
    with torch.no_grad():
        frames = model.decode(noise(model, 2))
    assert frames.shape == (2, FRAMES, 3, RES, RES) and frames.min() >= 0 and frames.max() <= 1


def test_tiny_wan22_has_wan22s_vae_and_per_token_timesteps():
    """Wan 2.2's VAE: 48 channels (8 in tiny-wan22), 16x smaller per side; the pipeline's timesteps are per token."""
    model = load(name="tiny-wan22")
    assert model.pipe.config.expand_timesteps and model.pipe.vae_scale_factor_spatial == 16
    assert model.latent_shape(SIZE) == (8, 2, 2, 2) and model.image_seq_len(SIZE) == 2
    with torch.no_grad():
        frames = model.decode(noise(model, 1))
    assert frames.shape == (1, FRAMES, 3, RES, RES)


def test_frame_counts_are_checked():
    with pytest.raises(UserError, match="4k \\+ 1"):
        load_config(preset="tiny-sd3", overrides=["sampling.num_frames=6"])
    with pytest.raises(UserError, match="makes images"):
        load_flow_model(ModelConfig(name="tiny-sd3"), num_frames=5)


def test_sigmas_are_the_euler_schedule_with_wans_flow_shift():
    """The pipeline's UniPC scheduler has flow_shift 3: the sampler's sigmas are FlowMatchEuler's with shift 3."""
    model = load()
    assert model.pipe.scheduler.config.flow_shift == 3.0
    euler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    euler.set_timesteps(10)
    sigmas = model.sigmas(10, SIZE)
    torch.testing.assert_close(sigmas, euler.sigmas.float())
    unshifted = FlowMatchEulerDiscreteScheduler()
    unshifted.set_timesteps(10)
    assert bool((sigmas[1:-1] > unshifted.sigmas[1:-1]).all())  # the shift keeps more steps near the noise


@pytest.mark.parametrize(("name", "guidance_scale", "size"), [("tiny-wan", 1.0, SIZE), ("tiny-wan", 5.0, SIZE),
                                                              ("tiny-wan", 5.0, LANDSCAPE),
                                                              ("tiny-wan22", 5.0, ImageSize(height=32, width=64))])
def test_euler_ode_reproduces_pipeline(name, guidance_scale, size):
    """z_{i+1} = z_i + (sigma_{i+1} - sigma_i) v(z_i, sigma_i) from the same noise equals WanPipeline.__call__ with
    FlowMatchEulerDiscreteScheduler(shift=flow_shift) swapped in (timestep 1000 sigma, CFG with the negative prompt,
    decoding with the VAE's latents_mean/std), square or landscape; Wan 2.2's pipeline gives every token its
    timestep, the velocity one a sample."""
    model = load(name=name, guidance_scale=guidance_scale, negative_prompt="ugly")
    z0 = noise(model, len(PROMPTS), seed=1, size=size)
    sigmas = model.sigmas(STEPS, size)
    z, frames = euler_ode(model, z0, sigmas, model.conditioning(PROMPTS))

    model.pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=model.pipe.scheduler.config.flow_shift)
    output, latents = pipeline_with_final_latents(
        model.pipe, prompt=PROMPTS, height=size.height, width=size.width, num_frames=FRAMES, num_inference_steps=STEPS,
        latents=z0.clone(), output_type="pt", **snippet_arguments(model, size, len(PROMPTS)))  # the model card's
    torch.testing.assert_close(model.pipe.scheduler.sigmas, sigmas, atol=1e-6, rtol=0)
    torch.testing.assert_close(z, latents, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(frames, output.frames.float(), atol=1e-4, rtol=1e-4)
    assert frames.shape == (len(PROMPTS), FRAMES, 3, *size)


def test_saved_lora_loads_back_with_wan_load_lora_weights(tmp_path):
    model = load()
    add_moved_lora(model)
    z, sigma, cond = noise(model, 2), torch.tensor([0.8, 0.3]), model.conditioning(PROMPTS)
    trained, base = adapter_and_base_velocity(model, z, sigma, cond)
    assert not torch.allclose(trained, base, atol=1e-3)
    model.save_lora(tmp_path)

    fresh = build_tiny_pipeline("tiny-wan")
    assert isinstance(fresh, WanPipeline)
    fresh.load_lora_weights(str(tmp_path))
    with torch.no_grad():
        reloaded = type(model)(fresh, model.config, num_frames=FRAMES).velocity(z, sigma, cond)
    torch.testing.assert_close(reloaded, trained, atol=1e-5, rtol=1e-5)


def test_the_real_arch_with_random_weights_conditions_and_predicts_at_the_real_widths():
    model = load_flow_model(ModelConfig(name="random:wan21-t2v-1.3b@1", max_sequence_length=16), num_frames=5)
    assert type(model.text_encoders[0]).__name__ == "UMT5EncoderModel"
    assert model.pipe.scheduler.config.flow_shift == 3.0 and len(model.transformer.blocks) == 1
    cond = model.conditioning(PROMPTS[:1])
    assert cond["prompt_embeds"].shape == (1, 16, 4096)
    z = torch.randn(1, *model.latent_shape(ImageSize.square(64)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        velocity = model.velocity(z, torch.tensor(0.7), cond)
    assert velocity.shape == z.shape == (1, 16, 2, 8, 8) and torch.isfinite(velocity).all()


def test_memory_plan_of_the_real_arch_counts_the_video_tokens_and_one_decoded_video_at_a_time():
    """Wan 2.1 1.3B at 480 px and 33 frames: 9 latent frames of 60 x 60, 8100 tokens. The plan (of a smaller run,
    for time): each video goes to host memory once decoded (model.vae_slicing), so the decode phase does not grow
    with the rollout's videos, and the backward holds none of them; without slicing the batch is decoded at once."""
    name = "random:wan21-t2v-1.3b@1"
    model = WanModel(meta_pipeline(name), ModelConfig(name=name), "meta", num_frames=33)
    assert model.latent_shape(ImageSize.square(480)) == (16, 9, 60, 60)
    assert model.image_seq_len(ImageSize.square(480)) == 8100
    assert model.latent_shape(ImageSize(480, 832)) == (16, 9, 60, 104)  # Wan 2.1's own 832x480
    assert model.image_seq_len(ImageSize(480, 832)) == 9 * 30 * 52

    def plan(generations: int, *more: str):
        return plan_memory(load_config(preset="wan21-t2v-1.3b-pickscore-24gb", overrides=[
            f"model.name={name}", "sampling.resolution=128", "sampling.num_frames=17",
            f"grpo.num_generations={generations}", *more]))
    two, four = plan(2), plan(4)
    assert two.family == "wan" and two.phases["VAE decode"] == four.phases["VAE decode"]
    frames = 8 * 17 * 3 * 128 * 128 * 4  # the rollout's 8 videos' decoded frames, float32
    assert four.phase_parts["backward"] - four.phase_parts["VAE decode"] < frames / 2  # the LoRA's, no frames
    whole = plan(4, "model.vae_slicing=false")
    assert whole.phases["VAE decode"] - four.phases["VAE decode"] >= 7 * frames / 8  # 8 videos' frames, not 1's


def test_wan22s_own_720p_frames_make_16x_smaller_latents_of_48_channels():
    """Wan 2.2 TI2V-5B at its own 1280x704 and 33 frames: 9 latent frames of 44 x 80, 7,920 tokens."""
    name = "random:wan22-ti2v-5b@1"
    model = WanModel(meta_pipeline(name), ModelConfig(name=name), "meta", num_frames=33)
    assert model.pipe.config.expand_timesteps and model.pipe.transformer_2 is None
    assert model.latent_shape(ImageSize(704, 1280)) == (48, 9, 44, 80)
    assert model.image_seq_len(ImageSize(704, 1280)) == 9 * 22 * 40


# ----- image-to-video -------------------------------------------------------------------------------
I2V_FRAMES = 9  # 3 latent frames: the input image's and 2 generated


def first_frame_rows(size: ImageSize = LANDSCAPE) -> list[EditPrompt]:
    """Two image-to-video rows: a text and a first frame (a coloured picture with a white box) each."""
    rows = []
    for text, colour in (("the ball rolls away", (200, 30, 30)), ("the cube spins", (30, 60, 200))):
        picture = Image.new("RGB", (size.width, size.height), colour)
        picture.paste((255, 255, 255), (size.width // 4, size.height // 4, size.width // 2, size.height // 2))
        rows.append(EditPrompt(text, png_bytes(picture), f"{text.split()[1]}.png"))
    return rows


def i2v_pipeline(pipe: WanPipeline, **scheduler) -> WanImageToVideoPipeline:
    """``WanImageToVideoPipeline`` of ``pipe``'s components (``scheduler``: another scheduler) with Wan 2.2's
    first-frame mask."""
    parts = {name: pipe.components[name] for name in ("tokenizer", "text_encoder", "vae", "transformer", "scheduler")}
    i2v = WanImageToVideoPipeline(**{**parts, **scheduler}, expand_timesteps=True)
    i2v.set_progress_bar_config(disable=True)
    return i2v


def load_i2v(size: ImageSize = LANDSCAPE, **overrides):
    return load(I2V_FRAMES, "tiny-wan22", input_images=1, condition_resolution=size.config_value(), **overrides)


@pytest.mark.parametrize(("guidance_scale", "size"), [(1.0, SIZE), (5.0, LANDSCAPE)])
def test_image_to_video_euler_ode_reproduces_the_i2v_pipeline(guidance_scale, size):
    """Wan 2.2 TI2V-5B image-to-video: the Euler ODE over the generated latent frames, the input image's frame before
    them at timestep 0 in every call, equals WanImageToVideoPipeline.__call__ (expand_timesteps: the first frame's
    mask) with FlowMatchEulerDiscreteScheduler(shift=5) from the same noise and image, latents and frames, with and
    without CFG, square and landscape."""
    model = load_i2v(size, guidance_scale=guidance_scale, negative_prompt="ugly")
    assert isinstance(model, WanImageToVideoModel)
    rows = first_frame_rows(size)
    cond = model.conditioning(rows)
    rows_, cols = size.latent(16)
    assert model.latent_shape(size) == (8, 2, rows_, cols) and cond[IMAGE_LATENTS].shape == (2, 8, 1, rows_, cols)
    assert model.image_seq_len(size) == 3 * rows_ * cols // 4  # the transformer sees the input image's tokens too
    z0 = noise(model, len(rows), seed=1, size=size)
    sigmas = model.sigmas(STEPS, size)
    z, frames = euler_ode(model, z0, sigmas, cond)

    pipe = i2v_pipeline(model.pipe, scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0))
    for i, row in enumerate(rows):  # the pipeline's first latent frame is overwritten by the image's: any noise
        latents = torch.cat([torch.randn((1, 8, 1, rows_, cols)), z0[i:i + 1]], dim=2)
        output, final = pipeline_with_final_latents(
            pipe, image=row.image(size), prompt=row.instruction, height=size.height, width=size.width,
            num_frames=I2V_FRAMES, num_inference_steps=STEPS, latents=latents, output_type="pt",
            **snippet_arguments(model, size))
        torch.testing.assert_close(final[:, :, 1:], z[i:i + 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(frames[i:i + 1], output.frames.float(), atol=1e-4, rtol=1e-4)
    assert frames.shape == (2, I2V_FRAMES, 3, *size)


def test_decoded_to_host_one_video_at_a_time_are_the_batchs_bits_and_a_tiled_decode_plans_a_fraction():
    """decode_to_host under model.vae_slicing decodes one sample at a time, as the sliced VAE does: the same bits as
    decoding the batch. model.vae_tiling decodes in tiles: Wan 2.2's whole 720p video decode plans 9.9 GB, tiled
    under a tenth of it."""
    model = load(name="tiny-wan22")
    z = noise(model, 3)
    cond = model.conditioning(["a", "b", "c"])
    with torch.no_grad():
        assert torch.equal(model.decode_to_host(z, cond), model.decode_samples(z, cond))
    assert load(name="tiny-wan22", vae_tiling=True).pipe.vae.use_tiling

    def decode_phase(tiling: bool) -> float:
        return plan_memory(load_config(preset="wan22-ti2v-5b-pickscore-24gb", overrides=[
            "model.name=random:wan22-ti2v-5b@1", f"model.vae_tiling={tiling}", "grpo.num_generations=2",
            "grpo.prompts_per_iteration=1", "prompts.eval_count=2"])).phases["VAE decode"]
    whole, tiled = decode_phase(False), decode_phase(True)
    assert whole > 9e9 and tiled < whole / 8


def test_the_input_images_frame_is_the_videos_first_whatever_the_samples():
    """Wan's VAE is causal in time: a video's first frame is the decoding of the input image's latent frame alone,
    the same for any generated frames after it."""
    model = load_i2v()
    cond = model.conditioning(first_frame_rows())
    with torch.no_grad():
        alone = model.decode(cond[IMAGE_LATENTS])[:, 0]
        first, second = (model.decode_samples(noise(model, 2, seed=seed, size=LANDSCAPE), cond) for seed in (0, 1))
    torch.testing.assert_close(first[:, 0], alone, atol=1e-6, rtol=0)
    torch.testing.assert_close(second[:, 0], alone, atol=1e-6, rtol=0)
    assert not torch.allclose(first[:, -1], second[:, -1], atol=1e-3)


def test_image_to_video_is_refused_where_it_cannot_run():
    with pytest.raises(UserError, match="generates from text alone .*unset model.input_images"):
        load(I2V_FRAMES, "tiny-wan", input_images=1, condition_resolution=32)  # Wan 2.1 T2V
    with pytest.raises(UserError, match="sampling.num_frames is 1: image-to-video makes frames after the input "
                                        "image, set it to 5 or more"):
        load(1, "tiny-wan22", input_images=1, condition_resolution=32)
    model = load_i2v()
    with pytest.raises(UserError, match="model.condition_resolution is 64x32 but sampling.resolution is 32: .*"
                                        "set model.condition_resolution=32$"):
        model.check_size(SIZE)
    with pytest.raises(UserError, match=r"the wan model makes videos from an input image \(model.input_images is 1\), "
                                        "but the prompt 'a red ball rolling' has no input image"):
        model.conditioning(PROMPTS)
    with pytest.raises(UserError, match="takes 0 to 1 input image"):
        load(I2V_FRAMES, "tiny-wan22", input_images=2)


def test_a_lower_resolution_that_fits_takes_the_first_frame_with_it():
    """The cheapest change that fits an image-to-video run at a lower resolution sets the input image's size too (its
    videos' first frame): the answer resumes as written (before, ``--plan`` refused its own change in one line)."""
    config = tiny_config("tiny-wan22", model__input_images=1, model__condition_resolution=384,
                         sampling__resolution=384, sampling__num_frames=5, prompts__source="animate")
    full = plan_memory(config)
    changes, plan = cheapest_fit(config, 0.3 * full.total / GB + CUDA_CONTEXT_GB, full.traces)
    assert changes[-2:] == ["sampling.resolution=256", "model.condition_resolution=256"]
    assert plan.totals == plan_memory(with_overrides(config, changes)).totals


def test_a_video_run_that_does_not_fit_is_told_shorter_videos_before_a_lower_resolution():
    """Of the changes that make a different run, a video's cheapest fit shortens its videos (4k + 1 frames) before it
    lowers their resolution."""
    config = tiny_config("tiny-wan", sampling__resolution=384, sampling__num_frames=33)
    savers = memory_plan._memory_savers(config)
    assert savers[-3:] == [("sampling.num_frames", 17), ("sampling.num_frames", 9), ("sampling.resolution", 256)]
    every_other_saver = dict(change for change in savers if not change[0].startswith("sampling."))
    budget = plan_memory(memory_plan._changed(config, {**every_other_saver, "sampling.num_frames": 17})).total
    changes, plan = cheapest_fit(config, budget / GB + CUDA_CONTEXT_GB)
    assert changes[-1] == "sampling.num_frames=17" and not any("resolution" in change for change in changes)


def test_the_i2v_presets_transformer_sees_the_first_frames_tokens_with_the_generated_ones():
    """The image-to-video preset on the real arch (meta weights): 33 frames at 960x544 are 9 latent frames of 34 x 60,
    the first the input image's (its plan's budget: test_memory's test of every preset)."""
    config = load_config(preset="wan22-ti2v-5b-i2v-pickscore-24gb")
    model = WanImageToVideoModel(meta_pipeline("random:wan22-ti2v-5b@1"), config.model, "meta", num_frames=33)
    assert model.conditioning_shapes()[IMAGE_LATENTS] == (48, 1, 34, 60)
    assert model.latent_shape(config.sampling.size) == (48, 8, 34, 60)
    assert model.image_seq_len(config.sampling.size) == 9 * 17 * 30


# ----- Wan 2.1 image-to-video: a CLIP image encoder, 36 input channels ----------------------------------------------
def load_wan21_i2v(size: ImageSize = LANDSCAPE, num_frames: int = I2V_FRAMES, **overrides):
    return load(num_frames, "tiny-wan-i2v", condition_resolution=size.config_value(), **overrides)


@pytest.mark.parametrize(("guidance_scale", "size"), [(1.0, SIZE), (5.0, LANDSCAPE)])
def test_wan21_image_to_video_euler_ode_reproduces_the_i2v_pipeline(guidance_scale, size):
    """Wan 2.1 image-to-video: the Euler ODE over every latent frame, each transformer call seeing the mask and the
    video [image, 0, ..., 0]'s latents as 4 + C more input channels and the CLIP image states beside the text's,
    equals WanImageToVideoPipeline.__call__ with FlowMatchEulerDiscreteScheduler(shift=3) from the same noise and
    image, latents and frames, with and without CFG, square and landscape."""
    model = load_wan21_i2v(size, guidance_scale=guidance_scale, negative_prompt="ugly")
    assert isinstance(model, Wan21ImageToVideoModel) and model.transformer.config.in_channels == 4 + 2 * 4
    rows = first_frame_rows(size)
    cond = model.conditioning(rows)
    rows_, cols = size.latent(8)
    assert model.latent_shape(size) == (4, 3, rows_, cols)  # the first latent frame is generated too
    assert cond[VIDEO_CONDITION].shape == (2, 4 + 4, 3, rows_, cols) and cond[IMAGE_STATES].shape == (2, 17, 8)
    assert cond[VIDEO_CONDITION][:, :4, 0].eq(1).all() and cond[VIDEO_CONDITION][:, :4, 1:].eq(0).all()
    assert not torch.equal(cond[IMAGE_STATES][0], cond[IMAGE_STATES][1])  # each row's own image
    z0 = noise(model, len(rows), seed=1, size=size)
    z, frames = euler_ode(model, z0, model.sigmas(STEPS, size), cond)

    pipe = model.pipe
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    for i, row in enumerate(rows):
        output, final = pipeline_with_final_latents(
            pipe, image=row.image(size), prompt=row.instruction, height=size.height, width=size.width,
            num_frames=I2V_FRAMES, num_inference_steps=STEPS, latents=z0[i:i + 1].clone(), output_type="pt",
            **snippet_arguments(model, size))
        torch.testing.assert_close(final, z[i:i + 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(frames[i:i + 1], output.frames.float(), atol=1e-4, rtol=1e-4)
    assert frames.shape == (2, I2V_FRAMES, 3, *size)


def test_wan21_image_to_video_is_refused_where_it_cannot_run():
    """Rows without an image, a video of its first frame alone, an input image of another size than the frames, two
    input images a row: one line each."""
    model = load_wan21_i2v()
    with pytest.raises(UserError, match=r"^the wan-i2v model makes videos from an input image, but the prompt 'a red "
                                        r"ball rolling' has no input image; give prompts.source an image folder"):
        model.conditioning(PROMPTS)
    with pytest.raises(UserError, match="sampling.num_frames is 1: image-to-video makes frames after the input image"):
        load_wan21_i2v(num_frames=1)
    with pytest.raises(UserError, match="model.condition_resolution is 64x32 but sampling.resolution is 32"):
        model.check_size(SIZE)
    with pytest.raises(UserError, match="model.input_images is 2, but the Wan 2.1 / Wan 2.2 A14B image-to-video model takes 1 input"):
        load_wan21_i2v(input_images=2)


def test_the_wan21_i2v_arch_with_random_weights_conditions_at_the_real_widths_and_its_plan_counts_the_image_encoder():
    """Wan2.1-I2V-14B-480P's arch, one block: the image states are CLIP ViT-H/14's 257 x 1280 at the real width, the
    video condition 4 + 16 channels (36 inputs); the memory plan counts the image encoder with UMT5 at set-up, the
    first frames' video encoding, and the cached image states and video condition a prompt."""
    name = "random:wan21-i2v-14b-480p@1"
    model = load_flow_model(ModelConfig(name=name, max_sequence_length=16, condition_resolution=64), num_frames=5)
    assert isinstance(model, Wan21ImageToVideoModel) and model.transformer.config.in_channels == 36
    assert [type(encoder).__name__ for encoder in model.text_encoders] == ["UMT5EncoderModel",
                                                                            "CLIPVisionModelWithProjection"]
    cond = model.conditioning(first_frame_rows(ImageSize.square(64))[:1])
    assert cond[IMAGE_STATES].shape == (1, 257, 1280) and cond[VIDEO_CONDITION].shape == (1, 20, 2, 8, 8)
    z = torch.randn(1, *model.latent_shape(ImageSize.square(64)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        velocity = model.velocity(z, torch.tensor(0.7), cond)
    assert velocity.shape == z.shape == (1, 16, 2, 8, 8) and torch.isfinite(velocity).all()
    model.release_text_encoders()
    assert model.text_encoders == [] and model.pipe.image_encoder is None

    config = tiny_config("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", model__condition_resolution=128,  # its real configs
                         sampling__resolution=128, sampling__num_frames=9, prompts__source="animate",
                         grpo__num_generations=2)
    plan = plan_memory(config)
    encoders = next(key for key in plan.setup if key.startswith("text encoders"))
    assert "CLIPVisionModelWithProjection" in encoders and plan.setup[encoders] > 0.63e9 * 4
    assert "VAE (encodes the input images, float32)" in plan.setup
    text, video_condition = config.model.max_sequence_length * 4096, 20 * 3 * 16 * 16  # 9 frames: 3 latent ones
    assert plan.bytes_per_cached_prompt == 4 * (text + 257 * 1280 + video_condition)


# ----- rewards on videos ----------------------------------------------------------------------------
class Brightness(Reward):
    """The mean pixel value of each image; records the prompts it was called with."""

    name = "brightness"

    def __call__(self, images, prompts):
        self.prompts = list(prompts)
        return images.mean(dim=(1, 2, 3))


def graded_videos(levels: list[float], count: int = 2) -> torch.Tensor:
    """``count`` videos whose frame f is flat at ``levels[f]`` (video n: levels + n / 10)."""
    frames = torch.tensor(levels).view(1, -1, 1, 1, 1) + torch.arange(count).view(-1, 1, 1, 1, 1) / 10
    return frames.expand(count, len(levels), 3, 8, 8).clone()


def test_frame_indices_are_evenly_spaced_first_to_last():
    assert frame_indices(81, 4) == [0, 27, 53, 80]
    assert frame_indices(5, 3) == [0, 2, 4]
    assert frame_indices(5, 8) == [0, 1, 2, 3, 4]
    assert frame_indices(33, 1) == [0]


def test_image_rewards_average_their_evenly_spaced_frames():
    reward = Brightness(options=NoOptions())
    videos = graded_videos([0.0, 0.1, 0.5, 0.3, 0.4])
    total, parts = CombinedReward([reward], [2.0], ["brightness"], reward_frames=3)(videos, ["a", "b"])
    torch.testing.assert_close(parts["brightness"], torch.tensor([0.3, 0.4]))  # frames 0, 2, 4
    torch.testing.assert_close(total, 2 * parts["brightness"])
    assert reward.prompts == ["a"] * 3 + ["b"] * 3
    for count, expected in ((2, [0.2, 0.3]), (8, [0.26, 0.36])):  # frames 0 and 4; all 5 frames
        _, scored = CombinedReward([reward], [1.0], ["b"], reward_frames=count)(videos, ["a", "b"])
        torch.testing.assert_close(scored["b"], torch.tensor(expected))
    images = videos[:, 2]
    _, plain = CombinedReward([reward], [1.0], ["b"], reward_frames=3)(images, ["a", "b"])
    torch.testing.assert_close(plain["b"], torch.tensor([0.5, 0.6]))  # images go to the reward as they are


class FirstFrameDistance(Reward):
    """Each image's mean distance to its input image; records what it was called with."""

    name = "first_frame_distance"
    takes_inputs = True

    def __call__(self, images, prompts, inputs=None):
        self.prompts, self.inputs = list(prompts), inputs
        return (images - inputs).abs().mean(dim=(1, 2, 3))


def test_an_editing_reward_scores_an_image_to_video_runs_frames_against_their_videos_input_image():
    rows = first_frame_rows(ImageSize.square(8))
    reward = FirstFrameDistance(options=NoOptions())
    videos = graded_videos([0.0, 0.1, 0.5, 0.3, 0.4])
    _, parts = CombinedReward([reward], [1.0], ["distance"], reward_frames=3)(videos, rows)
    inputs = input_images(rows, ImageSize.square(8))
    assert reward.prompts == [rows[0]] * 3 + [rows[1]] * 3
    torch.testing.assert_close(reward.inputs, inputs.repeat_interleave(3, dim=0))  # each frame its video's input
    expected = [(videos[n, [0, 2, 4]] - inputs[n]).abs().mean() for n in range(2)]
    torch.testing.assert_close(parts["distance"], torch.stack(expected))


def test_temporal_consistency_is_the_mean_cosine_of_consecutive_frames(tiny_clip):
    folder, _ = tiny_clip
    reward = build_reward(RewardSpec(name="temporal_consistency", options={"model_id": folder}))
    generator = torch.Generator().manual_seed(0)
    a, b = torch.rand((2, 3, 32, 32), generator=generator)
    still = torch.stack([a] * 5)[None]
    flicker = torch.stack([a, b, a, b, a])[None]
    scores = reward(torch.cat([still, flicker]), ["x", "y"])
    embeds = reward.image_embeds(torch.stack([a, b]))
    cos_ab = float((embeds[0] * embeds[1]).sum())
    torch.testing.assert_close(scores, torch.tensor([1.0, cos_ab]), atol=1e-5, rtol=0)
    assert cos_ab < 0.999
    with pytest.raises(UserError, match="video"):
        reward(torch.rand((2, 3, 32, 32)), ["x", "y"])


def test_motion_is_the_mean_change_of_consecutive_frames_averaged_down_so_noise_cancels_and_movement_stays():
    reward = build_reward(RewardSpec(name="motion"))
    generator = torch.Generator().manual_seed(0)
    a, b = torch.rand((2, 3, 32, 32), generator=generator)
    still, flicker = torch.stack([a] * 5), torch.stack([a, b, a, b, a])
    torch.testing.assert_close(reward(torch.stack([still, flicker]), ["x", "y"]),
                               torch.stack([torch.tensor(0.0), (a - b).abs().mean()]))  # 32 px: read as they are
    noise = torch.rand((5, 3, 128, 128), generator=generator)  # 128 px: averaged down to 64 first
    moving = torch.zeros((5, 3, 128, 128))
    for frame in range(5):
        moving[frame, :, 32:64, 16 * frame:16 * frame + 32] = 1.0  # a white square moving 16 px a frame
    raw = [(video[1:] - video[:-1]).abs().mean() for video in (noise, moving)]
    scores = reward(torch.stack([noise, moving]), ["x", "y"])
    assert scores[0] < 0.6 * raw[0]  # grain cancels
    torch.testing.assert_close(scores[1], raw[1])  # what moves stays
    with pytest.raises(UserError, match="^the motion reward scores videos of 2 frames or more"):
        reward(torch.rand((2, 3, 32, 32)), ["x", "y"])


# ----- a run -------------------------------------------------------------------------------------------
def read_mp4(path) -> tuple[dict, list[np.ndarray]]:
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    width, height = meta["size"]
    return meta, [np.frombuffer(f, np.uint8).reshape(height, width, 3) for f in reader]


@pytest.mark.parametrize(("name", "model_class"), [("tiny-wan", WanModel), ("tiny-wan22", WanImageToVideoModel),
                                                  ("tiny-wan-i2v", Wan21ImageToVideoModel)])
def test_two_iterations_on_tiny_wan_write_mp4s_and_strips_and_the_adapter_loads_back(name, model_class, tmp_path,
                                                                                       tiny_clip):
    """GRPO with a JAGG window of 3 (one interpolated step) and its audit, an image reward on 2 frames of each video
    and the temporal-consistency reward, through the CLI: Wan 2.1 text-to-video, and Wan 2.2 TI2V-5B's and Wan 2.1's
    image-to-video on the built-in ``animate`` set with CLIP directional similarity to each video's input image."""
    from_image = model_class is not WanModel
    clip = f"options: {{model_id: '{tiny_clip[0]}'}}"
    image_reward = f"{{name: clip_directional, {clip}}}" if from_image else "{name: jpeg_compressibility}"
    out, rewards = tmp_path / "run", f"rewards=[{image_reward}, {{name: temporal_consistency, weight: 0.5, {clip}}}]"
    first_frames = ["--set", "model.input_images=1", "--set", "model.condition_resolution=32",
                    "--set", "prompts.source=animate"] if from_image else []
    result = run_cli("--preset", "tiny-sd3", "--output-dir", str(out), "--set", f"model.name={name}",
                     "--set", "sampling.num_frames=5", "--set", "sampling.fps=8", "--set", "sampling.resolution=32",
                     "--set", "sampling.num_steps=4", "--set", "train.iterations=2", "--set", "grpo.num_generations=2",
                     "--set", "prompts.eval_count=2", "--set", "backward.window=3", "--set", "backward.audit_every=2",
                     "--set", "sampling.reward_frames=2", "--set", "model.max_sequence_length=16", "--set", rewards,
                     "--set", "eval.judges=[{name: motion}]", *first_frames)
    assert result.returncode == 0, result.stderr[-2000:]
    run = RunDirectory(out)
    assert run.read_status()["state"] == "finished"
    rows = run.read_metrics()
    assert [row["iteration"] for row in rows] == [0, 1, 2]
    assert abs(rows[2]["reward/temporal_consistency"]) <= 1 + 1e-5 and abs(rows[2]["jagg/grad_cosine"]) <= 1 + 1e-5
    assert all(0 < rows[i]["eval/judge/motion"] < 1 for i in (0, 2))  # random tiny weights: videos that flicker
    for samples in (run.samples(0), run.samples(2), run.rollouts()):
        assert len(samples.videos) == len(samples.images) == len(samples.prompts)
        meta, frames = read_mp4(samples.videos[0])
        assert len(frames) == 5 and meta["size"] == (32, 32) and meta["fps"] == 8
        with Image.open(samples.images[0]) as strip:
            assert strip.size == (5 * 32, 32)  # every frame of a 5-frame video, side by side
    with Image.open(run.grid_file(2)) as grid:
        assert grid.width == 2 * 128
    assert json.loads((run.samples_dir(2) / "info.json").read_text())["iteration"] == 2
    video, label = live.latest_video(out)  # what the page's gr.Video shows
    assert video == str(run.samples(2).videos[0]) and "iteration 2" in label
    snapshot = read_run(out)
    card = str(build_model_card(snapshot, "alice/wan-lora"))
    assert f"pipeline_tag: {'image' if from_image else 'text'}-to-video" in card
    assert '<video src="samples/000.mp4"' in card and "export_to_video(frames" in card
    assert publish_files(snapshot, "alice/wan-lora")["samples/000.mp4"] == run.samples(2).videos[0]
    if from_image:
        # TI2V-5B's model_index names WanPipeline, Wan 2.1 I2V's the image-to-video pipeline itself
        pipeline = "WanImageToVideoPipeline" if model_class is WanImageToVideoModel else "DiffusionPipeline"
        assert f"pipe = {pipeline}.from_pretrained(" in card
        assert 'frames = pipe(image=load_image("input.png"), prompt="' in card
        assert all(".png " in prompt for prompt in run.samples(2).prompts)  # a row's text names its image
        with pytest.raises(UserError, match=r"^the run's model \(Wan .*\) makes videos from an input image: give the "
                                            r"image its videos start from \(--image PATH; on the page, Input image\)$"):
            generate(out, "the circle rolls")  # Try it without its image

    pipe = build_tiny_pipeline(name)  # the run's base model: drawn from train.seed 0
    if model_class is WanImageToVideoModel:  # the pipeline class the card names loads the adapter
        pipe = i2v_pipeline(pipe)
    assert isinstance(pipe, WanImageToVideoPipeline) == from_image
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.load_lora_weights(str(run.lora_dir), adapter_name="tuned")
    assert not [str(w.message) for w in caught if "PEFT" in str(w.message)]  # diffusers padded nothing
    saved = load_file(run.lora_dir / "pytorch_lora_weights.safetensors")
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name="tuned")
    assert {f"transformer.{key}" for key in loaded} == set(saved)  # every trained weight, the image's keys too
    assert all(torch.equal(loaded[key.removeprefix("transformer.")], value) for key, value in saved.items())
    assert any("attn2.add_k_proj" in key for key in saved) == (model_class is Wan21ImageToVideoModel)
    config = ModelConfig(name=name, max_sequence_length=16, input_images=1 if from_image else None,
                         condition_resolution=32)
    model = model_class(pipe, config, num_frames=5)
    prompts = first_frame_rows(SIZE)[:1] if from_image else PROMPTS[:1]
    tuned, base = adapter_and_base_velocity(model, noise(model, 1), torch.tensor([0.6]), model.conditioning(prompts))
    assert not torch.equal(tuned, base)  # two updates moved the adapter's zero-initialised B
