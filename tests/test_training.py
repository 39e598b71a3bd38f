"""Training through the Trainer: one iteration per family, adapter reload, resume, non-finite guards."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from jagg_core import metrics
from jagg_core.image_size import ImageSize
from jagg_core.models import build_tiny_pipeline
from jagg_core.rundir import RunDirectory
from jagg_core.errors import UserError
from jagg_core.host import cpu_name
from jagg_core.trainer import MAX_NON_FINITE_STREAK, Trainer

from conftest import ROOT, tiny_config


def train(config, run_dir, resume=False) -> Trainer:
    trainer = Trainer(config, run_dir, resume=resume)
    trainer.setup()
    trainer.fit()
    return trainer


def probe_output(transformer_velocity, model, seed=5):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn((2, *model.latent_shape(ImageSize.square(32))), generator=gen)
    cond = model.conditioning(list(model.cached_embeddings)[:2])  # prompts of the run: the encoders are released
    with torch.no_grad():
        return transformer_velocity(z, torch.tensor([0.7, 0.3]), {k: v for k, v in cond.items()})


def reloaded_output(trainer: Trainer, family_model: str, lora_dir) -> torch.Tensor:
    """:func:`probe_output` of a fresh tiny pipeline (the trainer's base weights) with the adapter in ``lora_dir``
    loaded by diffusers' ``load_lora_weights``."""
    model = trainer.model
    fresh = build_tiny_pipeline(family_model, seed=trainer.config.train.seed)
    fresh.load_lora_weights(str(lora_dir))
    model.pipe, original = fresh, model.pipe
    try:
        return probe_output(model.velocity, model)
    finally:
        model.pipe = original


@pytest.mark.parametrize("family_model", ["tiny-sd3", "tiny-flux", "tiny-qwen"])
def test_one_iteration_per_family_and_the_adapter_reloads_in_diffusers(family_model, tmp_path, offline):
    trainer = train(tiny_config(family_model, train__iterations=1), tmp_path / "run")
    run = RunDirectory(tmp_path / "run")
    rows = run.read_metrics()
    assert [r["iteration"] for r in rows] == [0, 1]
    assert all(k in rows[1] for k in (metrics.REWARD_MEAN, metrics.LOSS, metrics.GRAD_NORM, metrics.JAGG_WINDOWS,
                                      metrics.EVAL_REWARD_MEAN, metrics.TIME_EVAL))
    assert rows[1][metrics.SKIPPED] is False and rows[1][metrics.GRAD_NORM] > 0
    assert run.read_status()["state"] == "finished"
    assert (run.samples_dir(0) / "000.png").is_file() and (run.samples_dir(1) / "prompts.json").is_file()

    model = trainer.model
    trained = probe_output(model.velocity, model)
    with model.adapters_disabled():
        base = probe_output(model.velocity, model)
    assert not torch.allclose(trained, base), "the adapter must have changed the model"

    torch.testing.assert_close(reloaded_output(trainer, family_model, run.lora_dir), trained, rtol=1e-4, atol=1e-5)


def test_resume_continues_at_the_next_iteration_with_the_same_optimizer_state(tmp_path, offline):
    straight = tmp_path / "straight"
    train(tiny_config(train__iterations=3), straight)
    interrupted = tmp_path / "interrupted"
    train(tiny_config(train__iterations=2), interrupted)
    resumed = train(tiny_config(train__iterations=3), interrupted, resume=True)
    assert resumed.start_iteration == 3
    rows = RunDirectory(interrupted).read_metrics()
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    a = load_file(straight / "lora" / "pytorch_lora_weights.safetensors")
    b = load_file(interrupted / "lora" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7)
    state = torch.load(interrupted / "checkpoints" / "iter_000003" / "optimizer.pt", weights_only=True)
    assert all(s["step"] == 3 for s in state["state"].values())


def test_a_dora_of_rslora_scale_trains_its_magnitudes_resumes_to_the_same_weights_and_reloads_in_diffusers(
        tmp_path, offline):
    kind = {"lora__use_dora": True, "lora__use_rslora": True}
    straight = train(tiny_config(**kind), tmp_path / "straight")
    train(tiny_config(train__iterations=1, **kind), tmp_path / "interrupted")
    train(tiny_config(**kind), tmp_path / "interrupted", resume=True)
    a = load_file(tmp_path / "straight" / "lora" / "pytorch_lora_weights.safetensors")
    b = load_file(tmp_path / "interrupted" / "lora" / "pytorch_lora_weights.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7)

    transformer = straight.model.transformer
    magnitudes = {key.removeprefix("transformer.").removesuffix(".lora_magnitude_vector"): value
                  for key, value in a.items() if key.endswith(".lora_magnitude_vector")}
    assert len(magnitudes) == sum(1 for n, _ in transformer.named_modules() if n.endswith(".lora_magnitude_vector"))
    started = {name: transformer.get_submodule(name).base_layer.weight.norm(dim=1) for name in magnitudes}  # ||W||
    moved = {name for name in magnitudes if not torch.allclose(magnitudes[name], started[name])}
    reached = {name for name in magnitudes if a[f"transformer.{name}.lora_B.weight"].any()}  # B starts at 0
    assert len(reached) > len(magnitudes) // 2 and moved == reached  # m is trained wherever the gradient reaches

    trained = probe_output(straight.model.velocity, straight.model)
    reloaded = reloaded_output(straight, "tiny-sd3", tmp_path / "straight" / "lora")
    torch.testing.assert_close(reloaded, trained, rtol=1e-4, atol=1e-5)


def lora_snapshot(trainer):
    return [p.detach().clone() for p in trainer.params]


def test_non_finite_reward_skips_the_update(tmp_path, offline):
    trainer = Trainer(tiny_config(train__iterations=1), tmp_path / "run")
    trainer.setup()
    real_reward = trainer.reward

    class NanReward:
        names, weights = ["nan"], [1.0]

        def __call__(self, images, prompts):
            return torch.full((len(prompts),), float("nan")), {"nan": torch.full((len(prompts),), float("nan"))}

    trainer.reward = NanReward()
    before = lora_snapshot(trainer)
    with pytest.warns(UserWarning, match="non-finite reward"):
        row = trainer.iteration(1)
    assert row[metrics.SKIPPED] is True
    for old, new in zip(before, trainer.params):
        assert torch.equal(old, new)
    with pytest.warns(UserWarning, match="non-finite reward"):
        for iteration in range(2, MAX_NON_FINITE_STREAK):
            trainer.iteration(iteration)
    with pytest.raises(UserError, match=f"non-finite in {MAX_NON_FINITE_STREAK} iterations in a row"):
        trainer.iteration(MAX_NON_FINITE_STREAK)
    trainer.reward = real_reward


def test_non_finite_gradient_skips_the_update_and_never_reaches_the_adapter(tmp_path, offline):
    trainer = Trainer(tiny_config(train__iterations=1), tmp_path / "run")
    trainer.setup()
    trainer.params[0].register_hook(lambda grad: grad * float("nan"))
    before = lora_snapshot(trainer)
    with pytest.warns(UserWarning, match="non-finite gradient"):
        row = trainer.iteration(1)
    assert row[metrics.SKIPPED] is True
    for old, new in zip(before, trainer.params):
        assert torch.equal(old, new)
    trainer.save_checkpoint(1)
    saved = load_file(tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors")
    assert all(torch.isfinite(t).all() for t in saved.values())


def test_exact_and_jagg_runs_write_their_backward_statistics(tmp_path, offline):
    train(tiny_config(backward__mode="exact", train__iterations=1), tmp_path / "exact")
    train(tiny_config(backward__window=3, backward__shared_knots=True, train__iterations=1), tmp_path / "jagg")
    exact = RunDirectory(tmp_path / "exact").read_metrics()[1]
    jagg = RunDirectory(tmp_path / "jagg").read_metrics()[1]
    assert exact[metrics.BACKWARD_PASSES] == 6 and exact[metrics.JAGG_ROUTED_FRAC] == 0.0
    assert jagg[metrics.JAGG_WINDOWS] == 3 and jagg[metrics.BACKWARD_PASSES] == 4  # K + 1 knots for K = 3
    assert 0.0 < jagg[metrics.JAGG_LINEARITY_MEAN] <= 1.0
    config = json.loads((tmp_path / "jagg" / "run_info.json").read_text())
    assert config == {"family": "sd3", "base_model": "tiny-sd3",
                      "hardware": f"{cpu_name()} ({torch.get_num_threads()} threads)", "processes": 1,
                      "text_windows": [{"encoder": "CLIP", "tokens": 77, "setting": None, "prompts": 320, "longer": 0,
                                        "longest": 60}],  # the general set's prompts all fit tiny-sd3's CLIP
                      "expert": None}  # one transformer


def test_a_run_names_the_cpu_it_trains_on_as_linux_describes_it(tmp_path):
    """A run reproduces to the digit on one kind of CPU, not across kinds: its run_info.json and model card name it."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC  7B13 64-Core Processor\n\n"
                       "processor\t: 1\nmodel name\t: AMD EPYC 7B13 64-Core Processor\n")
    assert cpu_name(cpuinfo) == "AMD EPYC 7B13 64-Core Processor"
    cpuinfo.write_text("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\n")  # many ARM machines
    assert cpu_name(cpuinfo) == "CPU" and cpu_name(tmp_path / "absent") == "CPU"


#: a fresh process's first vector-math call on two threads (24,576 float64 sines, in chunks of 2,048), against the same
#: call again
FIRST_SINES = """
import torch
from jagg_core.kernels import settle_cpu_math
settle_cpu_math()
torch.set_num_threads(2)
x = torch.linspace(0.05, 7.75, 24576, dtype=torch.float64)
print(torch.equal(torch.sin(x), torch.sin(x.clone())))
"""


def test_a_fresh_processs_first_vector_math_call_gives_the_bits_of_the_next():
    """MKL's vector math, set up by its first call on several threads at once, can compute one thread's chunks at lower
    precision in about a third of fresh processes (it made SD3's positional embedding, and so the adapter, differ
    between two runs of one seed). After ``settle_cpu_math`` the first call equals the next in each of ten."""
    answers = [subprocess.run([sys.executable, "-c", FIRST_SINES], cwd=ROOT, capture_output=True, text=True,
                              timeout=120).stdout.strip() for _ in range(10)]
    assert answers == ["True"] * 10
