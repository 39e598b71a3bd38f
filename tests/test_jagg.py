"""Exactness of the JAGG backward against the exact per-step gradient."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from jagg_core.config import BackwardConfig, LoraConfig, ModelConfig
from jagg_core.grpo import LossSettings, group_advantages, step_loss
from jagg_core.image_size import ImageSize
from jagg_core.jagg import (Window, interpolation_weights, linearity_score, make_plan, cover_with_windows,
                            route_windows, run_backward)
from jagg_core.models import load_flow_model
from jagg_core.sampler import sde_rollout

STEPS = 10


class AffineJacobianModel(torch.nn.Module):
    """``v = f(z) + A + sigma * B + sigma^2 * C``: trainable A, B and (optionally) C, frozen nonlinear f.

    With ``curvature=False`` the parameter Jacobian ``dv/d(A, B) = [I, sigma I]`` is affine in sigma,
    the case where JAGG is exact for any window; with ``curvature=True`` it is not.
    """

    def __init__(self, curvature: bool = False):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.frozen = torch.nn.Linear(12, 12)
        self.frozen.requires_grad_(False)
        self.A = torch.nn.Parameter(0.1 * torch.randn(12, generator=gen))
        self.B = torch.nn.Parameter(0.1 * torch.randn(12, generator=gen))
        self.C = torch.nn.Parameter(0.1 * torch.randn(12, generator=gen), requires_grad=curvature)
        self.device = torch.device("cpu")
        self.disabled = False

    def latent_shape(self, size):
        return (12,)

    def velocity(self, z, sigma, cond):
        sigma = sigma.expand(z.shape[0]) if sigma.dim() == 0 else sigma
        v = torch.tanh(self.frozen(z))
        if not self.disabled:
            v = v + self.A + sigma[:, None] * self.B + sigma[:, None] ** 2 * self.C
        return v

    @contextmanager
    def adapters_disabled(self):
        self.disabled = True
        try:
            yield
        finally:
            self.disabled = False


def rollout(model, batch=6, kl=False, seed=0, sde_type="flow_grpo"):
    gen = torch.Generator().manual_seed(seed)
    sigmas = torch.linspace(1, 0, STEPS + 1) ** 1.5
    z0 = torch.randn((batch, *model.latent_shape(ImageSize.square(16))), generator=gen)
    cond = {"c": torch.zeros(batch, 1)}
    traj = sde_rollout(model, cond, sigmas, 0.7, z0, gen, with_reference=kl, sde_type=sde_type)
    rewards = torch.randn(batch, generator=gen)
    return traj, cond, group_advantages(rewards, 3, 5.0)


def params_of(model):
    return [p for p in model.parameters() if p.requires_grad]


def exact_gradient(model, traj, cond, adv, settings, trained=None):
    """Ground truth by plain autograd: d/dtheta sum_j L_j(v_theta(z_j, sigma_j)) over the ``trained`` first steps
    (default: all)."""
    for p in params_of(model):
        p.grad = None
    total = sum(step_loss(model.velocity(traj.latents[j], traj.sigmas[j], cond), j, traj, adv, settings,
                          traj.reference_velocity(j) if settings.kl_beta > 0 else None)[0]
                for j in range(trained or traj.num_steps))
    total.backward()
    return torch.cat([p.grad.flatten().clone() for p in params_of(model)])


def backward_gradient(model, traj, cond, adv, settings, config, on_policy=True, trained=None):
    for p in params_of(model):
        p.grad = None
    plan = make_plan(config, traj, trained or traj.num_steps, replace(settings, scale=1.0))
    result = run_backward(model, plan, traj, cond, adv, on_policy=on_policy)
    return torch.cat([p.grad.flatten().clone() for p in params_of(model)]), plan, result


SETTINGS = LossSettings(clip_range=0.2, kl_beta=0.0, scale=1.0 / STEPS)


@pytest.mark.parametrize("window", [5, 10])
@pytest.mark.parametrize("shared_knots", [False, True])
@pytest.mark.parametrize("joint", [False, True])
@pytest.mark.parametrize("velocities", ["cached", "forward"])
def test_jagg_is_exact_when_jacobian_is_affine_in_sigma(window, shared_knots, joint, velocities):
    model = AffineJacobianModel()
    traj, cond, adv = rollout(model)
    expected = exact_gradient(model, traj, cond, adv, SETTINGS)
    config = BackwardConfig(mode="jagg", window=window, shared_knots=shared_knots, joint=joint, velocities=velocities)
    got, plan, _ = backward_gradient(model, traj, cond, adv, SETTINGS, config)
    assert plan.interpolated, "the plan must interpolate some steps for this test to mean anything"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("sde_type", ["dance_grpo", "cps"])
@pytest.mark.parametrize("kl_beta", [0.0, 0.3])
def test_jagg_is_exact_under_every_sde_type_when_the_jacobian_is_affine_in_sigma(sde_type, kl_beta):
    """JAGG aggregates each step's upstream gradient dL_j/dv_j whatever the step's SDE (DanceGRPO's, CPS's with
    its log p and the KL's variance): exact in the same case, on the steps that add noise (CPS: all but the last)."""
    model = AffineJacobianModel()
    traj, cond, adv = rollout(model, kl=kl_beta > 0, sde_type=sde_type)
    trained = STEPS - (sde_type == "cps")
    settings = LossSettings(clip_range=0.2, kl_beta=kl_beta, scale=1.0 / trained)
    expected = exact_gradient(model, traj, cond, adv, settings, trained)
    config = BackwardConfig(mode="jagg", window=5, velocities="cached")
    got, plan, _ = backward_gradient(model, traj, cond, adv, settings, config, trained=trained)
    assert plan.interpolated and expected.abs().max() > 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("policy_loss", ["guard", "dppo"])
@pytest.mark.parametrize("velocities", ["cached", "forward"])
def test_jagg_is_exact_under_guard_and_dppo_off_policy_when_the_jacobian_is_affine_in_sigma(policy_loss, velocities):
    """GRPO-Guard's normalized ratio and step weights and DPPO's KL mask are functions of each step's velocity, so
    JAGG aggregates their upstream gradients like clip's: exact in the same case, off-policy (a later optimizer step
    on the batch, where the ratio has moved and some samples are clipped or dropped)."""
    model = AffineJacobianModel()
    traj, cond, adv = rollout(model)
    with torch.no_grad():  # the policy has moved since the rollout
        model.A.add_(0.02 * torch.randn(12, generator=torch.Generator().manual_seed(5)))
        model.B.sub_(0.03)
    settings = LossSettings(clip_range=1e-3, kl_beta=0.0, scale=1.0 / STEPS, policy_loss=policy_loss,
                            kl_mask_threshold=1e-4)
    expected = exact_gradient(model, traj, cond, adv, settings)
    got, plan, result = backward_gradient(model, traj, cond, adv, settings,
                                          BackwardConfig(mode="jagg", window=5, velocities=velocities), on_policy=False)
    assert plan.interpolated and 0 < result.clip_frac < 1, "some steps must be clipped or dropped, not all"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["exact", "jagg"])
def test_micro_batches_following_one_plan_add_up_to_the_whole_batch_gradient(mode):
    """One plan per rollout batch: its micro-batches' scaled losses (m / (B T)) sum to the batch's loss."""
    model = AffineJacobianModel(curvature=True)
    traj, cond, adv = rollout(model)
    config = BackwardConfig(mode=mode, window=5, frac=0.5)
    whole, plan, _ = backward_gradient(model, traj, cond, adv, SETTINGS, config)
    for p in params_of(model):
        p.grad = None
    for index in torch.arange(traj.batch_size).tensor_split(2):
        run_backward(model, plan, traj.select(index), {k: v[index] for k, v in cond.items()}, adv[index],
                     on_policy=True)
    split = torch.cat([p.grad.flatten() for p in params_of(model)])
    assert split.abs().sum() > 0
    torch.testing.assert_close(split, whole, rtol=1e-5, atol=1e-7)


def test_jagg_with_kl_is_exact_when_jacobian_is_affine():
    model = AffineJacobianModel()
    traj, cond, adv = rollout(model, kl=True)
    settings = LossSettings(clip_range=0.2, kl_beta=0.5, scale=1.0 / STEPS)
    with torch.no_grad():  # move off the reference so the KL term has a gradient
        model.A.add_(0.05)
    expected = exact_gradient(model, traj, cond, adv, settings)
    config = BackwardConfig(mode="jagg", window=5, velocities="forward")
    got, _, _ = backward_gradient(model, traj, cond, adv, settings, config, on_policy=False)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("config", [BackwardConfig(mode="exact"), BackwardConfig(mode="jagg", window=5),
                                    BackwardConfig(mode="jagg", window=4, shared_knots=True, velocities="forward")],
                         ids=["exact", "jagg W=5 cached", "jagg W=4 shared forward"])
@pytest.mark.parametrize("on_policy", [True, False])
def test_the_reference_computed_in_the_training_pass_equals_the_rollouts(config, on_policy):
    """``grpo.kl_reference: train``: the reference velocities come from no-grad forwards with the adapter disabled
    at the pass steps and are interpolated inside JAGG windows. The adapter's part of v here is A + sigma B, affine
    in sigma and independent of z, so the loss, the KL and the gradient equal the per-step form with the
    rollout's reference velocities at every step."""
    model = AffineJacobianModel()
    with torch.no_grad():  # the rollout's policy is off the reference, so the KL has a value and a gradient
        model.C.zero_()  # (frozen, but sigma^2 C is part of the adapter's velocity)
        model.A.add_(0.05)
        model.B.sub_(0.08)
    traj, cond, adv = rollout(model, kl=True)
    if not on_policy:
        with torch.no_grad():
            model.B.add_(0.03)
    settings = LossSettings(clip_range=0.2, kl_beta=0.5, scale=1.0 / STEPS)
    expected = exact_gradient(model, traj, cond, adv, settings)
    with_rollout_reference = backward_gradient(model, traj, cond, adv, settings, config, on_policy)
    in_training = backward_gradient(model, replace(traj, ref_velocities=None), cond, adv, settings, config, on_policy)
    torch.testing.assert_close(in_training[0], expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(with_rollout_reference[0], expected, rtol=1e-5, atol=1e-7)
    assert in_training[2].kl == pytest.approx(with_rollout_reference[2].kl, rel=1e-5) and in_training[2].kl > 1e-4
    assert in_training[2].loss == pytest.approx(with_rollout_reference[2].loss, rel=1e-5)


def test_the_interpolated_reference_is_an_approximation_off_its_assumption():
    """Guards the test above: with sigma^2 C in the adapter's part of v the training pass's reference differs from
    the per-step one at the interpolated steps only."""
    model = AffineJacobianModel(curvature=True)
    traj, cond, adv = rollout(model, kl=True)
    settings = LossSettings(clip_range=0.2, kl_beta=0.5, scale=1.0 / STEPS)
    for config, same in ((BackwardConfig(mode="exact"), True), (BackwardConfig(mode="jagg", window=10), False)):
        rollout_kl = backward_gradient(model, traj, cond, adv, settings, config)[2].kl
        training_kl = backward_gradient(model, replace(traj, ref_velocities=None), cond, adv, settings, config)[2].kl
        assert (training_kl == pytest.approx(rollout_kl, rel=1e-6)) == same


def test_jagg_is_not_exact_when_jacobian_is_curved():
    """Guards the tests above: with sigma^2 in the Jacobian the approximation differs."""
    model = AffineJacobianModel(curvature=True)
    traj, cond, adv = rollout(model)
    expected = exact_gradient(model, traj, cond, adv, SETTINGS)
    got, _, _ = backward_gradient(model, traj, cond, adv, SETTINGS, BackwardConfig(mode="jagg", window=10))
    assert not torch.allclose(got, expected, rtol=1e-3)
    assert torch.nn.functional.cosine_similarity(got, expected, dim=0) > 0.5


def test_cached_correction_matches_forward_off_policy_when_affine():
    """Off-policy the cached velocities use the endpoint correction; for v affine in sigma it is exact."""
    model = AffineJacobianModel()
    traj, cond, adv = rollout(model)
    with torch.no_grad():
        model.A.add_(0.1)
        model.B.sub_(0.2)
    expected = exact_gradient(model, traj, cond, adv, SETTINGS)
    for velocities in ("cached", "forward"):
        got, _, _ = backward_gradient(model, traj, cond, adv, SETTINGS,
                                      BackwardConfig(mode="jagg", window=5, velocities=velocities), on_policy=False)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module", params=[False, True], ids=["lora", "dora"])
def tiny_sd3(request):
    """The tiny SD3 with a LoRA, or a DoRA (whose magnitudes' gradients are checked too)."""
    model = load_flow_model(ModelConfig(name="tiny-sd3"))
    model.add_lora(LoraConfig(rank=4, alpha=4, use_dora=request.param))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # LoRA B starts at zero; give it weight so every path carries gradient
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=gen)
    return model


def tiny_rollout(model, steps=6):
    gen = torch.Generator().manual_seed(0)
    prompts = ["a red circle", "a blue square"]
    cond = model.conditioning([p for p in prompts for _ in range(2)])
    sigmas = model.sigmas(steps, ImageSize.square(32))
    z0 = torch.randn((4, *model.latent_shape(ImageSize.square(32))), generator=gen)
    traj = sde_rollout(model, cond, sigmas, 0.7, z0, gen)
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.3, 0.9]), 2, 5.0)
    return traj, cond, adv


def lora_grad(model):
    return torch.cat([p.grad.flatten() for n, p in model.transformer.named_parameters() if "lora_" in n])


def tiny_backward(model, traj, cond, adv, config):
    model.transformer.zero_grad(set_to_none=True)
    plan = make_plan(config, traj, traj.num_steps, LossSettings(clip_range=0.2, kl_beta=0.0))
    run_backward(model, plan, traj, cond, adv, on_policy=True)
    return lora_grad(model).clone()


def test_window_two_is_exact_on_a_real_transformer(tiny_sd3):
    traj, cond, adv = tiny_rollout(tiny_sd3)
    exact = tiny_backward(tiny_sd3, traj, cond, adv, BackwardConfig(mode="exact"))
    assert exact.abs().sum() > 0
    for joint in (False, True):
        got = tiny_backward(tiny_sd3, traj, cond, adv, BackwardConfig(mode="jagg", window=2, joint=joint))
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-8)


def test_cached_equals_forward_on_policy_on_a_real_transformer(tiny_sd3):
    traj, cond, adv = tiny_rollout(tiny_sd3)
    cached = tiny_backward(tiny_sd3, traj, cond, adv, BackwardConfig(mode="jagg", window=3, velocities="cached"))
    forward = tiny_backward(tiny_sd3, traj, cond, adv, BackwardConfig(mode="jagg", window=3, velocities="forward"))
    torch.testing.assert_close(cached, forward, rtol=1e-5, atol=1e-8)


def test_frac_zero_equals_exact(tiny_sd3):
    traj, cond, adv = tiny_rollout(tiny_sd3)
    exact = tiny_backward(tiny_sd3, traj, cond, adv, BackwardConfig(mode="exact"))
    routed_off = tiny_backward(tiny_sd3, traj, cond, adv, BackwardConfig(mode="jagg", window=3, frac=0.0))
    torch.testing.assert_close(routed_off, exact, rtol=1e-5, atol=1e-8)


def test_plan_windows_cover_steps_and_share_knots():
    assert cover_with_windows(10, 5, False) == [Window(0, 4), Window(5, 9)]
    assert cover_with_windows(12, 5, False) == [Window(0, 4), Window(5, 9), Window(10, 11)]
    assert cover_with_windows(10, 5, True) == [Window(0, 4), Window(4, 8), Window(8, 9)]
    assert cover_with_windows(9, 5, True) == [Window(0, 4), Window(4, 8)]
    assert cover_with_windows(3, 1, False) == [Window(0, 0), Window(1, 1), Window(2, 2)]
    assert cover_with_windows(5, 3, True, first=4) == [Window(4, 6), Window(6, 8)]


def test_pass_counts_two_per_window_or_k_plus_one_with_shared_knots():
    model = AffineJacobianModel()
    traj, _, _ = rollout(model)
    traj_13 = traj  # 10 steps
    assert len(make_plan(BackwardConfig(mode="exact"), traj_13, 10, SETTINGS).pass_steps) == 10
    assert len(make_plan(BackwardConfig(mode="jagg", window=5), traj_13, 10, SETTINGS).pass_steps) == 4
    shared = make_plan(BackwardConfig(mode="jagg", window=4, shared_knots=True), traj_13, 10, SETTINGS)
    assert [(w.start, w.end) for w in shared.windows] == [(0, 3), (3, 6), (6, 9)]
    assert shared.pass_steps == [0, 3, 6, 9]  # K + 1 = 4 passes for K = 3 windows


def test_interpolation_weights_run_from_zero_to_one():
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.4, 0.0])
    alpha = interpolation_weights(sigmas, Window(0, 3))
    assert alpha[0] == 0.0 and alpha[3] == 1.0
    assert alpha[1] == pytest.approx(0.2 / 0.6) and alpha[2] == pytest.approx(0.5 / 0.6)


FOUR = cover_with_windows(12, 3, False)  # four windows of 3 steps, each with one interior step


def test_routing_picks_the_most_linear_windows():
    assert route_windows(FOUR, [0.9, 0.2, 0.99, 0.5], 0.5) == [True, False, True, False]
    assert route_windows(FOUR, [0.9, 0.2, 0.99, 0.5], 0.0) == [False] * 4
    assert route_windows(FOUR, [0.9, 0.2, 0.99, 0.5], 1.0) == [True] * 4
    velocities = torch.zeros(6, 2, 3)
    velocities[0:3] = torch.tensor([1.0, 0.0, 0.0])       # window 0: constant -> perfectly linear
    velocities[3:6] = torch.tensor([1.0, 0.0, 0.0])
    velocities[4] = torch.tensor([0.0, 1.0, 0.0])          # window 1: middle step orthogonal
    sigmas = torch.linspace(1, 0, 7)
    scores = [linearity_score(velocities, sigmas, w) for w in (Window(0, 2), Window(3, 5))]
    assert scores[0] == pytest.approx(1.0) and scores[1] == pytest.approx(0.0, abs=1e-6)
    config = BackwardConfig(mode="jagg", window=3, frac=0.5, route_by="linearity")

    class Batch:
        pass
    batch = Batch()
    batch.velocities, batch.sigmas, batch.batch_size = velocities, sigmas, 2
    plan = make_plan(config, batch, 6, SETTINGS)
    assert plan.use_jagg == [True, False]
    assert plan.pass_steps == [0, 2, 3, 4, 5] and list(plan.interpolated) == [1]


def test_zero_interior_windows_are_exact_and_do_not_consume_frac():
    windows = [Window(0, 3), Window(4, 5), Window(6, 9), Window(10, 10)]  # two of them without interior steps
    scores = [0.5, 1.0, 0.9, 1.0]
    assert route_windows(windows, scores, 0.5) == [False, False, True, False]  # round(0.5 x 2) = 1 interior window
    assert route_windows(windows, scores, 1.0) == [True, False, True, False]


def test_the_threshold_routes_by_score():
    scores = [0.9, 0.2, 0.99, 0.5]
    assert route_windows(FOUR, scores, 1.0, min_fidelity=0.6) == [True, False, True, False]
    assert route_windows(FOUR, scores, 1.0, min_fidelity=0.95) == [False, False, True, False]
    assert route_windows(FOUR, scores, 0.25, min_fidelity=0.0) == [False, False, True, False]  # frac first
    model = AffineJacobianModel(curvature=True)
    traj, _, _ = rollout(model)
    free = make_plan(BackwardConfig(mode="jagg", window=3, route_by="linearity"), traj, 9, SETTINGS)
    cut = sorted(free.scores)[1]
    plan = make_plan(BackwardConfig(mode="jagg", window=3, min_fidelity=cut, route_by="linearity"), traj, 9, SETTINGS)
    assert plan.use_jagg == [score >= cut for score in free.scores] and sum(plan.use_jagg) == 2


def test_audit_routing_uses_the_latest_audited_cosines_and_jagg_before_any():
    model = AffineJacobianModel(curvature=True)
    traj, _, _ = rollout(model)
    config = BackwardConfig(mode="jagg", window=3, min_fidelity=0.9, route_by="audit")
    assert make_plan(config, traj, 9, SETTINGS).use_jagg == [True, True, True]  # nothing audited yet
    audited = {Window(0, 2): 0.95, Window(3, 5): 0.5}  # window 6-8 not audited: scores 1
    plan = make_plan(config, traj, 9, SETTINGS, audited=audited)
    assert plan.scores == [0.95, 0.5, 1.0] and plan.use_jagg == [True, False, True]
    assert plan.pass_steps == [0, 2, 3, 4, 5, 6, 8]


@pytest.mark.parametrize("window", [1, 3])
def test_a_placement_other_than_the_prefix_trains_exactly_its_steps(window):
    """The LoRA gradient of spans (3..6 and 8..9, windows never crossing a span's end) is the exact per-step
    gradient of exactly those steps, with the loss normalized by their count; the others get nothing."""
    model = AffineJacobianModel()
    traj, cond, adv = rollout(model)
    spans = [range(3, 7), range(8, 10)]
    steps = [3, 4, 5, 6, 8, 9]
    for p in params_of(model):
        p.grad = None
    settings = LossSettings(0.2, 0.0, scale=1.0 / len(steps))
    sum(step_loss(model.velocity(traj.latents[j], traj.sigmas[j], cond), j, traj, adv, settings)[0]
        for j in steps).backward()
    expected = torch.cat([p.grad.flatten().clone() for p in params_of(model)])
    config = BackwardConfig(mode="jagg" if window > 1 else "exact", window=window)
    plan = make_plan(config, traj, spans, LossSettings(0.2, 0.0))
    assert sorted({j for win in plan.windows for j in win.steps}) == steps and plan.trained_steps == len(steps)
    assert all(win.start in steps and win.end in steps and win.end - win.start < window for win in plan.windows)
    for p in params_of(model):
        p.grad = None
    run_backward(model, plan, traj, cond, adv, on_policy=True)
    got = torch.cat([p.grad.flatten() for p in params_of(model)])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


class CountingModel(AffineJacobianModel):
    """Counts the rows it computes a velocity for."""

    rows = 0

    def velocity(self, z, sigma, cond):
        self.rows += z.shape[0]
        return super().velocity(z, sigma, cond)


@pytest.mark.parametrize("config", [BackwardConfig(mode="exact"),
                                    BackwardConfig(mode="jagg", window=3, shared_knots=True, joint=False)],
                         ids=["exact", "jagg W=3 shared"])
def test_a_tree_rollout_trains_each_shared_node_once_with_the_gradient_of_its_paths(config):
    """Tree rollouts (grpo.branch_factor): the training pass computes a velocity once per node of the tree and the
    gradient flows back from every path through it, so loss, KL and gradient equal training every path as its own
    sample, at fewer forwards."""
    model = CountingModel(curvature=True)
    group, splits = 4, {0: 2, 4: 2}
    gen = torch.Generator().manual_seed(3)
    sigmas = torch.linspace(1, 0, STEPS + 1) ** 1.5
    z0 = torch.randn(2, 12, generator=gen).repeat_interleave(group, dim=0)
    cond = {"c": torch.zeros(8, 1)}
    traj = sde_rollout(model, cond, sigmas, 0.7, z0, gen, sde_steps=range(6), group_size=group, splits=splits)
    adv = group_advantages(torch.randn(8, generator=gen), group, 5.0)
    with torch.no_grad():  # off the reference, so the KL has a gradient
        model.A.add_(0.05)
    settings = LossSettings(clip_range=0.2, kl_beta=0.5)
    plan = make_plan(config, traj, [range(6)], settings)
    results, gradients, rows = [], [], []
    for batch in (traj, replace(traj, node_ids=None)):
        for p in params_of(model):
            p.grad = None
        model.rows = 0
        results.append(run_backward(model, plan, batch, cond, adv, on_policy=True))
        gradients.append(torch.cat([p.grad.flatten() for p in params_of(model)]))
        rows.append(model.rows)
    torch.testing.assert_close(gradients[0], gradients[1], rtol=1e-5, atol=1e-7)
    assert gradients[0].abs().sum() > 0
    assert results[0].loss == pytest.approx(results[1].loss, rel=1e-6)
    assert results[0].kl == pytest.approx(results[1].kl, rel=1e-6) and results[0].kl > 0
    # nodes per prompt at z_0 .. z_5: 1 2 2 2 2 4; each pass step: a forward and a reference forward
    nodes = {0: 1, 1: 2, 2: 2, 3: 2, 4: 2, 5: 4}
    assert rows[0] == 2 * 2 * sum(nodes[e] for e in plan.pass_steps) and rows[1] == 2 * 8 * len(plan.pass_steps)
