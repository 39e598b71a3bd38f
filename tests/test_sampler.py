"""SDE sampler: log-probabilities against the closed-form Gaussian, on-policy ratio, ODE limit."""

from __future__ import annotations

import math

import torch

from jagg_core.grpo import LossSettings, group_advantages, step_loss
from jagg_core.sampler import (gaussian_log_prob, ode_sample, sde_rollout, sde_step_mean, step_noise_std,
                               step_std)


class LinearVelocity:
    device = torch.device("cpu")

    def velocity(self, z, sigma, cond):
        return 0.5 * z - 0.2


def test_log_prob_equals_closed_form_gaussian_density():
    gen = torch.Generator().manual_seed(0)
    x, mean = torch.randn(3, 4, 5, generator=gen), torch.randn(3, 4, 5, generator=gen)
    std = 0.37
    expected = torch.distributions.Normal(mean.double(), std).log_prob(x.double()).flatten(1).mean(1)
    torch.testing.assert_close(gaussian_log_prob(x, mean, std).double(), expected, rtol=1e-6, atol=1e-6)


def test_rollout_log_probs_are_the_density_of_each_recorded_step():
    gen = torch.Generator().manual_seed(1)
    sigmas = torch.linspace(1, 0, 6)
    model = LinearVelocity()
    traj = sde_rollout(model, {}, sigmas, 0.7, torch.randn(4, 8, generator=gen), gen)
    std_t = step_noise_std(sigmas, 0.7)
    for i in range(5):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        mean = sde_step_mean(traj.latents[i], traj.velocities[i], s, s_next, float(std_t[i]))
        std = step_std(s, s_next, float(std_t[i]))
        density = torch.distributions.Normal(mean.double(), std).log_prob(traj.latents[i + 1].double())
        torch.testing.assert_close(traj.log_probs[i].double(), density.mean(1), rtol=1e-5, atol=1e-5)


def test_noise_std_follows_the_formula_and_avoids_division_by_zero_at_sigma_one():
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.0])
    std_t = step_noise_std(sigmas, 0.7)
    assert math.isclose(float(std_t[0]), 0.7 * math.sqrt(1.0 / (1 - 0.8)), rel_tol=1e-6)
    assert math.isclose(float(std_t[2]), 0.7 * math.sqrt(0.5 / 0.5), rel_tol=1e-6)
    assert torch.isfinite(std_t).all()


def test_on_policy_ratio_is_exactly_one():
    gen = torch.Generator().manual_seed(2)
    sigmas = torch.linspace(1, 0, 5)
    traj = sde_rollout(LinearVelocity(), {}, sigmas, 0.7, torch.randn(4, 8, generator=gen), gen)
    adv = group_advantages(torch.tensor([0.1, 0.5, 0.2, 0.9]), 2, 5.0)
    for i in range(4):
        _, stats = step_loss(traj.velocities[i], i, traj, adv, LossSettings(clip_range=1e-4, kl_beta=0.0))
        assert stats["ratio"].item() == 1.0 and stats["clip_frac"].item() == 0.0


def test_sde_with_zero_noise_is_the_euler_ode():
    gen = torch.Generator().manual_seed(3)
    sigmas = torch.linspace(1, 0, 5)
    z0 = torch.randn(2, 8, generator=gen)
    z = ode_sample(LinearVelocity(), {}, sigmas, z0)
    expected = z0.clone()
    for i in range(4):
        expected = expected + (0.5 * expected - 0.2) * float(sigmas[i + 1] - sigmas[i])
    torch.testing.assert_close(z, expected)
    mean = sde_step_mean(z0, 0.5 * z0 - 0.2, 1.0, 0.75, 0.0)
    torch.testing.assert_close(mean, z0 + (0.5 * z0 - 0.2) * -0.25)


def test_group_advantages_normalise_per_prompt_and_clip():
    adv = group_advantages(torch.tensor([1.0, 3.0, 10.0, 10.0]), 2, 5.0)
    torch.testing.assert_close(adv[:2], torch.tensor([-1.0, 1.0]) / (1 + 1e-4))
    torch.testing.assert_close(adv[2:], torch.zeros(2))
    clipped = group_advantages(torch.tensor([0.0] * 99 + [1.0]), 100, 2.0)
    assert clipped.max() == 2.0


def test_rollout_with_sde_steps_takes_the_ode_step_after_them():
    gen = torch.Generator().manual_seed(4)
    sigmas = torch.linspace(1, 0, 7)
    z0 = torch.randn(3, 8, generator=gen)
    state = gen.get_state()
    traj = sde_rollout(LinearVelocity(), {}, sigmas, 0.7, z0, gen, sde_steps=2)
    full = sde_rollout(LinearVelocity(), {}, sigmas, 0.7, z0, torch.Generator().set_state(state))
    assert (traj.std_t[:2] > 0).all() and (traj.std_t[2:] == 0).all() and (full.std_t > 0).all()
    torch.testing.assert_close(traj.latents[:3], full.latents[:3])  # the same SDE steps first
    torch.testing.assert_close(traj.log_probs[:2], full.log_probs[:2])
    for i in range(2, 6):
        euler = traj.latents[i] + traj.velocities[i] * float(sigmas[i + 1] - sigmas[i])
        torch.testing.assert_close(traj.latents[i + 1], euler)
        assert (traj.log_probs[i] == 0).all()
    assert not torch.allclose(full.latents[3], full.latents[2] + full.velocities[2] * float(sigmas[3] - sigmas[2]))
