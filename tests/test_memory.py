"""Low-memory mechanics (text embeddings cached, chunked rollouts, quantized base) and the memory plan."""

from __future__ import annotations

import itertools
import json
import os
import re
from pathlib import Path

import pytest
import torch

from conftest import ROOT, run_cli, tiny_config
from zygote import run_python
from jagg_core.config import list_presets, load_config, preset_path
from jagg_core.errors import UserError
from jagg_core.host import available_memory
from jagg_core.gpu_check import CheckOptions, memory_recipe
from jagg_core import judges
from jagg_core.download import amount
from jagg_core.image_size import ImageSize
from jagg_core.judges import judges_device
from jagg_core.memory_meter import PeakMemory, measured_peak
from jagg_core import memory_plan
from jagg_core.memory_plan import CUDA_CONTEXT_GB, GB, check_fits, check_host, cheapest_fit, fits, plan_memory
from jagg_core.models import load_flow_model, text_embeddings
from jagg_core.models.text_embeddings import check_cache_room
from jagg_core.prompts import run_prompts
from jagg_core.rewards.catalog import reward_entry
from jagg_core.rundir import RunDirectory
from jagg_core.sampler import initial_noise, sde_rollout
from jagg_core import trainer as trainer_module
from jagg_core.trainer import Trainer

FAMILIES = ["tiny-sd3", "tiny-flux", "tiny-qwen"]


@pytest.mark.parametrize("model", FAMILIES)
def test_text_encoders_leave_after_setup_and_a_resume_reads_the_saved_embeddings(model, tmp_path, offline,
                                                                                  monkeypatch):
    config = tiny_config(model, train__iterations=1)
    first = Trainer(config, tmp_path)
    first.setup()
    assert first.model.text_encoders == [], "the encoders must be released after set-up"
    assert RunDirectory(tmp_path).text_embeddings_file.is_file()
    first.fit()
    expected = first.model.conditioning(first.eval_prompts)
    saved = RunDirectory(tmp_path).text_embeddings_file.stat().st_size
    monkeypatch.setattr(text_embeddings, "available_memory", lambda: saved - 1)  # resumed on a smaller host
    with pytest.raises(UserError, match=r"takes [\d.]+ MB of host memory; this machine has [\d.]+ MB of memory "
                                        r"available; set model\.cache_text_embeddings=false"):
        Trainer(config, tmp_path, resume=True).setup()
    monkeypatch.setattr(text_embeddings, "available_memory", available_memory)

    def no_encoding(self, prompts):
        raise AssertionError("a resume must not encode prompts")

    monkeypatch.setattr(type(first.model), "encode_prompts", no_encoding)
    resumed = Trainer(config, tmp_path, resume=True)
    resumed.setup()
    pipe = resumed.model.pipe
    assert all(getattr(pipe, name, None) is None for name in ("text_encoder", "text_encoder_2", "text_encoder_3"))
    again = resumed.model.conditioning(resumed.eval_prompts)
    assert again.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(again[key], expected[key], rtol=0, atol=0)


def test_the_judges_load_after_the_text_encoders_have_left_and_the_plan_never_holds_them_together(tmp_path, offline,
                                                                                                 monkeypatch):
    """The judges load after the base model: in a run the text encoders are gone when a judge first scores, and in
    the plan a judge adds to the set-up's moment after the encoders (the resident parts), not to their encoding."""
    trainer = Trainer(tiny_config(eval__judges=[{"name": "jpeg_incompressibility"}]), tmp_path)
    encoders_when_judging = []
    load_judges = trainer_module.load_judges

    def recording(*args):
        encoders_when_judging.append(trainer.model.text_encoders)
        load_judges(*args)

    monkeypatch.setattr(trainer_module, "load_judges", recording)
    trainer.setup()
    assert encoders_when_judging == [[]] and trainer.judges.names == ["jpeg_incompressibility"]
    alone, judged = plan_memory(tiny_config()), plan_memory(tiny_config(eval__judges=[{"name": "aesthetic"}]))
    judge = reward_entry("aesthetic").device_params_m * 1e6 * 4
    assert sum(judged.setup.values()) == sum(alone.setup.values()) > 0
    assert judged.setup_resident - alone.setup_resident == pytest.approx(judge)


@pytest.mark.parametrize("model, settings", [
    ("tiny-flux-kontext", {}), ("tiny-qwen-edit", {}), ("tiny-flux2", {"model__input_images": 1}),
    ("tiny-wan22", {"model__input_images": 1, "sampling__num_frames": 5, "sampling__resolution": 128}),
    ("tiny-wan-i2v", {"sampling__num_frames": 5, "sampling__resolution": 128}), ("tiny-flux", {})])
def test_at_set_up_the_vae_encodes_the_input_images_on_the_device_beside_the_text_encoders(model, settings,
                                                                                             monkeypatch, offline):
    """Under the text-embedding cache the transformer waits on the host until the text encoders leave; the VAE of a
    model whose prompt rows carry input images (editing, image-to-video) goes to the device with the encoders, so
    that each row's images are encoded there and not on the host's CPU. The plan's set-up holds its weights and the
    transient of encoding a batch of rows' images (here larger than the texts'), as traced on the real model; a
    text-to-image model's VAE waits with the transformer and its plan's set-up has none."""
    from diffusers import ModelMixin
    config = tiny_config(model, model__condition_resolution=128, **settings)
    plan = plan_memory(config)
    placed, place = [], ModelMixin.to

    def recording(module, *args, **kwargs):
        if args and isinstance(args[0], (str, torch.device)) or "device" in kwargs:
            placed.append(type(module).__name__)
        return place(module, *args, **kwargs)

    monkeypatch.setattr(ModelMixin, "to", recording)
    flow = load_flow_model(config.model, "cpu", num_frames=config.sampling.num_frames)
    vae, transformer = type(flow.pipe.vae).__name__, type(flow.transformer).__name__
    takes_images = model != "tiny-flux"
    assert placed == ([vae] if takes_images else [])
    vae_entry = [size for part, size in plan.setup.items() if part.startswith("VAE (encodes the input images")]
    if takes_images:
        encoding = memory_plan._input_images_encoding(flow, config)
        assert vae_entry == [sum(p.numel() * p.element_size() for p in flow.pipe.vae.parameters())]
        assert plan.setup["encoding 16 prompts at a time"] == encoding > memory_plan._text_encoder_activations(
            flow.text_encoders[0], max(config.model.max_sequence_length, 77), 4)
    else:
        assert vae_entry == []
    flow.release_text_encoders()
    assert placed[-1] == transformer and vae in placed


@pytest.mark.parametrize("model", ["tiny-sd3", "tiny-flux", "tiny-qwen"])
def test_offloaded_text_encoders_keep_their_weights_on_the_host_and_encode_the_same_embeddings(model, offline):
    """``model.offload_text_encoders``: accelerate's cpu_offload leaves no encoder weight placed (each module's come
    from the host as it runs), the prompts' embeddings are those of the placed encoders to the bit, and the plan's
    set-up holds the largest module's weights and the buffers instead of the encoders."""
    prompts = ["a red circle", "two blue squares on a green floor"]
    placed, offloaded = (load_flow_model(tiny_config(model, model__offload_text_encoders=on).model) for on in (False, True))
    assert {p.device.type for e in offloaded.text_encoders for p in e.parameters()} == {"meta"}
    with torch.no_grad():
        expected, got = placed.encode_prompts(prompts), offloaded.encode_prompts(prompts)
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    encoders = placed.text_encoders
    largest = max(sum(p.numel() for p in module.parameters(recurse=False)) for e in encoders for module in e.modules())
    buffers = sum(b.numel() for e in encoders for b in e.buffers())
    setup = plan_memory(tiny_config(model, model__offload_text_encoders=True)).setup
    assert [size for part, size in setup.items() if part.startswith("text encoders")] == [(largest + buffers) * 4]
    assert largest + buffers < sum(p.numel() for e in encoders for p in e.parameters()) / 2
    offloaded.release_text_encoders()
    assert offloaded.text_encoders == []


@pytest.mark.parametrize("model, guidance", [("tiny-sd3", 1.0), ("tiny-flux", 4.0), ("tiny-qwen", 1.0)])
def test_the_plan_counts_the_text_embedding_cache_a_run_keeps_on_the_host(model, guidance, tmp_path, offline,
                                                                           monkeypatch):
    """Every distinct training and eval prompt's conditioning (the negative prompt's too with CFG), held in host
    memory and written to the run folder, is the plan's host cache to the byte, Qwen-Image's token masks aside; the
    run's status counts the prompts encoded."""
    config = tiny_config(model, model__guidance_scale=guidance)
    trainer = Trainer(config, tmp_path)
    said, write_status = [], RunDirectory.write_status

    def recording(run, state, **fields):
        said.append(fields.get("message"))
        write_status(run, state, **fields)

    monkeypatch.setattr(RunDirectory, "write_status", recording)
    trainer.setup()
    cached = trainer.model.cached_embeddings
    encoding = [message for message in said if message and message.startswith("encoding ")]
    assert encoding[0] == f"encoding {len(cached)} prompts for the text-embedding cache"
    assert encoding[-1] == f"encoding the prompts: {len(cached)}/{len(cached)}"
    kept = sum(t.numel() * t.element_size() for cond in cached.values() for key, t in cond.items() if "mask" not in key)
    plan = plan_memory(config)
    assert plan.cached_prompts == len(cached) == len(set(trainer.train_prompts + trainer.eval_prompts))
    assert plan.host_cache == kept and any(key.startswith("negative/") for key in cached[trainer.eval_prompts[0]]) \
        == (guidance > 1)
    assert f"text-embedding cache ({len(cached)} prompts)" in plan.table()
    assert check_host(plan, tmp_path) == f"host: fits the text-embedding cache ({kept / 1e6:.1f} MB) in memory and on disk"
    assert check_host(plan_memory(tiny_config(model, model__cache_text_embeddings=False)), tmp_path) == ""


#: a run on a machine with 1 MB of memory to spare
SMALL_HOST = """
import sys
from jagg_core.models import text_embeddings
text_embeddings.available_memory = lambda: 10 ** 6
from jagg_core.run import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_cache_the_host_cannot_hold_is_refused_in_one_line_before_any_prompt_is_encoded(tmp_path):
    run_dir = tmp_path / "run"
    done = run_python(["-c", SMALL_HOST, "--preset", "tiny-sd3", "--output-dir", str(run_dir)], cwd=ROOT, timeout=600,
                      env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    prompts = len(set(sum(run_prompts(load_config(preset="tiny-sd3").prompts), [])))
    assert re.fullmatch(rf"jagg_core\.run: error: the text-embedding cache of {prompts} prompts \([\d.]+ MB each\) takes "
                        rf"[\d.]+ MB of host memory and of disk in {run_dir}; this machine has 1\.0 MB of memory "
                        r"available and [\d.]+ GB of disk free there; set model\.cache_text_embeddings=false .*, lower "
                        r"model\.max_sequence_length, or train on fewer prompts \(prompts\.limit\)", line), line
    run = RunDirectory(run_dir)
    assert run.read_status()["state"] == "failed" and not run.text_embeddings_file.exists()


@pytest.mark.parametrize("limit, usage, available", [("4000000000", "1000000000", 3 * GB), ("max", "1000000000", None),
                                                      (None, None, None)])
def test_the_memory_available_is_the_containers_when_its_limit_is_lower(limit, usage, available, tmp_path,
                                                                         monkeypatch):
    """A container sees the machine's memory but is killed at its control group's limit (cgroup v2 files here)."""
    from jagg_core import host
    if limit is not None:
        (tmp_path / "memory.max").write_text(limit + "\n")
        (tmp_path / "memory.current").write_text(usage + "\n")
    monkeypatch.setattr(host, "CGROUP_FILES", ((tmp_path / "memory.max", tmp_path / "memory.current"),))
    machine = host.psutil.virtual_memory()
    assert abs(host.available_memory() - min(available or machine.available, machine.available)) < 0.05 * GB
    assert host.total_memory() == (4 * GB if limit == "4000000000" else machine.total)


def test_the_cache_needs_the_memory_of_every_process_and_the_disk_of_one_file(tmp_path, monkeypatch):
    monkeypatch.setattr(text_embeddings, "available_memory", lambda: 10 * GB)
    monkeypatch.setattr(text_embeddings, "free_disk", lambda folder: 5 * GB)
    check_cache_room(GB // 1000, 4000, tmp_path, processes=2)  # 4 GB: 8 GB of memory, 4 GB of disk
    with pytest.raises(UserError, match="takes 4.0 GB of host memory in each of the 3 processes"):
        check_cache_room(GB // 1000, 4000, tmp_path, processes=3)
    with pytest.raises(UserError, match="of memory available and 5.0 GB of disk free"):
        check_cache_room(GB // 1000, 6000, tmp_path)


def test_without_the_cache_a_run_keeps_only_its_eval_prompts_and_trains_the_same_adapter(tmp_path, offline):
    """``model.cache_text_embeddings=false``: the encoders stay and each iteration encodes its prompts without keeping
    them, so the host holds the eval prompts alone however many prompts a long run draws; the embeddings are the
    same, and so is the adapter, to float32 rounding: a prompt encoded in a batch of 2 or of 16 may round differently
    in the BLAS (seen on AMD EPYC: 3e-7 in CLIP's pooled projection, 3e-7 in the adapter)."""
    adapters, kept = {}, {}
    for cache in (True, False):
        trainer = Trainer(tiny_config(model__cache_text_embeddings=cache), tmp_path / f"cache-{cache}")
        trainer.setup()
        trainer.fit()
        adapters[cache] = [param.detach().clone() for param in trainer.params]
        kept[cache] = set(trainer.model.cached_embeddings)
        trainer.close()
    assert kept[False] == set(trainer.eval_prompts) and len(kept[True]) > len(kept[False])
    assert trainer.model.text_encoders and not RunDirectory(tmp_path / "cache-False").text_embeddings_file.exists()
    for with_cache, without in zip(adapters[True], adapters[False], strict=True):
        torch.testing.assert_close(without, with_cache)


def test_embeddings_made_with_other_settings_are_not_reused(tmp_path, offline):
    Trainer(tiny_config(), tmp_path).setup()
    other = Trainer(tiny_config(model__max_sequence_length=12), tmp_path, resume=True)
    other.setup()  # the saved file's fingerprint differs: the encoders run again, then leave
    assert other.model.text_encoders == []
    assert other.model.conditioning(other.eval_prompts[:1])["prompt_embeds"].shape[1] == 77 + 12


def test_an_unseen_prompt_after_release_is_a_clear_error(offline):
    model = load_flow_model(tiny_config().model)
    model.encode_and_cache(["a red circle"])
    model.release_text_encoders()
    with pytest.raises(UserError, match="not encoded at set-up"):
        model.conditioning(["a blue square"])


@pytest.mark.parametrize("model_name", FAMILIES)
def test_rollouts_in_chunks_sample_the_same_trajectory_as_one_batch(model_name, offline):
    model = load_flow_model(tiny_config(model_name, grpo__kl_beta=0.1).model)
    model.add_lora(tiny_config().lora)
    prompts = ["a red circle", "two cats", "a blue square"]
    cond = model.conditioning([p for p in prompts for _ in range(2)])
    sigmas = model.sigmas(6, ImageSize.square(32))

    def rollout(chunk):
        generator = torch.Generator().manual_seed(3)
        z0 = initial_noise(model, 6, ImageSize.square(32), generator)
        return sde_rollout(model, cond, sigmas, 0.7, z0, generator, with_reference=True, sde_steps=range(4),
                           chunk_size=chunk)

    whole = rollout(None)
    for chunk in (1, 4):
        part = rollout(chunk)
        for name in ("latents", "velocities", "log_probs", "ref_velocities"):
            torch.testing.assert_close(getattr(part, name), getattr(whole, name), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("model", "dora"), [*((model, False) for model in FAMILIES), ("tiny-flux", True)])
def test_an_int8_base_trains_with_a_float32_lora(model, dora, tmp_path, offline):
    pytest.importorskip("torchao")
    trainer = Trainer(tiny_config(model, model__quantize="int8", train__iterations=1, lora__use_dora=dora), tmp_path)
    trainer.setup()
    trainer.fit()
    linear = trainer.model.transformer.transformer_blocks[0].attn.to_q
    assert "Int8" in type(linear.base_layer.weight).__name__, "the base weight must be int8"
    assert all(p.dtype == torch.float32 for p in trainer.params)
    assert bool(linear.lora_magnitude_vector) == dora  # a DoRA's magnitudes, on the int8 base
    rows = RunDirectory(tmp_path).read_metrics()
    assert rows[-1]["train/grad_norm"] > 0 and rows[-1]["train/skipped"] is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine NF4 loads (the GPU check covers it)")
def test_nf4_on_a_cpu_is_one_clear_line(offline):
    with pytest.raises(UserError, match="model.quantize=nf4 needs a CUDA GPU"):
        load_flow_model(tiny_config(model__quantize="nf4").model)


# ----- the plan ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model, quantize, dora", [*((m, "none", False) for m in FAMILIES),
                                                   ("tiny-flux", "int8", False), ("tiny-flux", "none", True)])
def test_the_plan_is_within_25_percent_of_the_measured_peak(model, quantize, dora, tmp_path, offline):
    """A DoRA's weight norms, a weight-sized temporary in each adapted layer's every call, are traced too: on the tiny
    FLUX they are about a third of the peak."""
    config = tiny_config(model, sampling__resolution=64, grpo__num_generations=4, model__quantize=quantize,
                         lora__use_dora=dora)
    trainer = Trainer(config, tmp_path)
    trainer.setup()
    measured = measured_peak(trainer)
    planned = plan_memory(config).total
    assert 0.75 <= planned / measured <= 1.25, f"planned {planned / 1e6:.2f} MB, measured {measured / 1e6:.2f} MB"


def test_the_plan_counts_the_transformers_buffers(offline):
    """SD3's position table is a buffer: 384 x 384 positions x 1536 channels, 0.45 GB in bf16 at SD3.5-Medium's width,
    whatever the depth."""
    plan = plan_memory(load_config(preset="sd35-medium-pickscore-16gb",
                                   overrides=["model.name=random:sd35-medium@1"]))
    transformer = next(size for part, size in plan.resident.items() if part.startswith("transformer"))
    params = 90_314_304  # SD3.5-Medium with one block
    assert transformer == pytest.approx(params * 2 + 384 * 384 * 1536 * 2, rel=1e-3)


@pytest.mark.parametrize("arch, settings", [
    ("flux-dev", {}),  # two stacks
    ("qwen-image", {"train.gradient_checkpointing": True}),  # rotary tables made on the first call
])
def test_the_plan_traces_a_short_stack_and_counts_the_same_bytes_as_every_block(arch, settings, offline, monkeypatch):
    """The plan traces each uniform stack at 2 and 4 blocks and extends the peak linearly: the same bytes, exactly,
    as tracing all 7 blocks of each stack at the real width."""
    overrides = [f"model.name=random:{arch}@7", "sampling.resolution=256", "model.quantize=none",
                 *(f"{key}={json.dumps(value)}" for key, value in settings.items())]
    config = load_config(preset="flux-dev-pickscore-24gb", overrides=overrides)
    short = plan_memory(config)
    monkeypatch.setattr(memory_plan, "_uniform_stacks", lambda transformer: {})
    every_block = plan_memory(config)
    assert short.phases == every_block.phases and short.total == every_block.total


def _meta_kernel_source(op: str) -> str:
    """Where the kernel the dispatcher runs for ``op`` on meta tensors was registered (a file)."""
    line = next(line for line in torch._C._dispatch_dump_table(op).splitlines() if line.startswith("Meta:"))
    return line.removeprefix("Meta: registered at ").split(":")[0]


@pytest.mark.parametrize("preset, overrides", [
    ("flux2-klein-pickscore-24gb", []),  # two stacks, at their depth by extension
    ("zimage-turbo-pickscore-24gb", ["model.quantize=int8"]),  # an int8 base: traced at its full depth
])
def test_a_plan_on_the_cpp_meta_kernels_counts_the_same_bytes_and_torchs_own_kernels_come_back(preset, overrides,
                                                                                               offline):
    """Inside :func:`cpp_meta_kernels` an op with a C++ meta kernel (``mul``) runs it instead of the Python one torch
    registers over it, an op without one (``_fft_r2c``) keeps its Python kernel, a nested entry changes nothing,
    ``native_group_norm``'s lean kernel makes the outputs torch's makes; a real-size plan counts the same bytes in
    every phase as on torch's own meta kernels; and after it, torch's registrations are back as they were, also once
    the lifted libraries are collected."""
    import gc
    import torch.library
    from jagg_core.meta_kernels import cpp_meta_kernels
    registered = set(torch.library._impls)
    assert _meta_kernel_source("aten::mul.Tensor").endswith(".py")  # torch's Python kernel (or one put back)
    with cpp_meta_kernels():
        assert _meta_kernel_source("aten::mul.Tensor").endswith(".cpp")
        assert _meta_kernel_source("aten::_fft_r2c").endswith(".py")
        with cpp_meta_kernels():
            assert _meta_kernel_source("aten::mul.Tensor").endswith(".cpp")
        assert _meta_kernel_source("aten::mul.Tensor").endswith(".cpp")
    assert _meta_kernel_source("aten::mul.Tensor").endswith(".py")
    group_norm = torch.ops.aten.native_group_norm.default
    for x, affine in [(torch.empty(2, 8, 3, 5, 6, dtype=torch.bfloat16, device="meta"), True),
                      (torch.empty(1, 6, 4, 4, device="meta"), False)]:
        scale = torch.empty(x.shape[1], device="meta") if affine else None
        args = (x, scale, scale, x.shape[0], x.shape[1], x[0, 0].numel(), 2, 1e-5)
        expected = [(t.shape, t.dtype, t.stride()) for t in group_norm(*args)]
        with cpp_meta_kernels():
            assert [(t.shape, t.dtype, t.stride()) for t in group_norm(*args)] == expected
    gc.collect()
    assert set(torch.library._impls) == registered

    config = load_config(preset=preset, overrides=overrides)
    on_cpp = plan_memory(config)
    assert _meta_kernel_source("aten::mul.Tensor").endswith(".py")
    on_python = plan_memory.__wrapped__(config)  # the plan without the decorator: torch's own meta kernels
    assert on_cpp.phases == on_python.phases and on_cpp.total == on_python.total and on_cpp.phases["backward"] > 0


def test_quantizing_a_model_built_in_memory_without_room_to_save_it_is_refused_before_it_writes(
        tmp_path, offline, monkeypatch):
    """A model built in memory is quantized through diffusers' loader: saved to a temporary folder, loaded back. A
    disk without room for the weights (a random Qwen-Image's 41 GB) is one line before anything is written."""
    from jagg_core.models import quantize
    folders = []
    monkeypatch.setattr(quantize, "free_disk", lambda folder: folders.append(Path(folder)) or 1000)
    saved = []
    from diffusers import ModelMixin
    monkeypatch.setattr(ModelMixin, "save_pretrained", lambda *args, **kwargs: saved.append(args))
    trainer = Trainer(tiny_config(model__quantize="int8", train__iterations=1), tmp_path)
    with pytest.raises(UserError, match=r"^model.quantize=int8 on a model built in memory saves its transformer "
                                        r"\(\d+\.\d MB\) to .+ first, which has 0.0 MB free: set TMPDIR to a folder"):
        trainer.setup()
    assert len(folders) == 1 and not folders[0].exists() and not saved


def test_an_int8_base_plans_the_dequantized_weights_its_backward_keeps(tmp_path, offline):
    """torchao's int8 linear computes with its weight dequantized to bf16, and autograd keeps that copy for the
    backward; without checkpointing, every such copy at once. FLUX at the real width and one block (the GPU check's
    reduced recipe of its 24 GB preset) planned 0.68x of the measured peak before the copies were planned."""
    recipe = memory_recipe("flux-dev-pickscore-24gb", CheckOptions(reduced=True))
    config = recipe.model_copy(update={"train": recipe.train.model_copy(update={"gradient_checkpointing": False})})
    trainer = Trainer(config, tmp_path)
    trainer.setup()
    measured = measured_peak(trainer)
    trainer.close()
    planned = plan_memory(config).total
    assert config.model.quantize == "int8" and 0.98 <= planned / measured <= 1.02, (planned, measured)


def test_checkpointing_sequential_endpoints_and_chunks_lower_the_plan(offline):
    base = dict(sampling__resolution=64, grpo__num_generations=4, backward__window=3)
    full = plan_memory(tiny_config(**base))
    lean = plan_memory(tiny_config(**base, train__gradient_checkpointing=True, backward__joint=False,
                                   sampling__rollout_chunk=1, train__gradient_accumulation_steps=8))
    assert lean.phases["backward"] < full.phases["backward"]
    assert lean.phases["rollout forward"] < full.phases["rollout forward"]


def test_a_plan_that_does_not_fit_names_the_cheapest_change_that_does(tmp_path, offline):
    """The budget holds the plan and the run's CUDA context."""
    config = tiny_config(sampling__resolution=64, grpo__num_generations=4)
    budget = 0.8 * plan_memory(config).total / GB + CUDA_CONTEXT_GB
    line = check_fits(plan_memory(config), config, budget)
    assert line.startswith(f"does not fit: planned peak {plan_memory(config).total / GB:.1f} GB + 0.55 GB CUDA "
                           f"context, the GPU has {budget:.1f} GB; cheapest change that fits: --set "), line
    changes, plan = cheapest_fit(config, budget)
    assert fits(plan, budget) and plan.total <= budget * GB - CUDA_CONTEXT_GB * GB
    assert not fits(plan, plan.total / GB + CUDA_CONTEXT_GB - 0.01) and fits(plan, plan.total / GB + CUDA_CONTEXT_GB)
    (tmp_path / "run.yaml").write_text(config.to_yaml())
    assert plan_memory(load_config(config_file=tmp_path / "run.yaml", overrides=changes)).total == plan.total


def test_the_cheapest_fits_plans_share_the_phases_traces_and_equal_the_plans_made_afresh(offline):
    """The cheapest fit plans the config after each change in turn, then without each change it may not need (54 s
    for FLUX's int8 preset at 12 GB, whose backward is traced at its full depth, when every change traced it): a
    change traces only the phases it alters anew (a smaller rollout chunk the rollout forward, a tiled decode the
    decode, offloaded text encoders none, fewer bits the decode only where the compute dtype changes; one that
    alters the backward traces the rollout forward again on the backward's meta model), and every plan is the plan
    made afresh (Qwen-Image keeps rotary tables from one trace to the next)."""
    config = tiny_config("tiny-qwen", sampling__resolution=32, grpo__num_generations=2,
                         eval__judges=[{"name": "aesthetic"}])
    traces, traced_anew = plan_memory(config).traces, {}
    for key, value in memory_plan._memory_savers(config):
        config = memory_plan._changed(config, {key: value})
        before = set(traces)
        shared = plan_memory(config, traces)
        assert shared.traces is traces
        assert shared.totals == plan_memory(config).totals, f"{key}={value}"
        traced_anew[f"{key}={value}"] = sorted(phase for phase, *_ in set(traces) - before)
    assert traced_anew == {
        "eval.judges_on_cpu=True": [], "model.offload_text_encoders=True": [],
        "backward.joint=False": ["backward"], "train.gradient_checkpointing=True": ["backward"],
        "sampling.rollout_chunk=2": ["rollout forward"], "sampling.rollout_chunk=1": ["rollout forward"],
        "train.gradient_accumulation_steps=2": ["backward"], "train.gradient_accumulation_steps=4": ["backward"],
        "model.vae_tiling=True": ["VAE decode"], "train.optimizer=adamw8bit": [],
        "model.quantize=int8": ["VAE decode", "backward", "rollout forward"],  # and the compute dtype: bf16
        "model.quantize=nf4": ["backward", "rollout forward"]}


def test_the_cheapest_fit_traces_only_the_changes_whose_weights_and_batch_alone_fit(offline, monkeypatch):
    """A plan without its activations (``trace=False``: the weights and each phase's own tensors, a fraction of a
    second) is a floor of the traced plan, so a change whose floor does not fit cannot fit, and the search traces
    only the others: here 1 plan instead of 14 (a 10 GB card asked about FLUX.1-dev in bf16 waited 24 s for every
    change to be traced)."""
    config = tiny_config("tiny-flux", sampling__resolution=512, grpo__num_generations=4)
    prefixes = list(itertools.accumulate(memory_plan._memory_savers(config),
                                         lambda cfg, change: memory_plan._changed(cfg, dict([change])), initial=config))
    keys = [key for key, _ in memory_plan._memory_savers(config)]
    at_384 = prefixes[keys.index("sampling.resolution") + 1]
    traced = plan_memory(at_384)
    floor = plan_memory(at_384, trace=False)
    assert (floor.resident, floor.setup, floor.phase_parts) == (traced.resident, traced.setup, traced.phase_parts)
    # a floor given the LoRA's size adds no LoRA to its model: the same plan (no change alters the LoRA)
    assert plan_memory(at_384, trace=False, lora_params=floor.lora_params) == floor and floor.lora_params > 0
    assert not any(key.startswith("lora.") for key in keys)
    assert set(floor.phases.values()) == {0} and floor.phases.keys() == traced.phases.keys()
    assert floor.total < traced.total
    budget = traced.total / GB + CUDA_CONTEXT_GB
    before_384 = prefixes[1:keys.index("sampling.resolution") + 1]
    assert not any(fits(plan_memory(cfg, trace=False), budget) for cfg in before_384)
    plans = []  # (traced, config, fits) of each plan the search makes
    real_plan = memory_plan.plan_memory

    def recorded_plan(cfg, traces=None, trace=True, lora_params=None):
        made = real_plan(cfg, traces, trace, lora_params)
        plans.append((trace, cfg, fits(made, budget)))
        return made

    monkeypatch.setattr(memory_plan, "plan_memory", recorded_plan)
    changes, plan = cheapest_fit(config, budget)
    assert changes[-1] == "sampling.resolution=384" and fits(plan, budget)
    # in turn: 13 floors that do not fit, then the floor and the traced plan at 384 px
    assert [(traced, fit) for traced, _, fit in plans[:15]] == [(False, False)] * 13 + [(False, True), (True, True)]
    # then each change undone or made milder: a plan is traced only after its floor fit
    for (floor_traced, floor_config, floor_fits), (traced, config, _) in zip(plans, plans[1:]):
        assert not traced or (not floor_traced and floor_config is config and floor_fits)


def test_the_cheapest_fit_keeps_only_the_changes_it_needs_each_no_stronger_than_it_must(offline):
    """The changes are applied in turn until the plan fits (here 5: offloaded text encoders, sequential endpoints,
    checkpointing, rollout chunks of 1, 4 micro-batches); then each earlier one is undone where the fit does not
    need it (the offload, checkpointing) or made milder (rollout chunks of 4). Each change of the answer is needed:
    the plan without it, or with a milder value of it, does not fit."""
    config = tiny_config(sampling__resolution=64, grpo__num_generations=4)
    budget = 0.25 * plan_memory(config).total / GB + CUDA_CONTEXT_GB
    changes, plan = cheapest_fit(config, budget)
    assert changes == ["backward.joint=false", "sampling.rollout_chunk=4", "train.gradient_accumulation_steps=4"]
    chosen = {key: json.loads(value) for key, value in (change.split("=", 1) for change in changes)}
    assert plan.totals == plan_memory(memory_plan._changed(config, chosen)).totals and fits(plan, budget)
    savers = memory_plan._memory_savers(config)
    for key, value in chosen.items():
        steps = [saved for saver, saved in savers if saver == key]
        for milder in [None, *steps[:steps.index(value)]]:
            weaker = {k: v for k, v in chosen.items() if k != key} | ({} if milder is None else {key: milder})
            assert not fits(plan_memory(memory_plan._changed(config, weaker)), budget), (key, milder)


def test_judges_on_the_cpu_move_to_host_memory_and_are_the_first_change_when_the_plan_does_not_fit(
        tmp_path, offline, monkeypatch):
    """A CLIP judge's weights (float32) are on the device unless ``eval.judges_on_cpu``, then in each process's host
    memory, which must hold them beside the text-embedding cache; the judges' move changes no training, so the
    plan's cheapest fix names it first."""
    settings = dict(sampling__resolution=64, grpo__num_generations=4, eval__judges=[{"name": "aesthetic"}])
    config, cpu_config = tiny_config(**settings), tiny_config(**settings, eval__judges_on_cpu=True)
    on_device, on_cpu = plan_memory(config), plan_memory(cpu_config)
    judge = reward_entry("aesthetic").device_params_m * 1e6 * 4
    assert judge > 1e9 and on_device.total - on_cpu.total == pytest.approx(judge)
    assert on_device.host_judges == {} and {name: size.cpu_bytes for name, size in on_cpu.host_judges.items()} == {
        "aesthetic": judge}
    assert "judge aesthetic on the CPU (429 M, float32)" in on_cpu.table()
    assert "on the CPU" not in on_device.table() and "judge aesthetic (429 M, float32)" in on_device.table()
    cache = amount(on_cpu.host_cache)
    assert check_host(on_cpu, tmp_path) == (f"host: fits the judges on the CPU (1.7 GB) in memory and the "
                                            f"text-embedding cache ({cache}) in memory and on disk")
    monkeypatch.setattr(judges, "available_memory", lambda: int(1.5 * judge))  # one process's judges, not two
    assert check_host(on_cpu, tmp_path).startswith("host: fits the judges")
    assert check_host(on_cpu, tmp_path, processes=2) == (
        f"host: the judges on the CPU (aesthetic; eval.judges_on_cpu) take 1.7 GB of host memory in each of the 2 "
        f"processes beside the text-embedding cache ({cache}); this machine has 2.6 GB available; set "
        "eval.judges_on_cpu=false (they then run on the GPU) or remove the largest judge from eval.judges")
    changes, plan = cheapest_fit(config, (on_cpu.total + 1e6) / GB + CUDA_CONTEXT_GB)
    assert changes == ["eval.judges_on_cpu=true"] and plan.total == on_cpu.total
    assert judges_device(config, "cuda") == torch.device("cuda")
    assert judges_device(cpu_config, "cuda") == torch.device("cpu")


def test_a_reward_or_judge_of_another_model_is_planned_at_that_models_size(tiny_clip, tmp_path, offline):
    """The catalog counts each reward's default model; a spec's ``options.model_id`` is counted from its own
    safetensors headers (a local folder here; a Hub id in the local cache alike), and a model not found locally is
    planned as the default, which the plan's line says."""
    from transformers import CLIPModel
    from jagg_core.rewards.model_size import scoring_model_size
    folder, _ = tiny_clip
    saved = sum(tensor.numel() for tensor in CLIPModel.from_pretrained(folder).state_dict().values())
    assert scoring_model_size("clip_score", {"model_id": folder}).params == saved
    assert scoring_model_size("clip_score", {}).params == 428e6 and scoring_model_size("ocr", {}).params == 0
    elsewhere = scoring_model_size("vqa_score", {"model_id": "someone/vlm-not-downloaded"})
    assert not elsewhere.counted and elsewhere.params == 3755e6
    config = tiny_config(rewards=[{"name": "clip_score", "options": {"model_id": folder}}],
                         eval__judges=[{"name": "vqa_score", "options": {"model_id": "someone/vlm-not-downloaded"}}],
                         eval__judges_on_cpu=True)
    plan = plan_memory(config)
    reward = f"reward clip_score ({Path(folder).name}: 0 M, float32)"
    assert plan.resident[reward] == saved * 4
    assert {name: size.cpu_bytes for name, size in plan.host_judges.items()} == {"vqa_score": 3755e6 * 4}
    assert "judge vqa_score on the CPU (3755 M as its default; someone/vlm-not-downloaded not found locally, float32)" \
        in plan.table()
    in_device = plan_memory(config.model_copy(update={"eval": config.eval.model_copy(update={"judges_on_cpu": False})}))
    line = "judge vqa_score (3755 M as its default; someone/vlm-not-downloaded not found locally, bfloat16)"
    assert in_device.resident[line] == 3755e6 * 2


def test_a_run_whose_host_cannot_hold_its_judges_on_the_cpu_is_refused_before_they_load(tmp_path, offline,
                                                                                          monkeypatch):
    """Without the judge's weights here, loading it would fail in another line: the refusal comes first."""
    config = tiny_config(eval__judges=[{"name": "aesthetic"}], eval__judges_on_cpu=True)
    monkeypatch.setattr(judges, "available_memory", lambda: 10 ** 9)
    with pytest.raises(UserError, match=r"^the judges on the CPU \(aesthetic; eval.judges_on_cpu\) take 1.7 GB of "
                                        r"host memory; this machine has 1.0 GB available; set eval.judges_on_cpu=false"):
        Trainer(config, tmp_path).setup()


BUDGETS = {"16gb": 16, "24gb": 24, "48gb": 48}


#: the presets made for a CPU, whose first comment line says ``# GPU memory: none needed``
CPU_PRESETS = ("shapes", "shapes-awm", "shapes-nft", "tiny-sd3")


@pytest.mark.parametrize("preset", list(list_presets()))
def test_every_preset_states_its_gpu_memory_and_a_gpu_preset_its_planned_peak_within_its_budget(preset, offline):
    """A preset's comment line ``# GPU memory: none needed`` (a CPU preset) or ``# GPU memory: planned peak X GB``,
    X the plan's peak to 0.05 GB, at most the budget its name ends with (``-16gb``, ``-24gb``, ``-48gb``)."""
    text = preset_path(preset).read_text()
    if preset in CPU_PRESETS:
        assert re.search(r"^# GPU memory: none needed", text, re.M), f"{preset}: say '# GPU memory: none needed'"
        return
    stated = re.search(r"^# GPU memory: planned peak ([\d.]+) GB", text, re.M)
    assert stated, f"{preset}: a comment line must start '# GPU memory: planned peak X GB'"
    planned = plan_memory(load_config(preset=preset)).total / GB
    assert float(stated.group(1)) == pytest.approx(planned, abs=0.051), f"{preset} plans {planned:.2f} GB now"
    for suffix, budget in BUDGETS.items():
        if preset.endswith(suffix):
            assert planned <= budget


def test_plan_cli_prints_the_parts_and_whether_it_fits(offline):
    result = run_cli("--preset", "sd35-medium-pickscore-16gb", "--plan", "--gpu-memory", "16")
    assert result.returncode == 0, result.stderr
    assert "transformer (2.24 B params, bfloat16)" in result.stdout
    assert "text encoders" in result.stdout and "LoRA" in result.stdout and "backward" in result.stdout
    assert re.search(r"^fits: planned peak [\d.]+ GB \+ 0.55 GB CUDA context of 16.0 GB$", result.stdout, re.M)
    # with CFG, 320 prompts x 2 x ((77 CLIP + 128 T5 tokens) x 4096 + 2048 pooled) x 2 bytes, on the host
    assert re.search(r"^    text-embedding cache \(320 prompts\) +1\.08$", result.stdout, re.M), result.stdout
    assert "\nhost: fits the text-embedding cache (1.1 GB) in memory and on disk\n" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--set", "model.name=nobody/unknown-model"], "model.name|nobody/unknown-model"),
    (["--set", "sampling.resolution=2048", "--set", "grpo.num_generations=64", "--set", "grpo.prompts_per_iteration=16",
      "--set", "model.guidance_scale=4"], "more than any single GPU"),
])
def test_a_plan_for_bad_input_is_one_line(args, message, offline):
    result = run_cli("--preset", "flux-dev-hpsv2", "--plan", *args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert re.search(message, result.stderr), result.stderr


@pytest.mark.parametrize("cpu", ["rss", "tensors"])
def test_the_meter_sees_a_tensor_of_known_size_and_not_one_made_before(cpu):
    """The meter's peak increment against the bytes of a 64 MiB tensor made (and freed) inside: the live-tensor
    basis counts it exactly; the resident set never counts more than it (to 16 MiB of the meter's own pages), and
    may count less when the allocator reuses pages the process already held (in a long test session it does)."""
    before = torch.ones(2 ** 24)  # 64 MiB, made before: resident, never part of the increment
    with PeakMemory(torch.device("cpu"), cpu=cpu, resident=[before]) as meter:
        inside = torch.ones(2 ** 24)
        del inside
    increment = meter.peak - meter.base
    assert 0 <= increment < 2 ** 26 + 2 ** 24, increment
    if cpu == "tensors":
        assert meter.base == before.untyped_storage().nbytes() and increment == 2 ** 26
