"""The GRPO step loss's KL forms and the advantage options, against their formulas."""

from __future__ import annotations

import pytest
import torch

from jagg_core.grpo import LossSettings, step_loss
from jagg_core.sampler import sde_rollout


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
