"""Wan 2.2 A14B: two experts, the pipeline's ``transformer`` at the high-noise steps and ``transformer_2`` below the
boundary; the LoRA trains one of them (``model.expert``), only at its steps, or both, each at its own (tiny-wan-a14b:
6 steps, the first 2 the high-noise expert's)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from peft import get_peft_model_state_dict
from safetensors.torch import load_file

from jagg_core.config import LoraConfig, ModelConfig
from jagg_core.errors import UserError
from jagg_core.image_size import ImageSize
from jagg_core.memory_plan import plan_memory
from jagg_core.model_card import build_model_card, publish_files, read_run
from jagg_core.models import build_tiny_pipeline, load_flow_model
from jagg_core.models.quantize import is_quantized
from jagg_core.models.wan import IMAGE_STATES, WanModel
from jagg_core.models.wan_i2v import VIDEO_CONDITION
from jagg_core.placement import trained_steps
from jagg_core.rundir import LORA_FILE, TRANSFORMER_2_LORA_FILE, RunDirectory
from jagg_core.trainer import Trainer

from conftest import (adapter_and_base_velocity, euler_ode, noise, pipeline_with_final_latents, run_cli,
                      snippet_arguments, tiny_config)

FRAMES, SIZE, STEPS = 5, ImageSize.square(32), 6
PROMPTS = ["a red ball rolling", "two blue cubes spinning on a green floor"]
HIGH, LOW = range(0, 2), range(2, 6)  # tiny-wan-a14b's 6 steps: sigma 1, 0.92 >= 0.875 > 0.82, 0.67, 0.43, 0.01


def load(**overrides) -> WanModel:
    return load_flow_model(ModelConfig(name="tiny-wan-a14b", max_sequence_length=16, **overrides), num_frames=FRAMES)


def expert_config(expert: str, algorithm: str = "grpo", awm: tuple[str, ...] = ("awm.train_timesteps=2",),
                  **overrides):
    config = tiny_config("tiny-wan-a14b", sampling__num_frames=FRAMES, model__max_sequence_length=16,
                         model__expert=expert, **overrides)
    return config.for_algorithm(algorithm, list(awm) if algorithm == "awm" else [])


@pytest.mark.parametrize(("guidance_scale", "guidance_scale_2"), [(1.0, None), (5.0, None), (4.0, 2.0)])
def test_the_euler_ode_switches_experts_where_the_pipeline_does(guidance_scale, guidance_scale_2):
    """3 steps (sigma 1, 0.75, 0.01): the first is the high-noise expert's, the others the low-noise one's; the same
    latents as WanPipeline with FlowMatchEuler swapped in, which switches at ``t >= boundary_ratio * 1000``, and its
    CFG scale with them (``guidance_scale_2``)."""
    model = load(guidance_scale=guidance_scale, guidance_scale_2=guidance_scale_2, negative_prompt="ugly")
    sigmas = model.sigmas(3, SIZE)
    assert model.trained_steps(sigmas) == range(0, 1)
    z0 = noise(model, len(PROMPTS), seed=1)
    z, frames = euler_ode(model, z0, sigmas, model.conditioning(PROMPTS))
    model.pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=model.pipe.scheduler.config.flow_shift)
    output, latents = pipeline_with_final_latents(
        model.pipe, prompt=PROMPTS, height=32, width=32, num_frames=FRAMES, num_inference_steps=3,
        latents=z0.clone(), output_type="pt", **snippet_arguments(model, SIZE, len(PROMPTS)))  # the model card's
    torch.testing.assert_close(z, latents, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(frames, output.frames.float(), atol=1e-4, rtol=1e-4)


def test_a_flow_shift_moves_the_switch_as_the_pipeline_at_that_shift_does():
    """``model.flow_shift: 12`` (the official Wan 2.2 T2V setting): 4 steps at sigma 1, 0.96, 0.86, 0.13, the first
    2 the high-noise expert's (1 at the tiny model's shift 3: sigma 1, 0.86, 0.6, 0.01); the same latents as the
    pipeline at that shift, whose own scheduler takes it as the model card's line sets it."""
    model = load(flow_shift=12.0)
    sigmas = model.sigmas(4, SIZE)
    assert model.expert_switch(sigmas) == 2 and load().expert_switch(load().sigmas(4, SIZE)) == 1
    z0 = noise(model, len(PROMPTS), seed=2)
    z, _ = euler_ode(model, z0, sigmas, model.conditioning(PROMPTS))
    unipc = model.pipe.scheduler.from_config(model.pipe.scheduler.config, flow_shift=12.0)  # the card's line
    assert unipc.config.flow_shift == 12.0
    model.pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=12.0)
    _, latents = pipeline_with_final_latents(model.pipe, prompt=PROMPTS, guidance_scale=1.0, height=32, width=32,
                                             num_frames=FRAMES, num_inference_steps=4, latents=z0.clone(),
                                             max_sequence_length=16, output_type="pt")
    torch.testing.assert_close(z, latents, atol=1e-4, rtol=1e-4)


def test_image_to_video_a14b_switches_experts_where_its_pipeline_does_with_no_image_states():
    """Wan 2.2 I2V-A14B: the video condition as Wan 2.1's, no image encoder and no image states, the experts
    switched at 0.9; the same latents and frames as WanImageToVideoPipeline, with CFG."""
    from test_video import I2V_FRAMES, first_frame_rows
    model = load_flow_model(ModelConfig(name="tiny-wan-i2v-a14b", max_sequence_length=16, condition_resolution=32,
                                        guidance_scale=5.0, negative_prompt="ugly"), num_frames=I2V_FRAMES)
    assert model.default_lora_targets == ("to_q", "to_k", "to_v", "to_out.0") and model.pipe.image_encoder is None
    rows = first_frame_rows(SIZE)
    cond = model.conditioning(rows)
    assert IMAGE_STATES not in cond and VIDEO_CONDITION in cond
    sigmas = model.sigmas(3, SIZE)
    assert model.trained_steps(sigmas) == range(0, 1)
    z0 = noise(model, len(rows), seed=1)
    z, frames = euler_ode(model, z0, sigmas, cond)
    model.pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    for i, row in enumerate(rows):
        output, final = pipeline_with_final_latents(
            model.pipe, image=row.image(SIZE), prompt=row.instruction, height=32, width=32, num_frames=I2V_FRAMES,
            num_inference_steps=3, latents=z0[i:i + 1].clone(), output_type="pt", **snippet_arguments(model, SIZE))
        torch.testing.assert_close(final, z[i:i + 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(frames[i:i + 1], output.frames.float(), atol=1e-4, rtol=1e-4)


def test_a_batch_of_both_experts_rows_gives_each_row_its_experts_velocity():
    model = load()
    z, cond = noise(model, 2, seed=3), model.conditioning(PROMPTS)
    with torch.no_grad():
        mixed = model.velocity(z, torch.tensor([0.9, 0.3]), cond)
        high = model.velocity(z, torch.tensor([0.9, 0.9]), cond)
        low = model.velocity(z, torch.tensor([0.3, 0.3]), cond)
        row = model.pipe.transformer(hidden_states=z[:1], timestep=torch.tensor([900.0]),
                                     encoder_hidden_states=cond["prompt_embeds"][:1], return_dict=False)[0]
    torch.testing.assert_close(mixed, torch.stack([high[0], low[1]]))
    torch.testing.assert_close(high[:1], row)
    assert not torch.allclose(high[1], low[1], atol=1e-3)  # two experts of their own weights


@pytest.mark.parametrize(("expert", "steps"), [("high_noise", HIGH), ("low_noise", LOW), ("both", range(6))])
def test_the_lora_is_on_the_trained_experts_alone_and_changes_only_their_steps(expert, steps):
    model = load(expert=expert)
    assert model.trained_steps(model.sigmas(STEPS, SIZE)) == steps
    trained = {"high_noise": [model.pipe.transformer], "low_noise": [model.pipe.transformer_2],
               "both": [model.pipe.transformer, model.pipe.transformer_2]}[expert]
    assert model.trained_transformers == trained and model.transformer is trained[0]
    assert model.denoisers == [model.pipe.transformer, model.pipe.transformer_2]
    from conftest import add_moved_lora
    params = add_moved_lora(model)
    assert sum(p.numel() for p in params) == sum(p.numel() for t in trained for p in get_peft_model_state_dict(t).values())
    z, cond = noise(model, 1), model.conditioning(PROMPTS[:1])
    for sigma, expert_of_sigma in [(0.9, model.pipe.transformer), (0.3, model.pipe.transformer_2)]:
        tuned, base = adapter_and_base_velocity(model, z, torch.tensor([sigma]), cond)
        assert torch.allclose(tuned, base, atol=1e-4) == (expert_of_sigma not in trained)
        assert hasattr(expert_of_sigma, "peft_config") == (expert_of_sigma in trained)


@pytest.mark.parametrize(("expert", "steps"), [("high_noise", HIGH), ("low_noise", LOW), ("both", range(6))])
@pytest.mark.parametrize("algorithm", ["grpo", "nft", "awm"])
def test_every_algorithm_trains_at_the_trained_experts_steps_only(algorithm, expert, steps, tmp_path, offline):
    """GRPO places its trained steps in the expert's (timestep_fraction of them, from its first; both experts': cut
    at the switch, so no JAGG window spans two), NFT and AWM draw theirs there (AWM from step 1); each trained
    expert's LoRA learns and a frozen expert stays as it was."""
    trainer = Trainer(expert_config(expert, algorithm, grpo__timestep_fraction=0.5), tmp_path)
    trainer.setup()
    if algorithm == "grpo":
        spans = [trainer.algorithm.trained_spans(k) for k in range(1, 4)]
        assert {tuple(trained_steps(s)) for s in spans} == {tuple(steps[:len(steps) // 2])}
        if expert == "both":
            assert spans[0] == [range(0, 2), range(2, 3)]
        rollout = trainer.rollout(1)
        assert rollout.sampled.spans == spans[0]
    else:
        drawn = trainer.algorithm.draw_steps(64, torch.Generator().manual_seed(0))
        # NFT: any of them; AWM: strata of 1 .. n (n = int(0.9 T) = 5) in them, as with one transformer
        awm = {"high_noise": {1}, "low_noise": {2, 3, 4}, "both": {1, 2, 3, 4}}[expert]
        assert set(drawn.flatten().tolist()) == (set(steps) if algorithm == "nft" else awm)
    model = trainer.model
    adapters = {id(t): [p.detach().clone() for n, p in t.named_parameters() if "lora_" in n] for t in model.denoisers}
    frozen = {id(t): [p.detach().clone() for n, p in t.named_parameters() if "lora_" not in n] for t in model.denoisers}
    trainer.fit()
    for transformer in model.denoisers:
        trained = transformer in model.trained_transformers
        assert bool(adapters[id(transformer)]) == trained
        after = [p for n, p in transformer.named_parameters() if "lora_" in n]
        assert not trained or any(not torch.equal(a, p) for a, p in zip(adapters[id(transformer)], after))
        assert all(torch.equal(a, p) for a, p in zip(frozen[id(transformer)],
                                                     (p for n, p in transformer.named_parameters() if "lora_" not in n)))


@pytest.mark.parametrize("expert", ["high_noise", "low_noise", "both"])
def test_a_run_of_either_expert_through_the_cli_loads_into_its_expert_of_the_pipeline(expert, tmp_path):
    """Each adapter file is diffusers' Wan LoRA of one transformer: the low-noise expert's loads with
    ``load_into_transformer_2=True``, as its model card says (both experts: two files, the second named with
    ``weight_name``; and the run's ``model.flow_shift`` set on the scheduler), and a push uploads them all; GRPO with
    a JAGG window of 3 at the low-noise expert's 4 steps."""
    out = tmp_path / "run"
    result = run_cli("--preset", "tiny-sd3", "--output-dir", str(out), "--set", "model.name=tiny-wan-a14b",
                     "--set", f"model.expert={expert}", "--set", "sampling.num_frames=5", "--set",
                     "sampling.resolution=32", "--set", "sampling.num_steps=6", "--set", "train.iterations=1",
                     "--set", "grpo.num_generations=2", "--set", "prompts.eval_count=2", "--set", "backward.window=3",
                     "--set", "model.max_sequence_length=16", "--set", "rewards=[{name: jpeg_compressibility}]",
                     *(["--set", "model.flow_shift=4"] if expert == "both" else []))
    assert result.returncode == 0, result.stderr[-2000:]
    run = RunDirectory(out)
    assert run.read_status()["state"] == "finished" and run.read_run_info()["expert"] == expert
    snap = read_run(out)
    card = str(build_model_card(snap, "alice/wan-a14b-lora"))
    components = {"high_noise": {LORA_FILE: "transformer"}, "low_noise": {LORA_FILE: "transformer_2"},
                  "both": {LORA_FILE: "transformer", TRANSFORMER_2_LORA_FILE: "transformer_2"}}[expert]
    assert sorted(file.name for file in run.lora_dir.iterdir()) == sorted(components)
    assert f"finished: adapter at {run.lora_file}{' and ' + TRANSFORMER_2_LORA_FILE if expert == 'both' else ''}\n" in \
        run.log_file.read_text()
    assert sorted(file.name for file in snap.adapter.files) == sorted(components)
    assert set(components) <= set(publish_files(snap, "alice/wan-a14b-lora"))
    low = expert == "low_noise"
    assert ('pipe.load_lora_weights("alice/wan-a14b-lora", load_into_transformer_2=True)' in card) == low
    if expert == "both":
        assert ('pipe.load_lora_weights("alice/wan-a14b-lora")\npipe.load_lora_weights("alice/wan-a14b-lora", '
                f'weight_name="{TRANSFORMER_2_LORA_FILE}", load_into_transformer_2=True)') in card
        assert "this adapter trains both, together at every step" in card and ", schedule shift 4.0; model dtype" in card
        assert "\npipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=4.0)  # the steps it was trained with\n" \
            in card
    else:
        assert f"this adapter is its {expert.replace('_', '-')} expert's (`pipe.transformer{'_2' if low else ''}`)" in card

    pipe = build_tiny_pipeline("tiny-wan-a14b")  # the run's base model: drawn from train.seed 0
    for filename, component in components.items():
        pipe.load_lora_weights(str(run.lora_dir), weight_name=filename, adapter_name="tuned",
                               **({"load_into_transformer_2": True} if component == "transformer_2" else {}))
    by_component = {component: filename for filename, component in components.items()}
    for component in ("transformer", "transformer_2"):
        transformer = getattr(pipe, component)
        if component not in by_component:
            assert not hasattr(transformer, "peft_config")
            continue
        saved = load_file(run.lora_dir / by_component[component])
        loaded = get_peft_model_state_dict(transformer, adapter_name="tuned")
        assert {f"transformer.{key}" for key in loaded} == set(saved)
        assert all(torch.equal(loaded[key.removeprefix("transformer.")], value) for key, value in saved.items())


def test_awm_draws_each_of_the_high_noise_experts_steps_but_the_first(tmp_path, offline):
    """10 steps: the high-noise expert's are 0, 1, 2 (sigma 1, 0.96, 0.91); AWM's strata cover ``[1, n)``, n = 9, so
    it draws 1 and 2; with n = 1 it has no step of the expert's, refused in one line."""
    trainer = Trainer(expert_config("high_noise", "awm", sampling__num_steps=10), tmp_path / "a")
    trainer.setup()
    assert trainer.model.trained_steps(trainer.sigmas) == range(0, 3)
    assert set(trainer.algorithm.draw_steps(64, torch.Generator().manual_seed(0)).flatten().tolist()) == {1, 2}
    trainer = Trainer(expert_config("high_noise", "awm", ("awm.train_timesteps=1", "awm.timestep_fraction=0.1"),
                                    sampling__num_steps=10), tmp_path / "b")
    trainer.setup()
    with pytest.raises(UserError, match=r"^AWM's steps, 1 to n - 1 with n = int\(sampling.num_steps x "
                                        r"awm.timestep_fraction\) = 1, include none of the trained expert's \(0 .. "
                                        r"2\): raise awm.timestep_fraction or train the other expert"):
        trainer.algorithm.draw_steps(1, torch.Generator().manual_seed(0))


def test_a_model_of_one_transformer_and_a_schedule_without_the_experts_steps_are_refused(tmp_path, offline):
    with pytest.raises(UserError, match=r"^model.expert=low_noise trains the low-noise expert of a two-expert model "
                                        r"\(Wan 2.2 A14B\); 'tiny-wan' has one transformer: unset model.expert$"):
        load_flow_model(ModelConfig(name="tiny-wan", expert="low_noise"), num_frames=FRAMES)
    with pytest.raises(UserError, match=r"^model.guidance_scale_2 is the CFG scale of a two-expert model's low-noise "
                                        r"steps \(Wan 2.2 A14B\); 'tiny-wan' has one transformer: unset it$"):
        load_flow_model(ModelConfig(name="tiny-wan", guidance_scale_2=3.0), num_frames=FRAMES)
    with pytest.raises(UserError, match=r"train.algorithm nft trains without classifier-free guidance \(as its "
                                        r"paper\); set model.guidance_scale 1 and unset model.guidance_scale_2"):
        expert_config("low_noise", "nft", model__guidance_scale=4.0, model__guidance_scale_2=3.0)
    with pytest.raises(UserError, match=r"model.guidance_scale_2 3.0 guides the low-noise steps alone, which "
                                        r"diffusers' Wan pipelines cannot sample \(they guide no step at "
                                        r"guidance_scale 1.0\)"):  # the model card's snippet could not sample it
        expert_config("low_noise", model__guidance_scale_2=3.0)
    pipe = build_tiny_pipeline("tiny-wan")
    pipe.register_modules(transformer_2=build_tiny_pipeline("tiny-wan").transformer)
    with pytest.raises(UserError, match="has a transformer_2 but not both experts and a boundary_ratio"):
        WanModel(pipe, ModelConfig(name="tiny-wan"), num_frames=FRAMES)
    model = load(expert="low_noise")
    with pytest.raises(UserError, match=r"^none of the 1 steps is the low_noise expert's \(the experts switch at sigma "
                                        r"0.875\): train the other expert \(model.expert\) or take more "
                                        r"sampling.num_steps$"):
        model.trained_steps(model.sigmas(1, SIZE))
    trainer = Trainer(expert_config("high_noise", grpo__timestep_fraction=0.5, grpo__trained_start=2), tmp_path)
    trainer.setup()
    with pytest.raises(UserError, match=r"grpo.trained_start 2 \+ 1 trained steps exceeds the 2 steps the trained "
                                        r"expert denoises"):
        trainer.algorithm.trained_spans(1)


def test_both_experts_are_quantized_and_planned():
    model = load(quantize="int8")
    model.release_text_encoders()  # the transformers come (quantized) once the prompts are encoded
    assert len(model.denoisers) == 2 and all(is_quantized(expert) for expert in model.denoisers)
    config = tiny_config("random:wan22-t2v-a14b@2", sampling__num_frames=5, sampling__resolution=64,
                         model__dtype="bfloat16")
    plan = plan_memory(config, trace=False)
    transformer, = (size for name, size in plan.resident.items() if name.startswith("transformer ("))
    other, = (size for name, size in plan.resident.items() if name.startswith("other expert ("))
    assert other == transformer > 0
    both = plan_memory(config.model_copy(update={"model": config.model.model_copy(update={"expert": "both"})}),
                       trace=False)
    assert [name.split(" (")[0] for name in both.resident][:2] == ["transformer", "transformer_2"]
    assert both.lora_params == 2 * plan.lora_params > 0


def test_under_sharding_the_trained_expert_waits_for_its_shards_and_the_other_comes_to_the_device_whole():
    """FSDP places each process's shard of the trained transformer itself (``place_transformer=False``); the other
    expert, frozen and unsharded, is placed as the VAE is (the meta device stands in for a GPU)."""
    model = load_flow_model(ModelConfig(name="tiny-wan-a14b", expert="low_noise", cache_text_embeddings=False),
                            device="meta", place_transformer=False, num_frames=FRAMES)
    assert {p.device.type for p in model.transformer.parameters()} == {"cpu"}
    assert {p.device.type for p in model.pipe.transformer.parameters()} == {"meta"}


def test_an_adapter_of_both_experts_is_saved_loaded_and_compared_as_its_two_files(tmp_path):
    """What a resume (``load_lora`` of a checkpoint folder), Try it and ``evaluate --against`` (``load_other_lora``)
    read: each expert's file into its expert; a folder without the low-noise file is refused in one line; the
    adapter's digest covers both files."""
    from conftest import add_moved_lora
    from jagg_core.adapters import Adapter
    model = load(expert="both")
    add_moved_lora(model)
    first = model.save_lora(tmp_path / "saved")
    assert first == tmp_path / "saved" / LORA_FILE and (tmp_path / "saved" / TRANSFORMER_2_LORA_FILE).is_file()
    states = [get_peft_model_state_dict(t) for t in model.trained_transformers]

    fresh = load(expert="both")
    fresh.add_lora(LoraConfig(rank=4, alpha=8.0))
    fresh.load_lora(tmp_path / "saved")
    for state, transformer in zip(states, fresh.trained_transformers):
        assert all(torch.equal(value, get_peft_model_state_dict(transformer)[key]) for key, value in state.items())

    z, cond = noise(model, 2), model.conditioning(PROMPTS)
    sigma = torch.tensor([0.9, 0.3])  # a row of each expert
    with torch.no_grad():
        tuned = model.velocity(z, sigma, cond)
        model.load_other_lora(first, "other")  # the same weights under another name
        model.use_adapter("other")
        other = model.velocity(z, sigma, cond)
        model.use_adapter(None)
        base = model.velocity(z, sigma, cond)
    torch.testing.assert_close(other, tuned)
    assert not torch.allclose(base[0], tuned[0], atol=1e-4) and not torch.allclose(base[1], tuned[1], atol=1e-4)

    digest = Adapter(first, None, None).digest()
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / LORA_FILE).write_bytes(first.read_bytes())
    assert Adapter(tmp_path / "one" / LORA_FILE, None, None).digest() != digest
    with pytest.raises(UserError, match=rf"^{tmp_path / 'one'} has no {TRANSFORMER_2_LORA_FILE}: an adapter of both "
                                        rf"experts \(model.expert: both\) is two files, {LORA_FILE} and "):
        fresh.load_lora(tmp_path / "one")


@pytest.mark.parametrize("algorithm", ["nft", "awm"])
def test_under_sharding_every_process_draws_the_same_steps_for_both_experts_and_its_own_noise(algorithm, tmp_path,
                                                                                              offline):
    """NFT and AWM draw each row's step: with both experts sharded, every process draws the same steps (its sharded
    experts' calls then match, each a collective), its noise its own; otherwise each process draws its own steps."""
    trainer = Trainer(expert_config("both", algorithm), tmp_path)
    trainer.setup()
    rollout = SimpleNamespace(sampled=SimpleNamespace(latents=torch.zeros(8, 2, 3, 4, 4)))
    for sharded, alike in ((True, True), (False, False)):
        plans = [type(trainer.algorithm)(replace(trainer.algorithm.ctx, rank=rank, sharding=SimpleNamespace(
            enabled=sharded))).plan(rollout, torch.zeros(8), iteration=1) for rank in (0, 1)]
        assert torch.equal(plans[0].steps, plans[1].steps) == alike
        assert not torch.equal(plans[0].noise, plans[1].noise)
    assert len(set(plans[0].steps.tolist())) > 1  # rows of both experts' steps


def test_an_adapter_of_both_experts_is_compared_with_a_runs_of_the_low_noise_expert_alone(tmp_path):
    """``evaluate --against`` a run that trained other experts: each side adapts its own run's experts, the others
    sample with their base weights (the high-noise rows of the low-noise adapter's side are the base model's)."""
    import yaml
    from conftest import add_moved_lora
    from jagg_core.evaluate import evaluate, table
    result = run_cli("--preset", "tiny-sd3", "--output-dir", str(tmp_path / "both"), "--set", "model.name=tiny-wan-a14b",
                     "--set", "model.expert=both", "--set", "sampling.num_frames=5", "--set", "sampling.resolution=32",
                     "--set", "sampling.num_steps=6", "--set", "train.iterations=1", "--set", "grpo.num_generations=2",
                     "--set", "prompts.eval_count=2", "--set", "model.max_sequence_length=16",
                     "--set", "rewards=[{name: jpeg_compressibility}]")
    assert result.returncode == 0, result.stderr[-2000:]
    low = load(expert="low_noise")
    add_moved_lora(low)
    other = RunDirectory(tmp_path / "low")  # a run of the low-noise expert alone: its config and adapter
    config = yaml.safe_load((tmp_path / "both" / "config.yaml").read_text())
    config["model"]["expert"] = "low_noise"
    other.write_config(yaml.safe_dump(config))
    low.save_lora(other.lora_dir)

    settings, scored, _ = evaluate(tmp_path / "both", images_per_prompt=1, batch=2, against=other.path)
    assert settings["against"]["expert"] == "low_noise"
    assert "against the latest adapter of `low` (of the low-noise expert; the same base model tiny-wan-a14b)" in \
        table(settings, scored)

    model = load(expert="both")
    add_moved_lora(model)
    model.load_other_lora(other.lora_file, "against", "low_noise")
    assert "against" not in model.pipe.transformer.peft_config and "against" in model.pipe.transformer_2.peft_config
    z, cond, sigma = noise(model, 2), model.conditioning(PROMPTS), torch.tensor([0.9, 0.3])  # a row of each expert
    with torch.no_grad():
        velocities = {}
        for name in (None, "against", "default"):
            model.use_adapter(name)
            velocities[name] = model.velocity(z, sigma, cond)
        alone = low.velocity(z, sigma, cond)
    torch.testing.assert_close(velocities["against"][0], velocities[None][0])  # the high-noise expert: base weights
    torch.testing.assert_close(velocities["against"][1], alone[1])
    assert not torch.allclose(velocities["default"][0], velocities[None][0], atol=1e-4)
