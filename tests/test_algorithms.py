"""The forward-process algorithms (DiffusionNFT, AWM) behind the trainer's one seam: their losses against independent
float64 computations of the papers' formulas, their draws, two training iterations on every family, a held-out
gain on the embedded task, and the config's refusals of meaningless combinations."""

from __future__ import annotations

import pytest
import torch

from jagg_core import metrics
from jagg_core.algorithms import ALGORITHMS
from jagg_core.algorithms.awm import stratified_steps
from jagg_core.config import ALGORITHM_KEYS, RunConfig, load_config
from jagg_core.errors import UserError
from jagg_core.memory_meter import measured_peak
from jagg_core.memory_plan import plan_memory
from jagg_core.model_card import build_model_card, read_run
from jagg_core.rundir import TRAINING_STATE_FILE, RunDirectory
from jagg_core.trainer import Trainer

from conftest import run_cli, tiny_config

FORWARD_PROCESS = ["nft", "awm"]
#: iterations of the short run on the embedded task
SHORT_RUN = 6


def algorithm_config(algorithm: str, model: str = "tiny-sd3", **overrides) -> RunConfig:
    """:func:`tiny_config` under ``algorithm`` (the GRPO-only keys back at their defaults; AWM's steps fit the 6-step
    schedule), with ``section__key=value`` overrides."""
    settings = {"awm__train_timesteps": 2} if algorithm == "awm" else {}
    settings.update(overrides)
    return tiny_config(model).for_algorithm(algorithm, [f"{k.replace('__', '.')}={v}" for k, v in settings.items()])


def set_up(config: RunConfig, run_dir) -> Trainer:
    trainer = Trainer(config, run_dir)
    trainer.setup()
    return trainer


def perturbed(trainer: Trainer, scale: float = 0.05) -> None:
    """Move the LoRA and the algorithm's lagging copy off their initial values (the LoRA starts as the base model:
    its B matrices are zero), to different points, so every velocity of the loss differs."""
    generator = torch.Generator().manual_seed(7)
    lag = trainer.algorithm.lag
    with torch.no_grad():
        for param, lagging in zip(trainer.params, lag.weights):
            param.add_(scale * torch.randn(param.shape, generator=generator))
            lagging.copy_(param + scale * torch.randn(param.shape, generator=generator))


def velocities_of_rows(trainer: Trainer, rollout, plan, policy=None) -> tuple[torch.Tensor, ...]:
    """x0, eps, sigma, advantage row by row and the model's velocity at every row (with grad unless ``policy``)."""
    x0 = rollout.sampled.latents[plan.samples].float()
    sigma = plan.sigmas
    t = sigma.view(-1, *([1] * (x0.dim() - 1)))
    x_t = (1 - t) * x0 + t * plan.noise
    cond = {k: v[plan.samples] for k, v in rollout.cond.items()}
    if policy is None:
        return x0, plan.noise, sigma, x_t, trainer.model.velocity(x_t, sigma, cond).float()
    with torch.no_grad(), policy():
        return trainer.model.velocity(x_t, sigma, cond).float()


def nft_loss_by_hand(v, v_old, v_ref, x0, eps, sigma, advantages, beta, clip, kl_beta):
    """DiffusionNFT's loss (train_nft_sd3.py), row by row in float64."""
    rows = []
    for i in range(len(sigma)):
        s = float(sigma[i])
        x_t = (1 - s) * x0[i].double() + s * eps[i].double()
        r = min(max(float(advantages[i]) / clip / 2 + 0.5, 0.0), 1.0)
        vi, vo = v[i].double(), v_old[i].double()
        terms = []
        for prediction in (beta * vi + (1 - beta) * vo, (1 + beta) * vo - beta * vi):
            x0_hat = x_t - s * prediction
            weight = max(float((x0_hat - x0[i].double()).abs().mean().detach()), 1e-5)
            terms.append(((x0_hat - x0[i].double()) ** 2).mean() / weight)
        rows.append(clip * (r * terms[0] + (1 - r) * terms[1]) / beta)
    kl = torch.stack([((v[i].double() - v_ref[i].double()) ** 2).mean() for i in range(len(sigma))]).mean()
    return torch.stack(rows).mean() + kl_beta * kl


def awm_loss_by_hand(v, v_ref, v_ema, x0, eps, sigma, advantages, awm, clip):
    """AWM's loss (train_sd3_awm.py, ghuber weighting, on-policy), row by row in float64."""
    rows = []
    for i in range(len(sigma)):
        error = ((v[i].double() - (eps[i].double() - x0[i].double())) ** 2).mean()
        p = awm.ghuber_power
        log_likelihood = -((error + 1e-10) ** p - 1e-10 ** p) * float(sigma[i]) / p
        ratio = torch.exp(log_likelihood - log_likelihood.detach())
        rows.append(-(float(advantages[i]) / clip * awm.advantage_max) * ratio)
    distance = [torch.stack([((v[i].double() - other[i].double()) ** 2).mean() for i in range(len(sigma))]).mean()
                for other in (v_ref, v_ema)]
    return torch.stack(rows).mean() + awm.kl_beta * distance[0] + awm.ema_kl_beta * distance[1]


def gradient(params) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in params])


@pytest.mark.parametrize("algorithm", FORWARD_PROCESS)
def test_the_loss_and_its_gradient_are_the_formula_computed_independently_in_float64(algorithm, tmp_path, offline):
    # two micro-batches: the rows are split, and the shares must add up to the whole batch's mean
    trainer = set_up(algorithm_config(algorithm, train__gradient_accumulation_steps=2), tmp_path / "run")
    perturbed(trainer)
    rollout = trainer.rollout(1)
    advantages = trainer.advantages(rollout)
    assert advantages.abs().sum() > 0
    plan = trainer.algorithm.plan(rollout, advantages, 1)
    stats = trainer.algorithm.backward(rollout, advantages, plan, 0)
    ours = gradient(trainer.params).clone()
    for param in trainer.params:
        param.grad = None

    # the companions first: swapping a lagging copy in and out writes the LoRA parameters in place
    v_ref = velocities_of_rows(trainer, rollout, plan, trainer.model.adapters_disabled)
    v_lag = velocities_of_rows(trainer, rollout, plan, trainer.algorithm.lag.swapped_in)
    x0, eps, sigma, _, v = velocities_of_rows(trainer, rollout, plan)
    row_advantages = advantages[plan.samples]
    cfg = trainer.config
    if algorithm == "nft":
        v_old = v_lag
        assert (v - v_old).abs().max() > 1e-4 and (v - v_ref).abs().max() > 1e-4
        loss = nft_loss_by_hand(v, v_old, v_ref, x0, eps, sigma, row_advantages, cfg.nft.beta, cfg.grpo.adv_clip,
                                cfg.nft.kl_beta)
    else:
        v_ema = v_lag
        assert (v - v_ema).abs().max() > 1e-4 and (v - v_ref).abs().max() > 1e-4
        loss = awm_loss_by_hand(v, v_ref, v_ema, x0, eps, sigma, row_advantages, cfg.awm, cfg.grpo.adv_clip)
    loss.backward()
    assert stats[metrics.LOSS] == pytest.approx(loss.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(ours, gradient(trainer.params), rtol=1e-4, atol=1e-7)


def test_nft_updates_per_rollout_train_every_sample_at_its_part_of_the_steps_and_count_optimizer_steps(tmp_path,
                                                                                                       offline):
    """Two updates per rollout: each sample's four drawn steps are cut in two in order, step s's gradient is the loss
    of the rows of part s alone, and the old policy's decay counts both optimizer steps of the iteration."""
    config = algorithm_config("nft", sampling__num_steps=6, nft__timestep_fraction=0.67, nft__updates_per_rollout=2,
                              nft__old_decay_rate=0.25, nft__old_decay_max=0.9, nft__kl_beta=0)
    trainer = set_up(config, tmp_path / "run")
    perturbed(trainer)
    rollout = trainer.rollout(1)
    advantages = trainer.advantages(rollout)
    plan = trainer.algorithm.plan(rollout, advantages, 1)
    samples = rollout.sampled.latents.shape[0]
    assert trainer.algorithm.optimizer_steps == 2
    assert plan.updates.tolist() == [0, 0, 1, 1] * samples
    trainer.algorithm.backward(rollout, advantages, plan, 1)
    ours = gradient(trainer.params).clone()
    for param in trainer.params:
        param.grad = None
    part = plan.updates == 1
    v_old = velocities_of_rows(trainer, rollout, plan, trainer.algorithm.lag.swapped_in)[part]
    x0, eps, sigma, _, v = velocities_of_rows(trainer, rollout, plan)
    loss = nft_loss_by_hand(v[part], v_old, v_old, x0[part], eps[part], sigma[part], advantages[plan.samples][part],
                            config.nft.beta, config.grpo.adv_clip, 0.0)
    loss.backward()
    torch.testing.assert_close(ours, gradient(trainer.params), rtol=1e-4, atol=1e-7)

    lagging = [w.clone() for w in trainer.algorithm.lag.weights]
    trainer.algorithm.after_update(1)  # d = min(0.9, 0.25 x 2 optimizer steps) = 0.5
    for after, before, param in zip(trainer.algorithm.lag.weights, lagging, trainer.params):
        torch.testing.assert_close(after, 0.5 * before + 0.5 * param.detach())


def test_nft_trains_each_sample_at_distinct_steps_of_the_schedule_and_awm_stratified_ones():
    config = algorithm_config("nft")
    steps = config.sampling.num_steps
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([torch.randperm(steps, generator=generator)[:5] for _ in range(3)])
    assert all(len(set(row.tolist())) == 5 for row in draws)
    # AWM: with 10 steps and fraction 0.9 the strata of 1..9 are [1], [2], [3, 4], [5], [6], [7, 8]
    strata = stratified_steps(6, 9, 400, torch.Generator().manual_seed(0))
    assert [sorted(set(column.tolist())) for column in strata.T] == [[1], [2], [3, 4], [5], [6], [7, 8]]


@pytest.mark.parametrize("algorithm", FORWARD_PROCESS)
def test_the_rollout_samples_with_the_policy_the_paper_says(algorithm, tmp_path, offline):
    """NFT samples with the lagging old policy, AWM on-policy: the same noise gives different samples after the
    trained weights move, for AWM only."""
    trainer = set_up(algorithm_config(algorithm), tmp_path / "run")
    before = trainer.rollout(1).sampled.latents
    with torch.no_grad():
        for param in trainer.params:
            param.add_(0.1)
    after = trainer.rollout(1).sampled.latents
    assert torch.equal(before, after) == (algorithm == "nft")


EDITING = {"prompts__source": "edits", "model__condition_resolution": 16, "model__max_sequence_length": 64}
#: every family's tiny model (and an int8 base) with the settings it trains with in the tests
CASES = {
    "tiny-sd3": ("tiny-sd3", {}), "tiny-flux": ("tiny-flux", {}), "tiny-qwen": ("tiny-qwen", {}),
    "tiny-flux-int8": ("tiny-flux", {"model__quantize": "int8"}),
    "tiny-flux-kontext": ("tiny-flux-kontext", EDITING), "tiny-qwen-edit": ("tiny-qwen-edit", EDITING),
    "tiny-qwen-edit-plus": ("tiny-qwen-edit-plus", EDITING),
    "tiny-wan": ("tiny-wan", {"sampling__num_frames": 5}),
    "tiny-flux2": ("tiny-flux2", {"prompts__source": "few"}), "tiny-zimage": ("tiny-zimage", {"prompts__source": "few"}),
}


@pytest.mark.parametrize("algorithm", FORWARD_PROCESS)
@pytest.mark.parametrize("case", list(CASES))
def test_two_iterations_on_every_family(case, algorithm, tmp_path, offline):
    family_model, settings = CASES[case][0], dict(CASES[case][1])
    if settings.get("prompts__source") == "few":  # set-up encodes every prompt; FLUX.2's encoder is deep
        path = tmp_path / "prompts.txt"
        path.write_text("".join(f"a {colour} {shape}\n" for colour in ("red", "blue") for shape in ("cat", "cup")))
        settings["prompts__source"] = str(path)
    config = algorithm_config(algorithm, family_model, sampling__num_steps=4, **settings)
    trainer = set_up(config, tmp_path / "run")
    before = [p.detach().clone() for p in trainer.params]
    trainer.fit()
    rows = RunDirectory(tmp_path / "run").read_metrics()
    assert [r[metrics.ITERATION] for r in rows] == [0, 1, 2]
    assert all(r[metrics.SKIPPED] is False and r[metrics.GRAD_NORM] > 0 and metrics.POLICY_LOSS in r
               for r in rows[1:])
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.params))
    state = torch.load(RunDirectory(tmp_path / "run").latest_checkpoint() / TRAINING_STATE_FILE, weights_only=False)
    assert trainer.algorithm.state_key in state
    card = build_model_card(read_run(tmp_path / "run"), "alice/lora")
    name = {"nft": "DiffusionNFT", "awm": "Advantage Weighted Matching"}[algorithm]
    assert f"fine-tuned with {name}" in str(card) and algorithm in card.data.tags and "jagg" not in card.data.tags
    assert f"**{'DiffusionNFT' if algorithm == 'nft' else 'AWM'}:**" in str(card) and "**Backward:**" not in str(card)
    assert algorithm == "nft" or "2 trained steps per sample" in str(card)


def test_a_rollout_in_chunks_samples_what_one_batch_does(tmp_path, offline):
    trainer = set_up(algorithm_config("awm"), tmp_path / "run")
    whole = trainer.rollout(1).sampled.latents
    trainer.config.sampling.rollout_chunk = 3
    torch.testing.assert_close(trainer.rollout(1).sampled.latents, whole, rtol=1e-5, atol=1e-6)


def test_every_algorithm_of_the_config_is_registered():
    choices = RunConfig.model_fields["train"].annotation.model_fields["algorithm"].annotation.__args__
    assert set(choices) == set(ALGORITHMS) == set(ALGORITHM_KEYS)


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.algorithm=nft", "backward.window=3"], "backward.window 3 applies to train.algorithm grpo only"),
    (["train.algorithm=awm", "sampling.noise_level=1.2"], "sampling.noise_level 1.2 applies to train.algorithm grpo"),
    (["nft.beta=0.5"], "nft.beta 0.5 applies to train.algorithm nft only"),
    (["train.algorithm=nft", "awm.kl_beta=0"], "awm.kl_beta 0.0 applies to train.algorithm awm only"),
    (["train.algorithm=nft", "model.guidance_scale=4.5"], "trains without classifier-free guidance"),
    (["train.algorithm=awm", "awm.train_timesteps=12"], "awm.train_timesteps 12 must be at most the 9 steps"),
    (["train.algorithm=nft", "nft.timestep_fraction=0.3", "nft.updates_per_rollout=4"],
     "nft.updates_per_rollout 4 must be at most the 3 steps"),
])
def test_meaningless_combinations_are_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(preset="tiny-sd3", overrides=overrides)


@pytest.mark.parametrize(("preset", "steps"), [("flux2-klein-pickscore-24gb", 3), ("flux-schnell-aesthetic", 3),
                                               ("sd35-medium-pickscore", 6)])
def test_awm_trains_the_papers_six_steps_a_sample_by_default_or_every_step_of_a_shorter_schedule(preset, steps):
    """The 4-step presets take AWM with no setting of their own: steps 1..int(4 x 0.9), all 3 of them."""
    config = load_config(preset=preset).for_algorithm("awm", ["model.guidance_scale=1"])
    assert config.awm.train_timesteps is None and config.awm.steps_per_sample(config.sampling.num_steps) == steps
    assert ALGORITHMS["awm"].steps_per_sample(config) == steps
    assert config.for_algorithm("awm", ["awm.train_timesteps=2"]).awm.steps_per_sample(4) == 2


def test_awm_on_a_schedule_too_short_to_train_says_what_to_raise():
    with pytest.raises(UserError, match=r"train.algorithm awm trains at steps 1..int\(sampling.num_steps x "
                                        r"awm.timestep_fraction\), none at 2 steps and fraction 0.4; raise "
                                        r"sampling.num_steps or awm.timestep_fraction"):
        load_config(preset="tiny-sd3", overrides=["train.algorithm=awm", "sampling.num_steps=2",
                                                  "awm.timestep_fraction=0.4"])


@pytest.mark.parametrize(("algorithm", "settings"), [("nft", {}), ("awm", {}),
                                                    ("nft", {"nft__updates_per_rollout": 3})])
def test_the_plan_counts_the_rows_and_companions_within_25_percent_of_the_measured_peak(algorithm, settings,
                                                                                         tmp_path, offline):
    """With updates per rollout, an optimizer step's micro-batch holds only its part of the rows."""
    config = algorithm_config(algorithm, sampling__resolution=64, grpo__num_generations=4, **settings)
    trainer = set_up(config, tmp_path / "run")
    measured = measured_peak(trainer)
    planned = plan_memory(config).total
    assert 0.75 <= planned / measured <= 1.25, f"planned {planned / 1e6:.2f} MB, measured {measured / 1e6:.2f} MB"


@pytest.mark.parametrize("algorithm", FORWARD_PROCESS)
def test_the_preset_raises_the_held_out_reward_of_the_embedded_model_in_a_short_run(algorithm, tmp_path):
    """Through the CLI: the shapes-ALGORITHM preset, shortened, raises the fixed-seed eval reward of 16 held-out
    prompts."""
    result = run_cli("--preset", f"shapes-{algorithm}", "--output-dir", str(tmp_path / "run"),
                     "--set", f"train.iterations={SHORT_RUN}", "--set", f"train.sample_every={SHORT_RUN}",
                     "--set", "prompts.eval_count=16", timeout=1800)
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [row[metrics.EVAL_REWARD_MEAN] for row in RunDirectory(tmp_path / "run").read_metrics()
             if metrics.EVAL_REWARD_MEAN in row]
    assert evals[-1] > evals[0] + 0.01, evals  # the base model's eval, then every quarter of the short run


def test_the_bench_trains_each_forward_process_setup_as_its_preset_on_the_benchs_model():
    from jagg_core.bench.training import backward_label, setup_configs

    configs = setup_configs(tiny_config(), ["default", *FORWARD_PROCESS])
    for algorithm in FORWARD_PROCESS:
        preset = load_config(preset=f"shapes-{algorithm}")
        config = configs[algorithm]
        assert config.model.name == "tiny-sd3" and config.train.algorithm == algorithm
        assert getattr(config, algorithm) == getattr(preset, algorithm)
        assert config.train == preset.train.model_copy(update={"doctor": False}) and config.eval.judges == []
        assert backward_label(config) == "forward process"
    assert backward_label(configs["default"]) == "cached W=3"

    # the bench's --set reaches every setup, and a key of one algorithm can be set when only its setup is trained
    changed = setup_configs(tiny_config(), ["default", *FORWARD_PROCESS], overrides=["train.iterations=7"])
    assert {config.train.iterations for config in changed.values()} == {7}
    assert setup_configs(tiny_config(), ["nft"], overrides=["nft.old_decay_delay=75"])["nft"].nft.old_decay_delay == 75
    with pytest.raises(UserError, match="nft.old_decay_delay 75 applies to train.algorithm nft only"):
        setup_configs(tiny_config(), ["default", "nft"], overrides=["nft.old_decay_delay=75"])


def test_the_page_form_switches_algorithm_and_shows_only_its_knobs(tmp_path):
    """Choosing DiffusionNFT on the default preset's form: the config trains NFT with the GRPO-only knobs back at
    their defaults (the preset's backward.window 3 included), and the page hides GRPO's knobs and AWM's."""
    from app.form import KNOBS, build_config, preset_form
    from app.ui import algorithm_chosen

    form = preset_form("shapes")
    form.knobs["train.algorithm"] = "nft"
    form.knobs["nft.beta"] = 0.5
    config = build_config(form, tmp_path)
    assert config.train.algorithm == "nft" and config.nft.beta == 0.5
    assert config.backward == RunConfig().backward and config.sampling.noise_level == RunConfig().sampling.noise_level
    shown = {knob.key for knob, update in zip(KNOBS, algorithm_chosen("nft")) if update["visible"]}
    assert {"train.algorithm", "nft.beta", "train.learning_rate", "grpo.num_generations"} <= shown
    assert not shown & {"backward.window", "sampling.noise_level", "grpo.kl_beta", "awm.kl_beta"}
    assert {"backward.window", "grpo.kl_beta"} <= {knob.key for knob, update in zip(KNOBS, algorithm_chosen("grpo"))
                                                  if update["visible"]}
