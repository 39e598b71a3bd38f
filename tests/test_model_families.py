"""The model adapters (SD3, FLUX, Qwen-Image) against their own diffusers pipelines, on tiny models.

The strongest check is :func:`test_euler_ode_reproduces_pipeline`: an Euler ODE with the
adapter's sigmas and velocity, from the same initial noise, must give the pipeline's own
``__call__`` latents and images. That pins down the packing, the timestep scaling, the guidance
embedding, the CFG combination and the decoding.
"""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

from jagg_core.config import LoraConfig, ModelConfig
from jagg_core.errors import UserError
from jagg_core.image_size import ImageSize
from jagg_core.models import FAMILIES, build_tiny_pipeline, load_flow_model
from jagg_core.models.base import NEGATIVE
from jagg_core.models.flux import FluxModel

from conftest import (adapter_and_base_velocity, add_moved_lora, euler_ode, loop_latents, noise, pipeline_kwargs,
                      pipeline_latents, pipeline_with_final_latents)

FAMILY = {"tiny-sd3": "sd3", "tiny-flux": "flux", "tiny-qwen": "qwen-image"}
NAMES = list(FAMILY)
RES, STEPS = 32, 3
SIZE = ImageSize.square(RES)
LANDSCAPE = ImageSize(height=32, width=64)  # twice as many tokens across as down
PROMPTS = ["a red circle", "two blue squares on a green background"]


def load(name: str, **overrides):
    return load_flow_model(ModelConfig(name=name, max_sequence_length=32, **overrides))


def schnell(config: ModelConfig) -> FluxModel:
    """tiny-flux turned into a FLUX.1-schnell-like model: no guidance embedding, no dynamic shift."""
    pipe = build_tiny_pipeline("tiny-flux")
    pipe.transformer = FluxTransformer2DModel.from_config({**pipe.transformer.config, "guidance_embeds": False})
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    return FluxModel(pipe, config)


class _Stop(Exception):
    pass


def _stop(*_args):
    raise _Stop


def pipeline_sigmas(model, num_steps: int, size: ImageSize) -> torch.Tensor:
    """The sigmas the pipeline's own ``__call__`` sets on its scheduler (stopped after one step)."""
    kwargs = pipeline_kwargs(model, size)
    with pytest.raises(_Stop):
        model.pipe(prompt=PROMPTS[:1], num_inference_steps=num_steps, callback_on_step_end=_stop, **kwargs)
    return model.pipe.scheduler.sigmas


# ----- loading ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_tiny_models_load_with_their_family(name):
    model = load(name)
    assert model.family == FAMILY[name]
    assert sum(p.numel() for p in model.transformer.parameters()) < 1_000_000


@pytest.mark.parametrize("name", [*NAMES, "tiny-flux2", "tiny-zimage"])  # FLUX.2, Z-Image: test_flux2_zimage.py
def test_local_folder_loads_and_family_is_detected(name, tmp_path):
    model = load(name)
    model.pipe.save_pretrained(tmp_path)
    reloaded = load_flow_model(ModelConfig(name=str(tmp_path), max_sequence_length=32))
    assert type(reloaded) is type(model) and reloaded.family == model.family
    z, cond = noise(model, 1), model.conditioning(PROMPTS[:1])
    with torch.no_grad():
        expected = model.velocity(z, torch.tensor(0.7), cond)
        actual = reloaded.velocity(z, torch.tensor(0.7), reloaded.conditioning(PROMPTS[:1]))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_unknown_pipeline_class_is_a_user_error(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "KandinskyPipeline"}))
    with pytest.raises(UserError, match="KandinskyPipeline"):
        load_flow_model(ModelConfig(name=str(tmp_path)))


def test_flux_rejects_t5_sequences_longer_than_the_pipeline_allows():
    with pytest.raises(UserError, match="max_sequence_length"):
        load_flow_model(ModelConfig(name="tiny-flux", max_sequence_length=600))


def test_families_are_registered_by_pipeline_class():
    """The image families here, Wan and Wan 2.1 image-to-video (video, tests/test_video.py), the editing families
    (tests/test_editing.py) and FLUX.2 [klein] and [dev] and Z-Image (tests/test_flux2_zimage.py)."""
    assert {cls.family for cls in FAMILIES.values()} == set(FAMILY.values()) | {
        "wan", "wan-i2v", "flux-kontext", "qwen-image-edit", "qwen-image-edit-plus", "flux2", "flux2-dev", "z-image"}


def test_tiny_qwen_tokenizer_drops_exactly_the_template_prefix():
    """The pipeline drops ``prompt_template_encode_start_idx`` tokens: the whole system prefix."""
    pipe = build_tiny_pipeline("tiny-qwen")
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx


# ----- conditioning ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_conditioning_is_batched_and_the_kept_prompts_come_from_the_cache(name, monkeypatch):
    model = load(name, guidance_scale=3.0, negative_prompt="blurry")
    cond = model.conditioning([PROMPTS[0], PROMPTS[1], PROMPTS[0]])
    assert model.cached_embeddings == {}  # encoded for this batch, not kept
    positive = [k for k in cond if not k.startswith(NEGATIVE)]
    assert positive and sorted(NEGATIVE + k for k in positive) == sorted(k for k in cond if k.startswith(NEGATIVE))
    for key, value in cond.items():
        assert value.shape[0] == 3
        assert torch.equal(value[0], value[2])
        if not key.startswith(NEGATIVE):
            assert value.shape == cond[NEGATIVE + key].shape
    assert not torch.equal(cond["prompt_embeds"][0], cond["prompt_embeds"][1])

    model.encode_and_cache([PROMPTS[1]])
    calls = []
    monkeypatch.setattr(model, "encode_prompts", lambda prompts: calls.append(prompts))
    again = model.conditioning([PROMPTS[1]])
    assert calls == [] and torch.equal(again["prompt_embeds"][0], cond["prompt_embeds"][1])


# ----- sigmas -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("num_steps", "size"), [(4, SIZE), (10, ImageSize.square(128)), (10, ImageSize(128, 64))])
def test_sigmas_are_the_pipelines_schedule(name, num_steps, size):
    model = load(name)
    sigmas = model.sigmas(num_steps, size)
    assert sigmas.shape == (num_steps + 1,)
    assert sigmas[0] > 0.9 and sigmas[-1] == 0 and bool((sigmas[1:] < sigmas[:-1]).all())
    torch.testing.assert_close(sigmas, pipeline_sigmas(model, num_steps, size), atol=1e-6, rtol=0)


def test_a_flow_shift_gives_the_schedule_of_the_pipelines_scheduler_at_that_shift():
    """``model.flow_shift``: SD3's schedule is its pipeline's once the model card's line sets the scheduler's shift;
    a model whose shift follows the image size refuses it in one line."""
    model = load("tiny-sd3", flow_shift=1.5)
    default, shifted = load("tiny-sd3").sigmas(STEPS, SIZE), model.sigmas(STEPS, SIZE)
    model.pipe.scheduler = model.pipe.scheduler.from_config(model.pipe.scheduler.config, shift=1.5)  # the card's line
    torch.testing.assert_close(shifted, pipeline_sigmas(model, STEPS, SIZE), atol=1e-6, rtol=0)
    assert bool((shifted[1:-1] < default[1:-1]).all())  # a smaller shift (SD3's is 3): less noise at each step
    with pytest.raises(UserError, match=r"^model.flow_shift sets a fixed schedule shift, but 'tiny-flux' shifts its "
                                        r"schedule with the image size \(its scheduler's use_dynamic_shifting\): "
                                        r"unset model.flow_shift$"):
        load("tiny-flux", flow_shift=3.0)


def test_schnell_sigmas_are_the_pipelines_schedule():
    model = schnell(ModelConfig(name="tiny-flux", max_sequence_length=32))
    size = ImageSize.square(64)
    torch.testing.assert_close(model.sigmas(4, size), pipeline_sigmas(model, 4, size), atol=1e-6, rtol=0)


# ----- velocity and decoding --------------------------------------------------------------------
@pytest.mark.parametrize("name", [*NAMES, "tiny-flux2", "tiny-zimage"])
def test_velocity_shape_cfg_and_decode(name):
    plain, guided = load(name), load(name, guidance_scale=4.0, negative_prompt="blurry")
    z, sigma = noise(plain, 2), torch.tensor([0.9, 0.4])
    with torch.no_grad():
        v = plain.velocity(z, sigma, plain.conditioning(PROMPTS))
        v_cfg = guided.velocity(z, sigma, guided.conditioning(PROMPTS))
        images = plain.decode(z)
    assert v.shape == v_cfg.shape == z.shape == (2, *plain.latent_shape(SIZE))
    assert torch.isfinite(v_cfg).all() and not torch.allclose(v, v_cfg)
    assert images.shape == (2, 3, RES, RES) and images.dtype == torch.float32
    assert images.min() >= 0 and images.max() <= 1


def test_qwen_true_cfg_keeps_the_conditional_norm_per_token():
    model = load("tiny-qwen", guidance_scale=4.0)
    cond = model.conditioning(PROMPTS)
    positive = {k: v for k, v in cond.items() if not k.startswith(NEGATIVE)}
    z, sigma = noise(model, 2), torch.tensor([0.8, 0.8])
    with torch.no_grad():
        v, v_pos = model.velocity(z, sigma, cond), model.transformer_velocity(z, sigma, positive)
    torch.testing.assert_close(v.norm(dim=-1), v_pos.norm(dim=-1), atol=1e-5, rtol=1e-5)


def test_flux_guidance_embedding_is_used():
    model = load("tiny-flux", flux_guidance=1.0)
    z, sigma, cond = noise(model, 1), torch.tensor(0.5), model.conditioning(PROMPTS[:1])
    with torch.no_grad():
        low = model.velocity(z, sigma, cond)
        model.config.flux_guidance = 5.0
        high = model.velocity(z, sigma, cond)
    assert not torch.allclose(low, high)


@pytest.mark.parametrize("variant", [*NAMES, "tiny-flux-schnell"])
@pytest.mark.parametrize(("guidance_scale", "size"), [(1.0, SIZE), (3.0, SIZE), (3.0, LANDSCAPE)],
                         ids=["square", "square-cfg", "landscape-cfg"])
def test_euler_ode_reproduces_pipeline(variant, guidance_scale, size):
    """z_{i+1} = z_i + (sigma_{i+1} - sigma_i) v(z_i, sigma_i) equals the pipeline's sampling loop, at a square size
    and a landscape one (height 32, width 64: a packed family's token positions are (row, column) of its grid)."""
    config = ModelConfig(name=variant.removesuffix("-schnell"), guidance_scale=guidance_scale,
                         negative_prompt="ugly", flux_guidance=2.5, max_sequence_length=32)
    model = schnell(config) if variant.endswith("schnell") else load_flow_model(config)
    z0 = noise(model, len(PROMPTS), seed=1, size=size)
    sigmas = model.sigmas(STEPS, size)
    z, images = euler_ode(model, z0, sigmas, model.conditioning(PROMPTS))
    output, latents = pipeline_with_final_latents(model.pipe, prompt=PROMPTS, num_inference_steps=STEPS,
                                                  latents=pipeline_latents(model, z0), output_type="pt",
                                                  **pipeline_kwargs(model, size, len(PROMPTS)))
    torch.testing.assert_close(model.pipe.scheduler.sigmas, sigmas, atol=1e-6, rtol=0)
    torch.testing.assert_close(loop_latents(model, z), latents, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(images, output.images.float(), atol=1e-4, rtol=1e-4)
    assert images.shape[-2:] == size


# ----- LoRA ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [{}, {"use_dora": True}, {"use_rslora": True}], ids=["lora", "dora", "rslora"])
@pytest.mark.parametrize("name", NAMES)
def test_saved_lora_reloads_in_a_fresh_pipeline(name, kind, tmp_path):
    """The adapter, a plain LoRA, a DoRA or one of rsLoRA's scale, loads with ``load_lora_weights`` into a fresh
    pipeline (which reads its kind from the file) and back into the run's adapter, the same function each time."""
    model = load(name)
    params = add_moved_lora(model, **kind)
    assert params and all(p.requires_grad for p in params)
    z, sigma, cond = noise(model, 2), torch.tensor([0.8, 0.3]), model.conditioning(PROMPTS)
    trained, base = adapter_and_base_velocity(model, z, sigma, cond)
    assert not torch.allclose(trained, base, atol=1e-3)
    path = model.save_lora(tmp_path)
    assert path.is_file()

    fresh = build_tiny_pipeline(name)
    fresh.load_lora_weights(str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(type(model)(fresh, model.config).velocity(z, sigma, cond), trained,
                                   atol=1e-5, rtol=1e-5)

    resumed = load(name)
    resumed.add_lora(LoraConfig(rank=4, alpha=8.0, **kind))
    resumed.load_lora(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(resumed.velocity(z, sigma, cond), trained, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("saved", "into", "message"), [
    ({"use_dora": True}, {}, "is a DoRA: set lora.use_dora: true to match it"),
    ({}, {"use_dora": True}, "is a plain LoRA (no DoRA magnitudes): set lora.use_dora: false to match it"),
    ({}, {"alpha": 16.0}, "was trained with lora.alpha 8.0, this adapter has 16.0: set lora.alpha: 8.0 to match it"),
    ({"use_rslora": True}, {}, "was trained with lora.use_rslora true, this adapter has false: set lora.use_rslora: "
                               "true to match it"),
], ids=["dora-into-lora", "lora-into-dora", "alpha", "rslora"])
def test_a_lora_of_another_kind_is_refused_in_one_line(saved, into, message, tmp_path):
    """Loaded into an adapter of another kind (``lora.init_lora``, a resumed run), a LoRA's weights would compute
    another function than the one they were trained as: a DoRA's magnitudes, another alpha or another scale rule."""
    model = load("tiny-sd3")
    add_moved_lora(model, **saved)
    model.save_lora(tmp_path)
    other = load("tiny-sd3")
    other.add_lora(LoraConfig(**{"rank": 4, "alpha": 8.0, **into}))
    with pytest.raises(UserError) as refused:
        other.load_lora(tmp_path)
    assert str(refused.value) == f"the LoRA in {tmp_path / 'pytorch_lora_weights.safetensors'} {message}"
