"""The FLUX.2 [klein], FLUX.2 [dev] and Z-Image adapters against their own diffusers pipelines, on tiny models built
in memory.

As in test_model_families: an Euler ODE with the adapter's sigmas and velocity, from the same initial noise, must
give the pipeline's own ``__call__`` latents and images (packing, position ids, timestep convention, the sign of
Z-Image's prediction, the dynamic shift, CFG and its scale convention, the VAE's statistics). Then the LoRA: saved
in diffusers format, it loads back with the pipeline's ``load_lora_weights`` and changes the pipeline's images as it
changes the adapter's; then two training iterations, the memory plan, the real architectures.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from peft import get_peft_model_state_dict

from conftest import (adapter_and_base_velocity, add_moved_lora, euler_ode, loop_latents, noise, pipeline_kwargs,
                      pipeline_latents, pipeline_with_final_latents, run_cli, tiny_config)
from jagg_core import metrics
from jagg_core.archs import transformer_config, transformer_depth
from jagg_core.config import LoraConfig, ModelConfig
from jagg_core.errors import UserError
from jagg_core.image_size import ImageSize
from jagg_core.memory_meter import measured_peak
from jagg_core.memory_plan import plan_memory
from jagg_core.models import FAMILIES, build_tiny_pipeline, load_flow_model
from jagg_core.models.flux2 import Flux2KleinModel
from jagg_core.rundir import RunDirectory
from jagg_core.trainer import Trainer

FAMILY = {"tiny-flux2": "flux2", "tiny-flux2-dev": "flux2-dev", "tiny-zimage": "z-image"}
NAMES = list(FAMILY)
RES, STEPS = 32, 3
SIZE = ImageSize.square(RES)
PORTRAIT = ImageSize(height=64, width=32)
PROMPTS = ["a red circle", "two blue squares on a green background"]


#: text tokens: FLUX.2 [dev]'s system message takes 36 of them before the prompt's
TEXT = {"tiny-flux2-dev": 96}


def load(name: str, **overrides):
    return load_flow_model(ModelConfig(**{"name": name, "max_sequence_length": TEXT.get(name, 32), **overrides}))


class StopAfterOneStep(Exception):
    pass


def stop(*_args):
    raise StopAfterOneStep


def run_pipeline(model, pipe, z0: torch.Tensor, prompts: list[str],
                 size: ImageSize = SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """The pipeline's own sampling loop from ``z0``: its final latents (as its loop holds them) and images."""
    output, latents = pipeline_with_final_latents(pipe, prompt=list(prompts), num_inference_steps=STEPS,
                                                  latents=pipeline_latents(model, z0), output_type="pt",
                                                  **pipeline_kwargs(model, size, len(prompts)))
    return latents, output.images.float()


# ----- loading ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_tiny_models_load_with_their_registered_family(name):
    """(A local folder saved from each loads too: test_model_families.test_local_folder_loads_and_family_is_detected)"""
    model = load(name)
    assert model.family == FAMILY[name] and FAMILIES[type(model.pipe).__name__] is type(model)
    assert sum(p.numel() for p in model.transformer.parameters()) < 1_000_000
    embeds = model.conditioning(PROMPTS)["prompt_embeds"]
    assert not torch.equal(embeds[0], embeds[1]), "the prompts are read, not cut off"


# ----- the sampler's view against the pipeline's ----------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("num_steps", "size"), [(4, SIZE), (10, ImageSize.square(128)), (10, ImageSize(64, 128))])
def test_sigmas_are_the_pipelines_schedule(name, num_steps, size):
    model = load(name)
    sigmas = model.sigmas(num_steps, size)
    assert sigmas.shape == (num_steps + 1,) and sigmas[-1] == 0 and bool((sigmas[1:] < sigmas[:-1]).all())
    kwargs = pipeline_kwargs(model, size)
    with pytest.raises(StopAfterOneStep):  # the schedule is set: one transformer call is enough
        model.pipe(prompt=PROMPTS[:1], num_inference_steps=num_steps, callback_on_step_end=stop, **kwargs)
    torch.testing.assert_close(sigmas, model.pipe.scheduler.sigmas, atol=1e-6, rtol=0)


@pytest.mark.parametrize(("name", "guidance_scale", "size"),
                         [(name, scale, size) for name in NAMES for scale in (1.0, 3.0) for size in (SIZE, PORTRAIT)
                          if not (name == "tiny-flux2-dev" and scale > 1)  # no CFG
                          and not (size == PORTRAIT and scale == 1.0 and name != "tiny-flux2-dev")])
def test_euler_ode_reproduces_pipeline(name, guidance_scale, size):
    """The Euler ODE equals the pipeline's sampling loop, at a square size and a portrait one (height 64, width
    32)."""
    model = load(name, guidance_scale=guidance_scale, negative_prompt="ugly", flux_guidance=2.5)
    z0 = noise(model, len(PROMPTS), seed=1, size=size)
    z, images = euler_ode(model, z0, model.sigmas(STEPS, size), model.conditioning(PROMPTS))
    latents, pipeline_images = run_pipeline(model, model.pipe, z0, PROMPTS, size)
    torch.testing.assert_close(model.pipe.scheduler.sigmas, model.sigmas(STEPS, size), atol=1e-6, rtol=0)
    torch.testing.assert_close(loop_latents(model, z), latents, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(images, pipeline_images, atol=1e-4, rtol=1e-4)
    assert images.shape == (len(PROMPTS), 3, *size) and images.std() > 0


@pytest.mark.parametrize(("references", "size"), [(1, SIZE), (2, PORTRAIT)])
@pytest.mark.parametrize("name", ["tiny-flux2", "tiny-flux2-dev"])
def test_reference_images_edit_as_the_pipeline_does(name, references, size):
    """With ``model.input_images`` a FLUX.2 run edits: the Euler ODE on two rows at once equals the pipeline's
    ``__call__(image=[...])`` on each row from the same noise and reference images (64 px: the pipelines refuse
    less), with one reference image or two (their ids' time coordinates 10 and 20), the output square or not."""
    from jagg_core.edit_prompts import EditPrompt
    from jagg_core.prompts import load_prompts
    first, second = load_prompts("edits")[:2]
    rows = [EditPrompt(row.instruction, (row.images_bytes[0], other.images_bytes[0])[:references], row.label)
            for row, other in ((first, second), (second, first))]
    model = load(name, input_images=references, condition_resolution=64, flux_guidance=2.5)
    assert type(model).__name__.endswith("EditModel") and type(load(name)).__name__.endswith("Model")
    z0 = noise(model, len(rows), seed=1, size=size)
    z, images = euler_ode(model, z0, model.sigmas(STEPS, size), model.conditioning(rows))
    for i, row in enumerate(rows):
        output, latents = pipeline_with_final_latents(
            model.pipe, image=row.images(ImageSize.square(64)), prompt=row.instruction, num_inference_steps=STEPS,
            latents=pipeline_latents(model, z0[i:i + 1]), output_type="pt", **pipeline_kwargs(model, size))
        torch.testing.assert_close(loop_latents(model, z[i:i + 1]), latents, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(images[i:i + 1], output.images.float(), atol=1e-4, rtol=1e-4)


def test_a_guidance_distilled_flux2_dev_takes_no_cfg_but_its_guidance():
    pipe = build_tiny_pipeline("tiny-flux2-dev")
    with pytest.raises(UserError, match="guidance-distilled: it takes no CFG; set model.guidance_scale=1"):
        load_flow_model(ModelConfig(name="tiny-flux2-dev", guidance_scale=3.0))
    model = type(load("tiny-flux2-dev"))(pipe, ModelConfig(name="tiny-flux2-dev", flux_guidance=2.5))
    assert model.use_cfg is False and model.guidance(torch.zeros(3, 1, 1)).tolist() == [2.5] * 3


def test_a_distilled_klein_takes_no_cfg():
    pipe = build_tiny_pipeline("tiny-flux2")
    pipe.register_to_config(is_distilled=True)
    with pytest.raises(UserError, match="step-distilled"):
        Flux2KleinModel(pipe, ModelConfig(name="tiny-flux2", guidance_scale=3.0))
    assert Flux2KleinModel(pipe, ModelConfig(name="tiny-flux2")).use_cfg is False


def test_z_image_padding_of_the_caption_changes_nothing():
    """The cache pads every caption to max_sequence_length; the transformer sees the unpadded captions."""
    short, long = load("tiny-zimage", max_sequence_length=24), load("tiny-zimage", max_sequence_length=64)
    z, sigma = noise(short, 1), torch.tensor([0.6])
    cond_short, cond_long = short.conditioning(PROMPTS[:1]), long.conditioning(PROMPTS[:1])
    assert cond_short["prompt_embeds"].shape[1] == 24 and cond_long["prompt_embeds"].shape[1] == 64
    assert int(cond_short["prompt_embeds_mask"].sum()) == int(cond_long["prompt_embeds_mask"].sum()) < 24
    with torch.no_grad():
        torch.testing.assert_close(short.velocity(z, sigma, cond_short), long.velocity(z, sigma, cond_long),
                                   atol=1e-5, rtol=1e-5)


# ----- LoRA ---------------------------------------------------------------------------------------
def test_flux2_lora_targets_are_the_training_scripts():
    model = load("tiny-flux2")
    model.add_lora(LoraConfig(rank=2, alpha=2.0))
    adapted = {name.split(".lora_A")[0] for name in get_peft_model_state_dict(model.transformer) if ".lora_A" in name}
    singles = model.transformer.config.num_single_layers
    assert {f"single_transformer_blocks.{i}.attn.{part}" for i in range(singles)
            for part in ("to_out", "to_qkv_mlp_proj")} <= adapted
    assert {f"transformer_blocks.0.attn.{p}" for p in ("to_q", "to_k", "to_v", "to_out.0")} <= adapted


@pytest.mark.parametrize("name", NAMES)
def test_saved_lora_loads_back_with_load_lora_weights_and_changes_the_pipeline_as_the_adapter(name, tmp_path):
    model = load(name)
    add_moved_lora(model)
    z0, sigma, cond = noise(model, 2, seed=3), torch.tensor([0.8, 0.3]), model.conditioning(PROMPTS)
    adapted, base = adapter_and_base_velocity(model, z0, sigma, cond)
    assert not torch.allclose(adapted, base, atol=1e-3)
    _, trained = euler_ode(model, z0, model.sigmas(STEPS, SIZE), cond)
    model.save_lora(tmp_path)

    fresh = build_tiny_pipeline(name)
    fresh.load_lora_weights(str(tmp_path))
    _, images = run_pipeline(model, fresh, z0, PROMPTS)
    torch.testing.assert_close(images, trained, atol=1e-4, rtol=1e-4)


# ----- training and the memory plan --------------------------------------------------------------------
def few_prompts(folder) -> str:
    """A prompt file of six prompts: set-up encodes every prompt, and FLUX.2's encoder is 27 layers deep."""
    path = folder / "prompts.txt"
    path.write_text("".join(f"a {colour} {shape}\n" for colour in ("red", "blue") for shape in ("cat", "cup", "car")))
    return str(path)


@pytest.mark.parametrize("name", NAMES)
def test_two_iterations_train_and_the_adapter_reloads_in_diffusers(name, tmp_path, offline):
    trainer = Trainer(tiny_config(name, train__iterations=2, prompts__source=few_prompts(tmp_path)), tmp_path / "run")
    trainer.setup()
    trainer.fit()
    run = RunDirectory(tmp_path / "run")
    rows = run.read_metrics()
    assert [r["iteration"] for r in rows] == [0, 1, 2] and all(r[metrics.GRAD_NORM] > 0 for r in rows[1:])
    model = trainer.model
    prompts = list(model.cached_embeddings)[:2]
    z, sigma, cond = noise(model, 2, seed=5), torch.tensor([0.7, 0.3]), model.conditioning(prompts)
    trained, base = adapter_and_base_velocity(model, z, sigma, cond)
    assert not torch.allclose(base, trained)
    fresh = build_tiny_pipeline(name, seed=trainer.config.train.seed)
    fresh.load_lora_weights(str(run.lora_dir))
    model.pipe, original = fresh, model.pipe
    try:
        with torch.no_grad():
            torch.testing.assert_close(model.velocity(z, sigma, cond), trained, rtol=1e-4, atol=1e-5)
    finally:
        model.pipe = original


@pytest.mark.parametrize("name", NAMES)
def test_the_plan_is_within_25_percent_of_the_measured_peak(name, tmp_path, offline):
    config = tiny_config(name, sampling__resolution=64, grpo__num_generations=4, prompts__source=few_prompts(tmp_path))
    trainer = Trainer(config, tmp_path / "run")
    trainer.setup()
    measured, planned = measured_peak(trainer), plan_memory(config).total
    assert 0.75 <= planned / measured <= 1.25, f"planned {planned / 1e6:.2f} MB, measured {measured / 1e6:.2f} MB"


# ----- the presets and the real architectures ----------------------------------------------------------
PRESETS = {"flux2-klein-pickscore-24gb": "black-forest-labs/FLUX.2-klein-4B", "flux2-dev-pickscore": "black-forest-labs/FLUX.2-dev",
           "zimage-turbo-pickscore-24gb": "Tongyi-MAI/Z-Image-Turbo"}


def test_the_presets_are_listed_and_validate_offline():
    listed = run_cli("--list-presets")
    assert listed.returncode == 0 and all(f"{name} " in listed.stdout for name in PRESETS), listed.stderr
    for name, model in PRESETS.items():
        result = run_cli("--preset", name, "--dry-run")  # HF_HUB_OFFLINE: the shipped arch configs answer
        assert result.returncode == 0, result.stderr
        assert yaml.safe_load(result.stdout)["model"]["name"] == model



@pytest.mark.parametrize(("arch", "layers", "width"), [("flux2-klein-4b", 2, 7680), ("z-image-turbo", 1, 2560)])
def test_random_weight_models_condition_and_predict_at_the_real_widths(arch, layers, width):
    """bfloat16 and the fewest blocks: still a few hundred million weights (Z-Image keeps its four refiner blocks)."""
    model = load_flow_model(ModelConfig(name=f"random:{arch}@{layers}", max_sequence_length=16, dtype="bfloat16"))
    cond = model.conditioning(PROMPTS)
    assert cond["prompt_embeds"].shape[0] == 2 and cond["prompt_embeds"].shape[-1] == width
    real = transformer_config(arch)
    assert model.transformer.config["in_channels"] == real["in_channels"]
    assert transformer_depth(model.transformer.config) == layers
    model.release_text_encoders()
    z = torch.randn(2, *model.latent_shape(ImageSize.square(64)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        velocity = model.velocity(z, torch.tensor(0.7), cond)
    assert velocity.shape == z.shape and torch.isfinite(velocity).all() and velocity.std() > 0
