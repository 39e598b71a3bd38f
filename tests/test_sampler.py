"""SDE sampler: rollouts against an independent oracle of Flow-GRPO's SDE step, log-probabilities against the
closed-form Gaussian, on-policy ratio, ODE limit."""

from __future__ import annotations

import contextlib
import math
import typing

import pytest
import torch

from jagg_core.config import SamplingConfig
from jagg_core.grpo import LossSettings, group_advantages, step_loss
from jagg_core.sampler import ode_sample, sde_rollout
from jagg_core.sde import STEPS, gaussian_log_prob


class LinearVelocity:
    device = torch.device("cpu")

    def velocity(self, z, sigma, cond):
        return 0.5 * z - 0.2


class NonlinearVelocity:
    """A velocity that depends on the latent non-linearly and on sigma, so a wrong sigma or a dropped drift term
    shows."""

    device = torch.device("cpu")

    @staticmethod
    def field(z, sigma):
        return torch.tanh(1.5 * z) * (0.3 + sigma) - 0.4 * z + 0.25

    def velocity(self, z, sigma, cond):
        return self.field(z, sigma)


def flow_grpo_sde_step(z, v, sigma, sigma_next, sigma_max, noise_level):
    """One SDE step written out from Flow-GRPO's ``sde_step_with_logprob`` (sde_type='sde'), in float64:
    ``std_dev_t = a sqrt(sigma / (1 - sigma))`` (sigma = 1 uses ``sigma_max`` = sigmas[1] in the denominator),
    ``mean = z (1 + std_dev_t^2 / (2 sigma) dt) + v (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt`` and the
    transition's standard deviation ``std_dev_t sqrt(-dt)``. Returns (mean, std)."""
    dt = sigma_next - sigma
    std_dev_t = noise_level * math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma)))
    z, v = z.double(), v.double()
    mean = z * (1 + std_dev_t ** 2 / (2 * sigma) * dt) + v * (1 + std_dev_t ** 2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_dev_t * math.sqrt(-dt)


def flow_cps_step(z, v, sigma, sigma_next, noise_level):
    """One step written out from Flow-CPS's ``sde_step_with_logprob`` (sde_type='cps'), in float64: ``std_dev_t =
    sigma_prev sin(a pi / 2)``, ``x0 = z - sigma v``, ``x1 = z + (1 - sigma) v`` and ``mean = x0 (1 - sigma_prev) +
    x1 sqrt(sigma_prev^2 - std_dev_t^2)``. Returns (mean, std)."""
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    z, v = z.double(), v.double()
    x0, x1 = z - sigma * v, z + (1 - sigma) * v
    return x0 * (1 - sigma_next) + x1 * math.sqrt(sigma_next ** 2 - std ** 2), std


def dance_grpo_sde_step(z, v, sigma, sigma_next, noise_level):
    """One step written out from DanceGRPO's form, in float64: ``x0 = z - sigma v``, ``mean = z + (v + a^2 (z - (1 -
    sigma) x0) / (2 sigma^2)) dt`` and the standard deviation ``a sqrt(-dt)``. Returns (mean, std)."""
    dt = sigma_next - sigma
    z, v = z.double(), v.double()
    x0 = z - sigma * v
    return z + (v + noise_level ** 2 * (z - (1 - sigma) * x0) / (2 * sigma ** 2)) * dt, noise_level * math.sqrt(-dt)


@pytest.mark.parametrize("sde_type", ["cps", "dance_grpo"])
def test_rollout_reproduces_the_cps_and_dance_grpo_steps_and_their_log_probs(sde_type):
    """As for Flow-GRPO's step: each z_{i+1} is the reference's mean plus std * eps, eps re-drawn from the same
    generator; CPS's log p is its reference's -mean (z' - mean)^2 and its last step (sigma' = 0) is the ODE step,
    which draws no noise; DanceGRPO's is the Gaussian density."""
    gen = torch.Generator().manual_seed(1)
    sigmas = torch.linspace(1, 0, 6) ** 1.3
    noise_level = 0.8
    z0 = torch.randn(4, 2, 8, generator=gen)
    state = gen.get_state()
    traj = sde_rollout(NonlinearVelocity(), {}, sigmas, noise_level, z0, gen, sde_type=sde_type)
    replay = torch.Generator().set_state(state)
    assert traj.sde_type == sde_type and (traj.std_t[-1] == 0) == (sde_type == "cps")
    for i in range(5):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        z = traj.latents[i].double()
        v = NonlinearVelocity.field(z, s)
        if sde_type == "cps" and i == 4:
            torch.testing.assert_close(traj.latents[5].double(), z + v * (s_next - s), rtol=1e-5, atol=1e-5)
            assert traj.log_probs[4].abs().max() == 0
            continue
        reference = flow_cps_step if sde_type == "cps" else dance_grpo_sde_step
        mean, std = reference(z, v, s, s_next, noise_level)
        eps = torch.randn(z.shape, generator=replay, dtype=torch.float32).double()
        torch.testing.assert_close(traj.latents[i + 1].double(), mean + std * eps, rtol=1e-5, atol=1e-5)
        assert (mean - (z + v * (s_next - s))).abs().max() > 1e-2  # not the ODE step
        if sde_type == "cps":
            expected = -((traj.latents[i + 1].double() - mean) ** 2).flatten(1).mean(1)
        else:
            expected = torch.distributions.Normal(mean, std).log_prob(traj.latents[i + 1].double()).flatten(1).mean(1)
        torch.testing.assert_close(traj.log_probs[i].double(), expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(replay.get_state(), gen.get_state())  # CPS drew no noise for its last step


def test_the_config_offers_every_sde_type_there_is():
    assert typing.get_args(SamplingConfig.model_fields["sde_type"].annotation) == tuple(STEPS)


class DeltaVelocity:
    """The exact velocity of data that is one point x0: ``v(z, s) = (z - x0) / s``."""

    device = torch.device("cpu")
    x0 = 0.3

    def velocity(self, z, sigma, cond):
        return (z - self.x0) / sigma


@pytest.mark.parametrize("noise_level", [0.5, 1.0])
def test_cps_keeps_the_schedules_noise_and_ends_on_the_data_which_flow_grpo_does_not(noise_level):
    """With the exact velocity, a CPS step keeps ``z_i = (1 - s_i) x0 + s_i eps_i`` with eps_i standard normal, so
    the rollout ends exactly on the data; Flow-GRPO's SDE step injects noise up to its last step, so its samples
    keep some."""
    sigmas = torch.linspace(1, 0, 9)
    z0 = torch.randn(4096, generator=torch.Generator().manual_seed(0))[:, None].expand(4096, 4).contiguous()
    cps = sde_rollout(DeltaVelocity(), {}, sigmas, noise_level, z0, torch.Generator().manual_seed(1), sde_type="cps")
    flow = sde_rollout(DeltaVelocity(), {}, sigmas, noise_level, z0, torch.Generator().manual_seed(1))
    torch.testing.assert_close(cps.latents[-1], torch.full_like(z0, DeltaVelocity.x0), rtol=0, atol=1e-5)
    for i in range(1, 8):  # the noise of z_i, whose coefficient the schedule says is s_i
        eps = (cps.latents[i] - (1 - sigmas[i]) * DeltaVelocity.x0) / sigmas[i]
        assert abs(float(eps.std()) - 1) < 0.05 and abs(float(eps.mean())) < 0.05, (i, eps.std())
    assert (flow.latents[-1] - DeltaVelocity.x0).abs().mean() > 0.05


def test_log_prob_equals_closed_form_gaussian_density():
    gen = torch.Generator().manual_seed(0)
    x, mean = torch.randn(3, 4, 5, generator=gen), torch.randn(3, 4, 5, generator=gen)
    std = 0.37
    expected = torch.distributions.Normal(mean.double(), std).log_prob(x.double()).flatten(1).mean(1)
    torch.testing.assert_close(gaussian_log_prob(x, mean, std).double(), expected, rtol=1e-6, atol=1e-6)


def test_rollout_reproduces_flow_grpo_sde_steps_and_their_log_densities():
    """Each recorded z_{i+1} is the Flow-GRPO mean plus std * eps, eps re-drawn from the same generator state, and
    each log-prob is that Gaussian's density of z_{i+1}, averaged over elements."""
    gen = torch.Generator().manual_seed(1)
    sigmas = torch.linspace(1, 0, 6)
    noise_level = 0.7
    model = NonlinearVelocity()
    z0 = torch.randn(4, 2, 8, generator=gen)
    state = gen.get_state()
    traj = sde_rollout(model, {}, sigmas, noise_level, z0, gen)
    replay = torch.Generator().set_state(state)
    assert traj.latents.shape == (6, 4, 2, 8) and traj.log_probs.shape == (5, 4)
    torch.testing.assert_close(traj.latents[0], z0)
    sigma_max = float(sigmas[1])
    for i in range(5):
        s, s_next = float(sigmas[i]), float(sigmas[i + 1])
        z = traj.latents[i].double()
        v = NonlinearVelocity.field(z, s)
        torch.testing.assert_close(traj.velocities[i].double(), v, rtol=1e-5, atol=1e-6)
        mean, std = flow_grpo_sde_step(z, v, s, s_next, sigma_max, noise_level)
        eps = torch.randn(z.shape, generator=replay, dtype=torch.float32).double()
        torch.testing.assert_close(traj.latents[i + 1].double(), mean + std * eps, rtol=1e-5, atol=1e-5)
        # the test has teeth: the SDE drift correction is far larger than the tolerance at every step
        assert (mean - (z + v * (s_next - s))).abs().max() > 1e-2
        density = torch.distributions.Normal(mean, std).log_prob(traj.latents[i + 1].double()).flatten(1).mean(1)
        torch.testing.assert_close(traj.log_probs[i].double(), density, rtol=1e-5, atol=1e-4)
        assert traj.log_probs[i].dtype == torch.float32


def test_noise_std_follows_the_formula_and_avoids_division_by_zero_at_sigma_one():
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.0])
    std_t = STEPS["flow_grpo"].noise(sigmas, 0.7)
    assert math.isclose(float(std_t[0]), 0.7 * math.sqrt(1.0 / (1 - 0.8)), rel_tol=1e-6)
    assert math.isclose(float(std_t[2]), 0.7 * math.sqrt(0.5 / 0.5), rel_tol=1e-6)
    assert torch.isfinite(std_t).all()


@pytest.mark.parametrize("sde_type", STEPS)
def test_on_policy_ratio_is_exactly_one(sde_type):
    gen = torch.Generator().manual_seed(2)
    sigmas = torch.linspace(1, 0, 5)
    traj = sde_rollout(LinearVelocity(), {}, sigmas, 0.7, torch.randn(4, 8, generator=gen), gen, sde_type=sde_type)
    adv = group_advantages(torch.tensor([0.1, 0.5, 0.2, 0.9]), 2, 5.0)
    for i in range(4 - (sde_type == "cps")):
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
    traj = sde_rollout(LinearVelocity(), {}, sigmas, 0.7, z0, gen, sde_steps=range(2))
    full = sde_rollout(LinearVelocity(), {}, sigmas, 0.7, z0, torch.Generator().set_state(state))
    assert (traj.std_t[:2] > 0).all() and (traj.std_t[2:] == 0).all() and (full.std_t > 0).all()
    torch.testing.assert_close(traj.latents[:3], full.latents[:3])  # the same SDE steps first
    torch.testing.assert_close(traj.log_probs[:2], full.log_probs[:2])
    for i in range(2, 6):
        euler = traj.latents[i] + traj.velocities[i] * float(sigmas[i + 1] - sigmas[i])
        torch.testing.assert_close(traj.latents[i + 1], euler)
        assert (traj.log_probs[i] == 0).all()
    assert not torch.allclose(full.latents[3], full.latents[2] + full.velocities[2] * float(sigmas[3] - sigmas[2]))


class CountingVelocity(NonlinearVelocity):
    """Counts the samples it computes a velocity for."""

    def __init__(self):
        self.samples = 0

    def velocity(self, z, sigma, cond):
        self.samples += z.shape[0]
        return self.field(z, sigma) + cond["c"]

    def adapters_disabled(self):
        return contextlib.nullcontext()


def test_a_shared_prefix_rollout_is_the_unshared_rollout_of_the_same_noise_at_a_fraction_of_the_forwards():
    """G samples of a prompt share the initial noise; the ODE steps before the first noisy step are taken once per
    group: latents, velocities, log-probs, reference velocities and so the rewards and advantages are those of the
    unshared rollout of the same noise."""
    prompts, group, noisy = 3, 4, [4, 5, 6]
    sigmas = torch.linspace(1, 0, 9) ** 1.2
    z0 = torch.randn(prompts, 6, generator=torch.Generator().manual_seed(0)).repeat_interleave(group, dim=0)
    cond = {"c": torch.arange(prompts, dtype=torch.float32).repeat_interleave(group)[:, None] / 10}
    models, rollouts = {}, {}
    for size in (1, group):
        models[size] = CountingVelocity()
        rollouts[size] = sde_rollout(models[size], cond, sigmas, 0.9, z0, torch.Generator().manual_seed(1),
                                     with_reference=True, sde_steps=noisy, chunk_size=5, group_size=size)
    shared, unshared = rollouts[group], rollouts[1]
    for name in ("latents", "velocities", "log_probs", "ref_velocities", "std_t"):
        torch.testing.assert_close(getattr(shared, name), getattr(unshared, name), rtol=0, atol=1e-6)
    rewards = -shared.latents[-1].square().mean(1)
    torch.testing.assert_close(group_advantages(rewards, group, 5.0),
                               group_advantages(-unshared.latents[-1].square().mean(1), group, 5.0))
    assert (shared.latents[-1][::group] != shared.latents[-1][1::group]).all()  # the group branched
    per_sample = {size: model.samples / (prompts * group) for size, model in models.items()}
    assert per_sample[1] == 8 + len(noisy)  # 8 policy steps, 3 reference forwards
    # steps 0-4 and the reference at step 4 once per group (z_0 .. z_4 are shared), then the 3 branched steps and 2
    # references for every sample
    assert per_sample[group] == 5 / group + 1 / group + 3 + 2


def test_a_shared_prefix_needs_the_same_noise_within_a_group():
    z0 = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="same initial noise"):
        sde_rollout(CountingVelocity(), {"c": torch.zeros(4, 1)}, torch.linspace(1, 0, 5), 0.7, z0,
                    torch.Generator(), sde_steps=[2, 3], group_size=2)


def test_a_tree_rollout_is_a_rollout_of_its_paths_with_each_node_computed_once():
    """BranchGRPO-style: a group of 8 splits 2 ways at steps 1, 3 and 5. Samples on one node share their latent;
    each path is a valid rollout (its velocities, the SDE steps and their log-probs are those of computing every
    sample alone); every node's velocity and reference are computed once."""
    prompts, group, noisy, splits = 2, 8, [1, 2, 3, 4, 5], {1: 2, 3: 2, 5: 2}
    sigmas = torch.linspace(1, 0, 9) ** 1.2
    z0 = torch.randn(prompts, 6, generator=torch.Generator().manual_seed(0)).repeat_interleave(group, dim=0)
    cond = {"c": torch.arange(prompts, dtype=torch.float32).repeat_interleave(group)[:, None] / 10}
    model = CountingVelocity()
    traj = sde_rollout(model, cond, sigmas, 0.9, z0, torch.Generator().manual_seed(1), with_reference=True,
                       sde_steps=noisy, chunk_size=3, group_size=group, splits=splits)
    nodes_per_group = [1, 1, 2, 2, 4, 4, 8, 8, 8]  # at the latents z_0 .. z_8
    for i, nodes in enumerate(nodes_per_group):
        latents = traj.latents[i].unflatten(0, (prompts, nodes, group // nodes))
        assert (latents == latents[:, :, :1]).all(), i  # one latent per node
        assert len(torch.unique(traj.latents[i], dim=0)) == prompts * nodes, i
        assert torch.equal(traj.node_ids[i] // group, torch.arange(prompts).repeat_interleave(group))
    std_t = STEPS["flow_grpo"].noise(sigmas, 0.9)
    for i in range(8):
        v = model.field(traj.latents[i], sigmas[i]) + cond["c"]
        torch.testing.assert_close(traj.velocities[i], v, rtol=0, atol=1e-6)
        if i in noisy:
            s, s_next = float(sigmas[i]), float(sigmas[i + 1])
            mean = traj.latents[i] + (v + std_t[i] ** 2 / (2 * s) * (traj.latents[i] + (1 - s) * v)) * (s_next - s)
            std = float(std_t[i]) * math.sqrt(s - s_next)
            torch.testing.assert_close(traj.log_probs[i], gaussian_log_prob(traj.latents[i + 1], mean, std))
        else:
            torch.testing.assert_close(traj.latents[i + 1], traj.latents[i] + v * float(sigmas[i + 1] - sigmas[i]))
    policy = sum(nodes_per_group[:8])
    reference = sum(nodes_per_group[i] for i in noisy)
    assert model.samples == prompts * (policy + reference)  # 24 + 13 per group, against 64 + 40 unshared

