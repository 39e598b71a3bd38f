"""The GRPO step loss's policy losses and KL forms and the advantage options, against their formulas."""

from __future__ import annotations

import math

import pytest
import torch

from jagg_core.errors import UserError
from jagg_core.grpo import LossSettings, step_loss
from jagg_core.model_card import build_model_card, read_run
from jagg_core.rundir import RunDirectory
from jagg_core.sampler import sde_rollout
from jagg_core.trainer import Trainer

from conftest import tiny_config


class Shifted(torch.nn.Module):
    """``v = -z + shift``: the policy; with the adapters disabled, ``v = -z`` (the reference)."""

    def __init__(self):
        super().__init__()
        self.disabled = False

    def velocity(self, z, sigma, cond):
        return -z + (0 if self.disabled else 0.3)

    def adapters_disabled(self):
        model = self

        class Off:
            def __enter__(self):
                model.disabled = True

            def __exit__(self, *exc):
                model.disabled = False
        return Off()


@pytest.mark.parametrize("form", ["step", "flow_grpo"])
def test_kl_forms_equal_their_formulas(form):
    gen = torch.Generator().manual_seed(0)
    sigmas = torch.linspace(1, 0, 6) ** 1.3
    traj = sde_rollout(Shifted(), {}, sigmas, 0.8, torch.randn(4, 16, generator=gen), gen, with_reference=True)
    settings = LossSettings(clip_range=0.2, kl_beta=2.0, kl_form=form)
    for i in range(5):
        loss, stats = step_loss(traj.velocities[i], i, traj, torch.zeros(4), settings,  # A = 0: the KL term alone
                                 traj.reference_velocity(i))
        s, s_next, std_t = float(sigmas[i]), float(sigmas[i + 1]), float(traj.std_t[i])
        dt = s_next - s
        gap = 0.3 * (1 + std_t ** 2 * (1 - s) / (2 * s)) * dt  # mean_theta - mean_ref for a velocity gap of 0.3
        expected = gap ** 2 / (2 * std_t ** 2 * (abs(dt) if form == "step" else 1))
        assert float(stats["kl"]) == pytest.approx(expected, rel=1e-4)
        assert float(loss) == pytest.approx(2.0 * expected, rel=1e-4)


def test_advantage_options_equal_their_formulas():
    from jagg_core.grpo import group_advantages

    rewards = torch.tensor([1.0, 3.0, 0.0, 4.0, 2.0, 6.0])
    by_draw = group_advantages(rewards, 2, 10.0)
    stds = torch.tensor([1.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    torch.testing.assert_close(by_draw, torch.tensor([-1.0, 1.0, -2.0, 2.0, -2.0, 2.0]) / (stds + 1e-4))
    # prompts a, b, a: the first and third draws are one group of four (mean 3, std sqrt(4.5))
    by_text = group_advantages(rewards, 2, 10.0, prompts=["a", "a", "b", "b", "a", "a"])
    std_a = torch.tensor([1.0, 3.0, 2.0, 6.0]).std(unbiased=False)
    torch.testing.assert_close(by_text[[0, 1, 4, 5]], (torch.tensor([1.0, 3.0, 2.0, 6.0]) - 3) / (std_a + 1e-4))
    torch.testing.assert_close(by_text[[2, 3]], by_draw[[2, 3]])
    global_std = group_advantages(rewards, 2, 10.0, global_std=True)
    means = torch.tensor([2.0, 2.0, 2.0, 2.0, 4.0, 4.0])
    torch.testing.assert_close(global_std, (rewards - means) / (rewards.std(unbiased=False) + 1e-4))


def test_per_reward_advantages_weigh_each_reward_by_its_weight_whatever_its_spread():
    """Two rewards 50x apart in spread, weights 1 and 3: the advantage is (A_1 + 3 A_2) / 4, A_k each reward's own group
    advantage, where the advantage of their sum follows the wide one; one reward gives its group advantage."""
    from jagg_core.grpo import group_advantages, reward_advantages

    wide = torch.tensor([20.0, 22.0, 21.0, 19.0])
    narrow = torch.tensor([0.31, 0.30, 0.28, 0.30])
    each = reward_advantages([wide, narrow], [1.0, 3.0], 2, 10.0)
    a_wide, a_narrow = group_advantages(wide, 2, 10.0), group_advantages(narrow, 2, 10.0)
    torch.testing.assert_close(each, (a_wide + 3 * a_narrow) / 4)
    torch.testing.assert_close(torch.sign(each), torch.tensor([1.0, -1.0, -1.0, 1.0]))  # the narrow reward leads
    summed = group_advantages(wide + 3 * narrow, 2, 10.0)
    torch.testing.assert_close(torch.sign(summed), torch.tensor([-1.0, 1.0, 1.0, -1.0]))  # the wide one leads
    torch.testing.assert_close(reward_advantages([narrow], [2.0], 2, 10.0), a_narrow)
    torch.testing.assert_close(reward_advantages([wide, -narrow], [1.0, -1.0], 2, 10.0), (a_wide + a_narrow) / 2)
    # clamped after the mean: each A_k is about +-1, their mean about +-0.49
    torch.testing.assert_close(reward_advantages([wide, narrow], [1.0, 3.0], 2, 0.6), (a_wide + 3 * a_narrow) / 4)
    assert reward_advantages([wide, narrow], [1.0, 3.0], 2, 0.25).abs().max() == 0.25
    prompts = ["a", "a", "a", "a"]
    torch.testing.assert_close(reward_advantages([wide], [1.0], 2, 10.0, prompts=prompts),
                               group_advantages(wide, 2, 10.0, prompts=prompts))


def test_the_trainer_takes_per_reward_advantages_from_the_rollouts_reward_parts():
    from types import SimpleNamespace

    from jagg_core.grpo import reward_advantages

    parts = {"pickscore": torch.tensor([20.0, 22.0, 21.0, 19.0]), "clip_score": torch.tensor([0.31, 0.30, 0.28, 0.30])}
    rollout = SimpleNamespace(rewards=parts["pickscore"] + parts["clip_score"], reward_parts=parts,
                              prompts=["a", "a", "b", "b"])
    for multi_reward in ("per_reward", "sum"):
        config = tiny_config(grpo__multi_reward=multi_reward, grpo__num_generations=2)
        trainer = SimpleNamespace(config=config, accelerator=SimpleNamespace(device="cpu"),
                                  reward=SimpleNamespace(names=["clip_score", "pickscore"], weights=[1.0, 1.0]))
        advantages = Trainer.advantages(trainer, rollout)
        expected = (reward_advantages([parts["clip_score"], parts["pickscore"]], [1.0, 1.0], 2, 5.0)
                    if multi_reward == "per_reward" else group_advantages_of(rollout.rewards))
        torch.testing.assert_close(advantages, expected)


def test_each_rewards_weighted_spread_within_groups_says_which_leads_the_sums_advantage():
    """``reward_spread/NAME = |w| mean_g std_g(r)``, grouped as the advantages are (consecutive draws, or with
    ``group_by: prompt`` every sample of a prompt): the narrow reward, weighted 3, still gives a sum's advantage 44x
    less signal than the wide one, which leads it (the sum's advantage has the wide reward's signs)."""
    from statistics import mean, pstdev
    from types import SimpleNamespace

    parts = {"pickscore": torch.tensor([20.0, 22.0, 21.0, 19.0]), "clip_score": torch.tensor([0.31, 0.30, 0.28, 0.30])}
    rollout = SimpleNamespace(reward_parts=parts, prompts=["a", "b", "a", "b"])
    reward = SimpleNamespace(names=["pickscore", "clip_score"], weights=[1.0, -3.0])
    for group_by, members in (("draw", [[0, 1], [2, 3]]), ("prompt", [[0, 2], [1, 3]])):
        trainer = SimpleNamespace(config=tiny_config(grpo__num_generations=2, grpo__group_by=group_by), reward=reward)
        spreads = Trainer.reward_signals(trainer, rollout)
        expected = {name: abs(weight) * mean(pstdev(parts[name][members_g].tolist()) for members_g in members)
                    for name, weight in zip(reward.names, reward.weights)}
        assert spreads.keys() == {"pickscore", "clip_score"}
        for name, value in expected.items():
            assert spreads[name] == pytest.approx(value, rel=1e-5)
    assert spreads["pickscore"] > 40 * spreads["clip_score"]


def test_a_per_reward_run_trains_and_its_card_says_so(tmp_path, offline):
    config = tiny_config(grpo__multi_reward="per_reward", train__iterations=1,
                         rewards=[{"name": "jpeg_compressibility"}, {"name": "jpeg_incompressibility", "weight": 0.5}])
    trainer = Trainer(config, tmp_path)
    trainer.setup()
    trainer.fit()
    rows = [r for r in RunDirectory(tmp_path).read_metrics() if r["iteration"] > 0]
    assert len(rows) == 1 and math.isfinite(rows[0]["train/grad_norm"]) and rows[0]["train/grad_norm"] > 0
    spreads = {key: value for key, value in rows[0].items() if key.startswith("reward_spread/")}
    assert spreads.keys() == {"reward_spread/jpeg_compressibility", "reward_spread/jpeg_incompressibility"}
    # the incompressibility is the compressibility negated: the same spread, at half the weight
    compressibility = spreads["reward_spread/jpeg_compressibility"]
    assert spreads["reward_spread/jpeg_incompressibility"] == pytest.approx(compressibility / 2, rel=1e-4)
    assert compressibility > 0
    [balance] = [check for check in RunDirectory(tmp_path).read_doctor()["checks"]
                 if check["check"] == "each reward moves the advantage"]
    assert balance["status"] == "pass" and balance["detail"].endswith("(per_reward: each its weight's share)")
    card = str(build_model_card(read_run(tmp_path), "me/x"))
    assert "Each reward's own group advantage" in card
    # the card shows the doctor's checklist (RUN/doctor.json) under its results, as the page does
    assert "**First-iteration check** (iteration 1): passed\n\n- ✓ rewards are finite and vary within groups:" in card
    assert "\n- ✓ each reward moves the advantage: signal (weighted spread within groups) jpeg_compressibility" in card


def group_advantages_of(rewards):
    from jagg_core.grpo import group_advantages
    return group_advantages(rewards, 2, 5.0)


def _shifted_rollout(sde_type="flow_grpo", batch=6):
    """A rollout of ``v = -z + 0.3`` and its advantages (three of each sign)."""
    gen = torch.Generator().manual_seed(1)
    sigmas = torch.linspace(1, 0, 6) ** 1.3
    traj = sde_rollout(Shifted(), {}, sigmas, 0.8, torch.randn(batch, 16, generator=gen), gen, sde_type=sde_type)
    return traj, torch.tensor([1.5, -0.5, 0.7, -1.2, 0.2, -2.0])[:batch]


@pytest.mark.parametrize("sde_type", ["flow_grpo", "dance_grpo"])
def test_the_guard_ratio_is_the_normalized_log_ratio_and_each_step_is_weighted_by_one_over_n_dt(sde_type):
    """GRPO-Guard's ratio is exp(std log r + mean_k (mean_theta - mean_old)^2 / (2 std)) (its RatioNorm, written from
    the plain log ratio the rollout recorded), clipped as PPO's, and the step's loss is weighted 1 / (N |dt|)."""
    traj, adv = _shifted_rollout(sde_type)
    eps, n = 0.05, len(traj.sigmas) - 1
    guard = LossSettings(clip_range=eps, kl_beta=0.0, policy_loss="guard")
    for i in range(n):
        noise = torch.randn(traj.velocities[i].shape, generator=torch.Generator().manual_seed(i))
        v = traj.velocities[i] + 0.02 * noise
        s, s_next, std_t = float(traj.sigmas[i]), float(traj.sigmas[i + 1]), float(traj.std_t[i])
        std = std_t * (s - s_next) ** 0.5
        mean = traj.latents[i] + (v + std_t ** 2 / (2 * s) * (traj.latents[i] + (1 - s) * v)) * (s_next - s)
        old = traj.latents[i] + (traj.velocities[i] + std_t ** 2 / (2 * s) * (traj.latents[i] + (1 - s) *
                                                                              traj.velocities[i])) * (s_next - s)
        log_p = (-((traj.latents[i + 1] - mean) ** 2) / (2 * std ** 2)).mean(dim=1) - torch.log(torch.tensor(std)) \
            - 0.5 * torch.log(torch.tensor(2 * torch.pi))
        ratio = torch.exp(std * (log_p - traj.log_probs[i]) + ((mean - old) ** 2).mean(dim=1) / (2 * std))
        expected = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps)).mean() / (n * (s - s_next))
        loss, stats = step_loss(v, i, traj, adv, guard)
        assert float(loss) == pytest.approx(float(expected), rel=1e-4, abs=1e-7)
        assert float(stats["ratio"]) == pytest.approx(float(ratio.mean()), rel=1e-5)
        on_policy, _ = step_loss(traj.velocities[i], i, traj, adv, guard)
        assert float(on_policy) == pytest.approx(float(-adv.mean()) / (n * (s - s_next)), rel=1e-5)


def test_dppo_drops_exactly_the_samples_past_the_kl_threshold_whose_update_widens_the_gap():
    """DPPO: KL_old = mean_k (mean_theta - mean_old)^2 / (2 std^2) per sample; a sample with KL_old >= the threshold
    and ratio > 1 with A > 0 (or ratio < 1 with A < 0) adds nothing to the loss or its gradient, every other one adds
    -A ratio / B; with a threshold above every KL it is the plain policy gradient."""
    traj, adv = _shifted_rollout()
    i = 1
    s, s_next, std_t = float(traj.sigmas[i]), float(traj.sigmas[i + 1]), float(traj.std_t[i])
    std = std_t * (s - s_next) ** 0.5
    slope = (1 + std_t ** 2 * (1 - s) / (2 * s)) * (s_next - s)  # d mean / d v
    old_mean = traj.latents[i] + (traj.velocities[i] + std_t ** 2 / (2 * s) * (traj.latents[i] + (1 - s) *
                                                                              traj.velocities[i])) * (s_next - s)
    # sample b's mean moved a fraction c_b of the way to z_{i+1}: its ratio > 1, its KL grows with c_b
    gap = torch.tensor([0.0, 0.01, 0.02, 0.04, 0.06, 0.08])[:, None] * (traj.latents[i + 1] - old_mean)
    v = (traj.velocities[i] + gap / slope).requires_grad_(True)
    kl_old = (gap ** 2).mean(dim=1) / (2 * std ** 2)
    threshold = float(kl_old.sort().values[3])  # samples at or above the fourth-smallest KL are past it
    plain = LossSettings(clip_range=1.0, kl_beta=0.0, policy_loss="dppo", kl_mask_threshold=1e9)
    loss, _ = step_loss(v, i, traj, adv, plain)
    (per_sample,) = torch.autograd.grad(loss, v)
    dppo = LossSettings(clip_range=1.0, kl_beta=0.0, policy_loss="dppo", kl_mask_threshold=threshold)
    masked_loss, stats = step_loss(v, i, traj, adv, dppo)
    (masked_grad,) = torch.autograd.grad(masked_loss, v)
    with torch.no_grad():
        ratios = []
        for b in range(6):
            single, _ = step_loss(v[b:b + 1], i, traj.select(slice(b, b + 1)), torch.ones(1), plain)
            ratios.append(-float(single))
        ratio = torch.tensor(ratios)
    widening = ((ratio > 1) & (adv > 0)) | ((ratio < 1) & (adv < 0))
    dropped = (kl_old >= threshold) & widening
    assert (ratio[1:] > 1).all()  # the moved samples' ratios: the gap widens where A > 0; the KL is past from b = 3
    assert dropped.tolist() == [False, False, False, False, True, False]
    assert float(masked_loss.detach()) == pytest.approx(float((-adv * ratio * ~dropped).mean()), rel=1e-5)
    assert float(stats["clip_frac"]) == pytest.approx(float(dropped.float().mean()))
    assert masked_grad[dropped].abs().max() == 0
    torch.testing.assert_close(masked_grad[~dropped], per_sample[~dropped])


def test_on_policy_dppo_and_clip_give_the_same_gradient():
    """On-policy the ratio is 1 and KL_old 0: nothing is clipped or dropped, so dppo's gradient is clip's."""
    traj, adv = _shifted_rollout()
    grads = []
    for settings in (LossSettings(clip_range=1e-4, kl_beta=0.0),
                     LossSettings(clip_range=1e-4, kl_beta=0.0, policy_loss="dppo", kl_mask_threshold=1e-12)):
        v = traj.velocities[2].clone().requires_grad_(True)
        loss, stats = step_loss(v, 2, traj, adv, settings)
        grads.append(torch.autograd.grad(loss, v)[0])
        assert float(stats["clip_frac"]) == 0
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize("policy_loss, words", [("guard", "GRPO-Guard's normalized ratio, clip range 0.0001"),
                                                ("dppo", "DPPO's trust region, KL threshold 1e-12")])
def test_a_run_trains_with_guard_and_dppo_over_two_optimizer_steps_a_rollout(policy_loss, words, tmp_path, offline):
    """Each policy loss trains end to end with two optimizer steps on each rollout batch (the second off-policy, where
    DPPO's threshold, set below every KL here, drops the gap-widening samples) and the model card names it."""
    config = tiny_config(grpo__policy_loss=policy_loss, grpo__inner_epochs=2, grpo__kl_mask_threshold=1e-12)
    trainer = Trainer(config, tmp_path)
    trainer.setup()
    trainer.fit()
    rows = [r for r in RunDirectory(tmp_path).read_metrics() if r["iteration"] > 0]
    assert len(rows) == 2 and all(r["train/grad_norm"] > 0 and math.isfinite(r["train/grad_norm"]) for r in rows)
    if policy_loss == "dppo":  # the mean over both optimizer steps: half of them on-policy, where none is dropped
        assert all(0 < r["train/clip_frac"] < 0.5 for r in rows)
    assert f"{words}, KL beta 0.0, 2 optimizer steps per rollout" in str(build_model_card(read_run(tmp_path), "me/x"))


def test_dppo_with_one_optimizer_step_a_rollout_is_refused_in_one_line():
    """With one optimizer step per rollout batch every step is on-policy, so DPPO would never drop anything."""
    with pytest.raises(UserError, match="grpo.policy_loss dppo drops samples from the second optimizer step .* set "
                                        "grpo.inner_epochs 2 or more, or policy_loss clip"):
        tiny_config(grpo__policy_loss="dppo")


def test_the_benchs_policy_loss_setups_change_only_the_loss_and_the_optimizer_steps():
    from jagg_core.bench.training import setup_configs

    configs = setup_configs(tiny_config(), ["default", "guard", "reuse", "dppo"])
    default = configs["default"].grpo
    assert configs["guard"].grpo == default.model_copy(update={"policy_loss": "guard"})
    assert configs["reuse"].grpo == default.model_copy(update={"inner_epochs": 2})
    assert configs["dppo"].grpo == default.model_copy(update={"inner_epochs": 2, "policy_loss": "dppo"})
    assert all(config.model_copy(update={"grpo": default}) == configs["default"] for config in configs.values())


def test_a_composed_bench_setup_makes_the_changes_of_each_part():
    from jagg_core.bench.training import setup_configs, setup_label

    configs = setup_configs(tiny_config(grpo__num_generations=4), ["tree", "guard+tree", "tree+dppo"])
    assert configs["guard+tree"].grpo == configs["tree"].grpo.model_copy(update={"policy_loss": "guard"})
    assert configs["tree+dppo"].grpo == configs["tree"].grpo.model_copy(update={"inner_epochs": 2,
                                                                                 "policy_loss": "dppo"})
    assert configs["guard+tree"].model_copy(update={"grpo": configs["tree"].grpo}) == configs["tree"]
    assert setup_label("guard+tree") == "default, GRPO-Guard, tree rollout"
    assert setup_label("flow_grpo+guard") == "Flow-GRPO default, GRPO-Guard"
    with pytest.raises(UserError, match="setup tree does not apply to this task"):  # a group of 3 cannot split
        setup_configs(tiny_config(grpo__num_generations=3), ["guard+tree"])
