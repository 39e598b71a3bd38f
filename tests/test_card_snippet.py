"""The model card's "Use it" snippet, run as written (on the CPU, in float32), samples what the run's sampler samples.

For the embedded model, each text-to-image and text-to-video family, FLUX.1 Kontext's editing and Wan 2.1's
image-to-video: an adapter of a tiny model saved as a folder (the run's base model), trained with CFG, a negative
prompt, a text window and (where the family allows it) a schedule shift, gets a card; its snippet is executed with
the adapter's folder in place of the Hub repo and the row's input image as ``input.png``, the pipeline's own
starting noise replaced by the sampler's. The snippet's image (or video) equals the Euler ODE's of the adapter at
the run's eval steps: the pipelines' defaults (CFG 3.5 to 7, 256 to 512 text tokens, 28 to 50 steps, Wan's UniPC
solver, Kontext's 1024² output) would not."""

from __future__ import annotations

import re
from dataclasses import replace

import diffusers
import diffusers.utils
import pytest
import torch

from conftest import ROOT, add_moved_lora, euler_ode, noise, pipeline_latents
from test_editing import EDIT_SET
from jagg_core.adapters import choose_adapter
from jagg_core.config import RunConfig
from jagg_core.prompts import load_prompts
from jagg_core.model_card import RunSnapshot, build_model_card
from jagg_core.model_index import embedded_models
from jagg_core.models import build_tiny_pipeline, load_flow_model
from jagg_core.rundir import ImageSet

PROMPT = "a red circle on a blue square"
REPO = "alice/card-lora"
EVAL_STEPS, FRAMES = 3, 5
#: tiny model -> the run's model settings the snippet must carry into the pipeline call
RUNS = {
    "jagg-shapes": {},  # the embedded model: an SD3 without T5
    "tiny-sd3": {"guidance_scale": 3.0, "negative_prompt": "ugly", "flow_shift": 2.0},
    "tiny-flux": {"guidance_scale": 3.0, "negative_prompt": "ugly", "flux_guidance": 2.5},
    "tiny-qwen": {"guidance_scale": 1.0},  # the pipeline's default is true CFG at 4
    "tiny-flux2": {"guidance_scale": 3.0, "negative_prompt": "ugly"},  # the negative prompt as embeddings
    "tiny-flux2-dev": {"flux_guidance": 2.5},
    "tiny-zimage": {"guidance_scale": 3.0, "negative_prompt": "ugly"},  # the pipeline's scale is g - 1
    "tiny-wan": {"guidance_scale": 5.0, "negative_prompt": "ugly"},  # Euler steps in place of UniPC
    "tiny-flux-kontext": {"guidance_scale": 3.0, "negative_prompt": "ugly", "flux_guidance": 2.5,
                          "condition_resolution": 32},  # an edit, at the size it was trained at
    "tiny-wan-i2v": {"guidance_scale": 5.0, "negative_prompt": "ugly", "condition_resolution": 32},  # its first frame
    "tiny-wan-a14b": {"expert": "both", "guidance_scale": 4.0, "guidance_scale_2": 2.0, "negative_prompt": "ugly",
                      "flow_shift": 4.0},
}


def snippet(card: str) -> str:
    """The card's Python block."""
    return re.search(r"```python\n(.*?)```", card, re.S)[1]


@pytest.mark.parametrize("name", RUNS)
def test_the_cards_snippet_samples_as_the_run_did(name, tmp_path, monkeypatch):
    video, editing = name.startswith("tiny-wan"), name in ("tiny-flux-kontext", "tiny-wan-i2v")
    prompt = load_prompts(EDIT_SET)[0] if editing else PROMPT
    if name in embedded_models():  # the snippet names its folder in a clone of the repository
        monkeypatch.chdir(ROOT)
        base = name
    else:  # a tiny model saved as a folder is the run's base model
        base = str(tmp_path / "base")
        build_tiny_pipeline(name).save_pretrained(base)
    config = RunConfig(model={"name": base, "max_sequence_length": 16, **RUNS[name]},
                       sampling={"resolution": 32, "num_steps": 6, "eval_num_steps": EVAL_STEPS,
                                 "num_frames": FRAMES if video else 1},
                       rewards=[{"name": "jpeg_compressibility"}])
    model = load_flow_model(config.model, num_frames=config.sampling.num_frames)
    add_moved_lora(model)
    run = tmp_path / "run"
    model.save_lora(run / "lora")
    samples = ImageSet(tmp_path, 1, [], [prompt], videos=[tmp_path / "000.mp4"] if video else [])
    expert = config.model.expert if len(model.denoisers) > 1 else None  # as the trainer records it
    snap = RunSnapshot(config.model_dump(mode="json"), {"family": model.family, "expert": expert},
                       [], choose_adapter(run, None), 1, None, samples, None, {})
    code = snippet(str(build_model_card(snap, REPO)))
    unsampled = snippet(str(build_model_card(replace(snap, after=None), REPO)))  # pushed before its first eval
    assert (".frames[0]" in unsampled) == (".frames[0]" in code) == video

    size = config.sampling.size
    z0 = noise(model, 1, seed=7, size=size)
    _, expected = euler_ode(model, z0, model.sigmas(EVAL_STEPS, size), model.conditioning([prompt]))
    pipeline_class = type(model.pipe)
    call = pipeline_class.__call__
    made = {}

    def sampled_from_the_same_noise(self, *args, **kwargs):
        made["pipe"], made["output"] = self, call(self, *args, latents=pipeline_latents(model, z0), output_type="pt",
                                                  **kwargs)
        return made["output"]

    monkeypatch.setattr(pipeline_class, "__call__", sampled_from_the_same_noise)
    monkeypatch.setattr(diffusers.utils, "export_to_video", lambda frames, path, fps: made.update(fps=fps))
    if editing:
        monkeypatch.setattr(diffusers.utils, "load_image", lambda path: prompt.image(config.model.condition_size))
    code = code.replace('"cuda"', '"cpu"').replace("torch.bfloat16", "torch.float32").replace(
        f'"{REPO}"', repr(str(run / "lora")))
    exec(compile(code, "snippet", "exec"), {})

    output = made["output"].frames if video else made["output"].images
    torch.testing.assert_close(output.float(), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(made["pipe"].scheduler.sigmas, model.sigmas(EVAL_STEPS, size), atol=1e-6, rtol=0)
    assert made.get("fps") == (config.sampling.fps if video else None)


def test_a_hub_base_model_is_loaded_at_the_runs_revision(tmp_path, offline):
    """A Hub id's snippet names it (no folder to read) at ``model.revision``, the adapter's base weights."""
    config = RunConfig(model={"name": "stabilityai/stable-diffusion-3.5-medium", "revision": "a1b2c3d"},
                       rewards=[{"name": "jpeg_compressibility"}])
    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "pytorch_lora_weights.safetensors").write_bytes(b"weights")
    snap = RunSnapshot(config.model_dump(mode="json"), {"family": "sd3"}, [], choose_adapter(tmp_path, None), 1,
                       None, None, None, {})
    assert re.search(r'pipe = DiffusionPipeline.from_pretrained\("stabilityai/stable-diffusion-3.5-medium",\s+'
                     r'revision="a1b2c3d", torch_dtype', snippet(str(build_model_card(snap, REPO))))
