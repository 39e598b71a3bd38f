"""The shipped real-architecture configs (jagg_core/archs) and the random-weight models built from them:
real sizes on the meta device, loadable by diffusers and transformers as a Hub folder would be, real-width
conditioning and velocities through FlowModel, and the real-architecture bench on the command line."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
import transformers

import diffusers
from jagg_core.archs import (arch_folder, arch_for_model, arch_names, hub_id, parse_random_model, transformer_config,
                             transformer_depth, with_depth)
from jagg_core.bench import ROW_KEYS, arch_model, arch_options, arch_overrides
from jagg_core.bench import main as bench_main
from jagg_core.config import ModelConfig
from jagg_core.errors import UserError
from jagg_core.image_size import ImageSize
from jagg_core.models import load_flow_model
from jagg_core.models.random_weights import build_random_pipeline

from conftest import ROOT
from zygote import run_python

#: billions of parameters of each shipped component (the published sizes)
SIZES = {
    "sd35-medium": {"transformer": (2.2, 2.5)},
    "sd35-large": {"transformer": (8.0, 8.2)},
    "flux-dev": {"transformer": (11.8, 12.0)},
    "flux-schnell": {"transformer": (11.8, 12.0)},
    "qwen-image": {"transformer": (20.3, 20.5), "text_encoder": (8.2, 8.4), "vae": (0.12, 0.13)},
}
for _arch in ("sd35-medium", "sd35-large"):
    SIZES[_arch].update({"text_encoder": (0.12, 0.125), "text_encoder_2": (0.69, 0.70),
                         "text_encoder_3": (4.7, 4.8), "vae": (0.08, 0.09)})
for _arch in ("flux-dev", "flux-schnell"):
    SIZES[_arch].update({"text_encoder": (0.12, 0.125), "text_encoder_2": (4.7, 4.8), "vae": (0.08, 0.09)})
SIZES["flux-kontext"], SIZES["qwen-image-edit"] = dict(SIZES["flux-dev"]), dict(SIZES["qwen-image"])  # same models
SIZES["qwen-image-edit-2509"] = SIZES["qwen-image-edit-2511"] = SIZES["qwen-image-2512"] = dict(SIZES["qwen-image"])
SIZES["flux2-klein-4b"] = {"transformer": (3.8, 4.0), "text_encoder": (4.0, 4.05), "vae": (0.08, 0.09)}
SIZES["flux2-dev"] = {"transformer": (32.0, 32.4), "text_encoder": (23.9, 24.1), "vae": (0.08, 0.09)}  # Mistral 24B
SIZES["z-image-turbo"] = {"transformer": (6.1, 6.2), "text_encoder": (4.0, 4.05), "vae": (0.08, 0.09)}
SIZES["wan21-t2v-1.3b"] = {"transformer": (1.40, 1.45), "text_encoder": (5.6, 5.8), "vae": (0.12, 0.13)}
SIZES["wan21-t2v-14b"] = {"transformer": (14.2, 14.35), "text_encoder": (5.6, 5.8), "vae": (0.12, 0.13)}
SIZES["wan22-ti2v-5b"] = {"transformer": (4.95, 5.05), "text_encoder": (5.6, 5.8), "vae": (0.70, 0.71)}
SIZES["wan21-i2v-14b-480p"] = {"transformer": (16.35, 16.45), "text_encoder": (5.6, 5.8), "vae": (0.12, 0.13),
                               "image_encoder": (0.63, 0.635)}  # the 14B's blocks with image cross-attention; ViT-H
for _arch in ("wan22-t2v-a14b", "wan22-i2v-a14b"):  # two experts of the 14B's blocks; I2V's without image attention
    SIZES[_arch] = {"transformer": (14.2, 14.35), "transformer_2": (14.2, 14.35), "text_encoder": (5.6, 5.8),
                    "vae": (0.12, 0.13)}
PIPELINES = {"sd35-medium": "StableDiffusion3Pipeline", "sd35-large": "StableDiffusion3Pipeline",
             "flux-dev": "FluxPipeline", "flux-schnell": "FluxPipeline", "qwen-image": "QwenImagePipeline",
             "qwen-image-2512": "QwenImagePipeline",
             "flux2-klein-4b": "Flux2KleinPipeline", "flux2-dev": "Flux2Pipeline", "z-image-turbo": "ZImagePipeline",
             "flux-kontext": "FluxKontextPipeline", "qwen-image-edit": "QwenImageEditPipeline",
             "qwen-image-edit-2509": "QwenImageEditPlusPipeline", "qwen-image-edit-2511": "QwenImageEditPlusPipeline",
             "wan21-t2v-1.3b": "WanPipeline", "wan21-t2v-14b": "WanPipeline",
             "wan22-ti2v-5b": "WanPipeline", "wan21-i2v-14b-480p": "WanImageToVideoPipeline",
             "wan22-t2v-a14b": "WanPipeline", "wan22-i2v-a14b": "WanImageToVideoPipeline"}
#: components of a pipeline besides its models, scheduler and tokenizers (their files are not shipped)
OTHER_COMPONENTS = {arch: {"processor"} for arch in ("qwen-image-edit", "qwen-image-edit-2509", "qwen-image-edit-2511")}
OTHER_COMPONENTS["wan21-i2v-14b-480p"] = {"image_processor"}  # its file ships: the random-weight model's processor


def model_index(arch: str) -> dict:
    return json.loads((arch_folder(arch) / "model_index.json").read_text())


def test_every_arch_ships_its_pipeline_folder():
    assert sorted(arch_names()) == sorted(SIZES)  # in the order of the family files
    for arch in arch_names():
        index = model_index(arch)
        assert index["_class_name"] == PIPELINES[arch] and index["_diffusers_version"]
        components = {name for name, spec in index.items()
                      if not name.startswith("_") and isinstance(spec, list) and spec != [None, None]}  # null: none
        assert components == set(SIZES[arch]) | {"scheduler"} | {n.replace("text_encoder", "tokenizer")
                                                                 for n in SIZES[arch] if n.startswith("text_encoder")} \
            | OTHER_COMPONENTS.get(arch, set())
        config_files = {name: arch_folder(arch) / name / "config.json" for name in SIZES[arch]}
        assert all(path.is_file() and path.stat().st_size < 8192 for path in config_files.values()), config_files
        assert (arch_folder(arch) / "scheduler" / "scheduler_config.json").is_file()


@pytest.mark.parametrize("arch,component", [(a, c) for a in SIZES for c in SIZES[a]])
def test_each_config_loads_with_the_real_classes_at_the_published_size(arch, component):
    """diffusers ``load_config`` + ``from_config`` / transformers ``AutoConfig.from_pretrained`` on the folder, the
    model instantiated on the meta device."""
    library, class_name = model_index(arch)[component]
    folder = arch_folder(arch) / component
    if library == "diffusers":
        model_class = getattr(diffusers, class_name)
        with torch.device("meta"):
            model = model_class.from_config(model_class.load_config(folder))
    else:
        config = transformers.AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            model = getattr(transformers, class_name)(config)
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    low, high = SIZES[arch][component]
    assert low <= billions <= high, (arch, component, billions)


#: FLUX.2 [dev]'s tokenizer is a PixtralProcessor, which needs torchvision (not installed here; the pre-flight asks a
#: user for it); its model_index.json is checked by test_every_arch_ships_its_pipeline_folder
READ_HERE = [arch for arch in SIZES if arch != "flux2-dev"]


@pytest.mark.parametrize("arch", READ_HERE)
def test_diffusers_reads_the_folder_as_a_pipeline(arch):
    """``DiffusionPipeline.from_pretrained`` on the folder picks the pipeline class of model_index.json, takes every
    component given, and loads the real scheduler config. (For the Wan pipelines, whose ``transformer`` and image
    encoder arguments are optional, DiffusionPipeline.from_pretrained would reload the passed ones from the folder:
    their own class takes them.)"""
    pipe = build_random_pipeline(arch, device="meta")
    given = {name: module for name, module in pipe.components.items() if name != "scheduler"}
    loader = getattr(diffusers, PIPELINES[arch]) if PIPELINES[arch].startswith("Wan") else diffusers.DiffusionPipeline
    loaded = loader.from_pretrained(arch_folder(arch), **given)
    assert type(loaded).__name__ == PIPELINES[arch]
    scheduler = json.loads((arch_folder(arch) / "scheduler" / "scheduler_config.json").read_text())
    shift = "flow_shift" if "flow_shift" in scheduler else "shift"  # Wan's UniPC scheduler: flow_shift
    assert loaded.scheduler.config[shift] == scheduler[shift]
    assert loaded.scheduler.config.get("use_dynamic_shifting", False) == scheduler.get("use_dynamic_shifting", False)
    assert transformer_depth(loaded.transformer.config) == transformer_depth(transformer_config(arch))


def test_model_names_map_to_archs():
    assert arch_for_model("stabilityai/stable-diffusion-3.5-medium") == "sd35-medium"
    assert arch_for_model("black-forest-labs/flux.1-dev") == "flux-dev"
    assert arch_for_model("random:qwen-image@4") == "qwen-image" == arch_for_model("random:qwen-image")
    assert arch_for_model("jagg-shapes") is None and arch_for_model("random:nope") is None
    assert all(arch_for_model(hub_id(arch)) == arch for arch in arch_names())
    assert parse_random_model("random:flux-dev@3") == ("flux-dev", 3)
    assert parse_random_model("random:sd35-large") == ("sd35-large", None)
    for wrong in ("random:nope", "random:flux-dev@0", "random:flux-dev@58", "random:flux-dev@x"):
        with pytest.raises(UserError):
            parse_random_model(wrong)
    with pytest.raises(UserError, match="unknown arch"):
        arch_folder("sd3")


def test_the_model_name_reference_lists_every_arch():
    description = ModelConfig.model_fields["name"].description
    assert "random:ARCH[@LAYERS]" in description
    assert f"(ARCH: {', '.join(arch_names())})" in description


def test_depth_cuts_keep_the_real_proportions():
    flux = transformer_config("flux-dev")
    assert [(c["num_layers"], c["num_single_layers"]) for c in (with_depth(flux, n) for n in (1, 2, 3, 30, 57))] == [
        (1, 1), (1, 1), (1, 2), (10, 20), (19, 38)]
    medium = transformer_config("sd35-medium")
    assert with_depth(medium, 2)["dual_attention_layers"] == [0]  # 13 of 24 blocks have dual attention
    assert with_depth(medium, 12)["dual_attention_layers"] == list(range(6))
    assert with_depth(medium, 24) == medium
    assert "dual_attention_layers" not in with_depth(transformer_config("sd35-large"), 2)


#: (arch, conditioning widths, transformer depth keys at 2 layers)
RANDOM_MODELS = [
    ("sd35-medium", {"prompt_embeds": 4096, "pooled_projections": 2048}, {"num_layers": 2}),
    ("flux-dev", {"prompt_embeds": 4096, "pooled_projections": 768}, {"num_layers": 1, "num_single_layers": 1}),
    ("qwen-image", {"prompt_embeds": 3584}, {"num_layers": 2}),
]


@pytest.mark.parametrize("arch,widths,depth", RANDOM_MODELS, ids=[m[0] for m in RANDOM_MODELS])
def test_random_weight_models_condition_and_predict_at_the_real_widths(arch, widths, depth):
    model = load_flow_model(ModelConfig(name=f"random:{arch}@2", max_sequence_length=16), "cpu")
    assert type(model.pipe).__name__ == PIPELINES[arch]
    assert {key: model.transformer.config[key] for key in depth} == depth
    real = transformer_config(arch)
    for key in ("num_attention_heads", "attention_head_dim", "joint_attention_dim", "in_channels"):
        assert model.transformer.config[key] == real[key]
    cond = model.conditioning(["a red circle", "two cats on a sofa"])
    assert {key: cond[key].shape[-1] for key in widths} == widths
    assert cond["prompt_embeds"].shape[0] == 2 and cond["prompt_embeds"].shape[-1] == real["joint_attention_dim"]
    if hasattr(model, "release_text_encoders"):
        model.release_text_encoders()
    z = torch.randn(2, *model.latent_shape(ImageSize.square(64)), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        velocity = model.velocity(z, torch.tensor(0.7), cond)
    assert velocity.shape == z.shape and torch.isfinite(velocity).all() and velocity.std() > 0


def test_random_weights_come_from_the_seed_alone():
    """The bench's memory subprocess rebuilds the same model: the weights depend on the seed, not on the global RNG."""
    first = build_random_pipeline("qwen-image", layers=1, seed=3)
    torch.rand(10)
    second = build_random_pipeline("qwen-image", layers=1, seed=3)
    for name in ("transformer", "vae", "text_encoder"):
        a, b = getattr(first, name).state_dict(), getattr(second, name).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a), name
    assert first.transformer.state_dict()["img_in.weight"].std() > 0


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return run_python(["-m", "jagg_core.bench", *args], cwd=ROOT, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_the_bench_runs_a_random_weight_arch(tmp_path):
    out, prompts = tmp_path / "out.json", tmp_path / "prompts.txt"
    prompts.write_text("a red circle\na blue square\na cat\na dog\n")
    # --quick (W = 2, 5 cached), a small rollout batch and four prompts (each is encoded at set-up) keep it short;
    # the arch and its widths are the real ones
    result = run_bench("--arch", "sd35-medium", "--random-weights", "--layers", "2", "--resolution", "64",
                       "--json", str(out), "--repeats", "1", "--iterations", "0", "--no-memory", "--quick",
                       "--set", "grpo.num_generations=2", "--set", "grpo.prompts_per_iteration=1",
                       "--set", "sampling.num_steps=5", "--set", "model.max_sequence_length=8",
                       "--set", f"prompts.source={prompts}", "--set", "prompts.eval_count=2")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["mode"], r["window"], r["joint"]) for r in rows] == [("exact", 1, False)] + [
        ("cached", window, joint) for window in (2, 5) for joint in (True, False)]
    for row in rows:
        assert set(ROW_KEYS) <= set(row), set(ROW_KEYS) - set(row)
        assert row["model"] == "random:sd35-medium@2" and row["section"] == "train_phase"
        assert row["rollout_s"] > 0 and row["train_s"] == row["seconds"] > 0
        assert row["iteration_s"] == pytest.approx(row["rollout_s"] + row["train_s"])
        assert row["peak_mem_ratio"] is None  # --no-memory: the memory subprocess is test_bench's
    exact = next(r for r in rows if r["mode"] == "exact")
    cached = next(r for r in rows if (r["mode"], r["window"], r["joint"]) == ("cached", 5, False))
    assert exact["passes"] == 5 and cached["passes"] == 2 and exact["params_m"] > 150
    assert "Whole iterations" in result.stdout


def test_the_arch_bench_compares_exact_with_jagg_at_windows_2_4_5():
    options = arch_options(arch_model("flux-dev", True, 4), arch_overrides("cpu", 128))
    assert options.models == ["random:flux-dev@4"] and options.overrides == ("sampling.resolution=128",)
    assert {(v.mode, v.window, v.joint) for v in options.grid(0)} == {("exact", 1, False)} | {
        (mode, window, joint) for mode in ("forward", "cached") for window in (2, 4, 5) for joint in (True, False)}
    assert arch_overrides("cuda", quantize="nf4") == ["sampling.resolution=512", "model.dtype=bfloat16",
                                                      "train.mixed_precision=bf16", "model.quantize=nf4"]
    assert arch_model("qwen-image", random_weights=False) == "Qwen/Qwen-Image"


@pytest.mark.parametrize("args,message", [
    (["--random-weights"], "--random-weights needs --arch"),
    (["--arch", "sd4", "--random-weights"], "unknown arch 'sd4'"),
    (["--arch", "flux-dev", "--layers", "2"], "--layers needs --random-weights"),
    (["--resolution", "128"], "--resolution: only with --arch"),
    (["--training", "--setups", "exact,fast"],
     "--setups exact,fast: choose from flow_grpo, exact, default, tree, flat, cps, guard, reuse, dppo, per_reward, "
     "dora, nft, awm, or join GRPO setups with + (guard+flat)"),
    (["--training", "--setups", "default,guard+nft"], "--setups default,guard+nft: choose from"),
])
def test_bench_arch_mistakes_are_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit:
        bench_main(args)
    assert exit.value.code == 2 and message in capsys.readouterr().err
