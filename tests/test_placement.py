"""Window placement: which steps an iteration trains, the same on every process and on a resume."""

from __future__ import annotations

import math

import pytest
import torch

from jagg_core import metrics
from jagg_core.errors import UserError
from jagg_core.model_card import build_model_card, read_run
from jagg_core.config import load_config
from jagg_core.placement import branch_splits, most_trained_steps, split_at, trained_spans, trained_steps
from jagg_core.rundir import RunDirectory
from jagg_core.trainer import Trainer

from conftest import tiny_config


def test_range_placement_is_the_t_steps_from_the_start():
    assert trained_spans(10, 0.5, "range", 0, 5, seed=1) == [range(0, 5)]
    assert trained_spans(10, 0.3, "range", 4, 5, seed=1) == [range(4, 7)]


def test_random_placement_draws_whole_blocks_by_seed():
    draws = {tuple(map(tuple, trained_spans(10, 0.4, "random", 0, 2, seed=s))) for s in range(20)}
    assert len(draws) > 1, "different iterations draw different blocks"
    for seed in range(20):
        spans = trained_spans(10, 0.4, "random", 0, 2, seed=seed)
        assert spans == trained_spans(10, 0.4, "random", 0, 2, seed=seed)  # every process, and a resume
        assert len(spans) == 2 and all(span.start % 2 == 0 and len(span) == 2 for span in spans)
    assert trained_spans(10, 0.5, "random", 0, 3, seed=0)[-1] != range(9, 12)  # the last block is [9, 9]
    assert most_trained_steps(10, 0.5, "random", 3) == 6 and most_trained_steps(10, 0.5, "range", 3) == 5


def test_a_sliding_range_moves_one_step_every_slide_every_iterations_then_stays():
    starts = [trained_spans(10, 0.3, "range", 2, 5, seed=0, iteration=k, slide_every=4)[0].start
              for k in range(1, 30)]
    assert starts[:12] == [2] * 4 + [3] * 4 + [4] * 4 and max(starts) == starts[-1] == 7  # last range: 7..9
    with pytest.raises(UserError, match="slide_every"):
        tiny_config(grpo__window_placement="random", grpo__slide_every=2)


def test_a_range_past_the_schedule_is_refused():
    with pytest.raises(UserError, match="trained_start"):
        tiny_config(grpo__timestep_fraction=0.5, grpo__trained_start=4)


@pytest.mark.parametrize("placement, start", [("range", 2), ("random", 0)])
def test_rollouts_are_noisy_only_at_the_trained_steps(placement, start, tmp_path, offline):
    config = tiny_config(grpo__timestep_fraction=0.5, grpo__window_placement=placement, grpo__trained_start=start,
                         grpo__ode_after_trained=True, grpo__kl_beta=0.1, grpo__kl_reference="rollout")
    trainer = Trainer(config, tmp_path)
    trainer.setup()
    rollout = trainer.rollout(3)
    assert rollout.spans == trainer.algorithm.trained_spans(3)
    steps = trained_steps(rollout.spans)
    if placement == "range":
        assert steps == [2, 3, 4]
    noisy = (rollout.trajectory.std_t > 0).nonzero().flatten().tolist()
    assert noisy == steps and rollout.trajectory.ref_velocities.shape[0] == len(steps)
    plan = trainer.algorithm.plan_backward(rollout.trajectory, rollout.spans, config.backward)
    assert sorted({j for win in plan.windows for j in win.steps}) == steps
    torch.testing.assert_close(rollout.trajectory.reference_velocity(steps[-1]), rollout.trajectory.ref_velocities[-1])


def test_a_random_placement_trains_end_to_end(tmp_path, offline):
    config = tiny_config(grpo__timestep_fraction=0.5, grpo__window_placement="random", grpo__ode_after_trained=True,
                         grpo__kl_beta=0.1, backward__audit_every=1, backward__audit_samples=2)
    trainer = Trainer(config, tmp_path)
    trainer.setup()
    trainer.fit()
    rows = [r for r in RunDirectory(tmp_path).read_metrics() if r["iteration"] > 0]
    assert len(rows) == 2 and all(r["train/grad_norm"] > 0 and r["train/kl"] >= 0 for r in rows)
    assert all(r[metrics.JAGG_WINDOWS] == 1 and r[metrics.BACKWARD_PASSES] == 2 for r in rows)  # one block of W = 3


def test_a_shared_prefix_sliding_window_trains_end_to_end(tmp_path, offline):
    """MixGRPO-style: the trained range slides one step per iteration; the G samples of a prompt share the initial
    noise and the ODE path up to the range, branch inside it, and the reference comes from the training pass."""
    config = tiny_config(grpo__timestep_fraction=0.5, grpo__trained_start=1, grpo__slide_every=1,
                         grpo__ode_after_trained=True, grpo__shared_prefix=True, grpo__kl_beta=0.1,
                         grpo__num_generations=3)
    trainer = Trainer(config, tmp_path)
    trainer.setup()
    rollout = trainer.rollout(2)
    assert rollout.spans == [range(2, 5)] and rollout.trajectory.ref_velocities is None
    latents = rollout.trajectory.latents.unflatten(1, (2, 3))  # [steps + 1, prompt, sample of its group, ...]
    for step in range(len(latents)):
        same_within_groups = bool((latents[step] == latents[step][:, :1]).all())
        assert same_within_groups == (step <= 2), step  # z_0 .. z_2 shared; the SDE step 2 branches z_3
    trainer.fit()
    rows = [r for r in RunDirectory(tmp_path).read_metrics() if r["iteration"] > 0]
    assert len(rows) == 2 and all(r["train/grad_norm"] > 0 and r["train/kl"] >= 0 for r in rows)


def test_a_tree_rollout_trains_end_to_end(tmp_path, offline):
    """grpo.branch_factor 2 with groups of 4: each group starts from one noise and splits at the first and the last
    trained step (steps 0 and 2), so its latents hold 1, 2, 2, 4 distinct values at z_0 .. z_3; the run trains and
    its gradients are finite."""
    config = tiny_config(grpo__timestep_fraction=0.5, grpo__branch_factor=2, grpo__num_generations=4,
                         grpo__ode_after_trained=True, grpo__kl_beta=0.1)
    trainer = Trainer(config, tmp_path)
    trainer.setup()
    rollout = trainer.rollout(1)
    latents = rollout.trajectory.latents.unflatten(1, (2, 4))  # [steps + 1, prompt, sample of its group, ...]
    distinct = [len(torch.unique(latents[step][0], dim=0)) for step in range(len(latents))]
    assert distinct == [1, 2, 2, 4, 4, 4, 4]
    trainer.fit()
    rows = [r for r in RunDirectory(tmp_path).read_metrics() if r["iteration"] > 0]
    assert len(rows) == 2 and all(r["train/grad_norm"] > 0 and math.isfinite(r["train/grad_norm"]) for r in rows)
    assert "tree rollouts splitting 2 ways" in str(build_model_card(read_run(tmp_path), "me/tree"))


@pytest.mark.parametrize("placement, fraction, draws", [("range", 1.0, {(0, 1, 2, 3, 4)}),
                                                        ("random", 0.5, {(0, 1, 2), (3, 4)})])
def test_cps_trains_every_step_but_its_last_which_adds_no_noise(placement, fraction, draws, tmp_path, offline):
    """sampling.sde_type cps: the last step (sigma' = 0) is the ODE step, so timestep_fraction 1 trains the 5 others
    of 6, and a random draw takes the blocks of W = 3 that cut those 5; the run trains (with its KL, an audit and
    the doctor) and its model card names the SDE."""
    config = tiny_config(sampling__sde_type="cps", sampling__noise_level=0.8, grpo__window_placement=placement,
                         grpo__timestep_fraction=fraction, grpo__kl_beta=0.1, backward__audit_every=1,
                         backward__audit_samples=2, train__doctor=True)
    trainer = Trainer(config, tmp_path)
    trainer.setup()
    assert {tuple(trained_steps(trainer.algorithm.trained_spans(k))) for k in range(1, 20)} == draws
    rollout = trainer.rollout(1)
    assert (rollout.trajectory.std_t > 0).tolist() == [True] * 5 + [False]
    trainer.fit()
    rows = [r for r in RunDirectory(tmp_path).read_metrics() if r["iteration"] > 0]
    assert len(rows) == 2 and all(r["train/grad_norm"] > 0 and math.isfinite(r["train/grad_norm"]) for r in rows)
    assert trainer.doctor_report["passed"], trainer.doctor_report
    assert "CPS SDE noise level 0.8" in str(build_model_card(read_run(tmp_path), "me/cps"))


@pytest.mark.parametrize("overrides, message", [
    ({"sampling__noise_level": 1.5}, "sampling.noise_level 1.5 with sampling.sde_type cps: .* give a in \\(0, 1\\]"),
    ({"grpo__timestep_fraction": 0.5, "grpo__trained_start": 3},
     "grpo.trained_start 3 \\+ 3 trained steps exceeds the 5 steps of sampling.num_steps 6 that add noise under "
     "sampling.sde_type cps"),
    ({"grpo__policy_loss": "guard"}, "grpo.policy_loss guard weights each step by 1 / \\|dt\\|, .* set "
     "sampling.sde_type flow_grpo or dance_grpo, or policy_loss clip or dppo")])
def test_a_cps_setting_it_cannot_train_is_one_line(overrides, message):
    with pytest.raises(UserError, match=message):
        tiny_config(sampling__sde_type="cps", **overrides)
    with pytest.raises(UserError, match="sampling.sde_type cps applies to train.algorithm grpo only"):
        load_config(preset="shapes-nft", overrides=["sampling.sde_type=cps"])  # its rollouts are ODE


@pytest.mark.parametrize("factor, group", [(2, 6), (3, 4), (1, 4), (2, 16)])
def test_a_branch_factor_that_cannot_split_the_group_is_a_clear_error(factor, group):
    with pytest.raises(UserError, match="grpo.branch_factor"):
        tiny_config(grpo__timestep_fraction=0.5, grpo__branch_factor=factor, grpo__num_generations=group)


def test_branch_splits_spread_over_the_trained_steps():
    assert branch_splits(range(5), 8, 2) == {0: 2, 2: 2, 4: 2}
    assert branch_splits(range(3, 7), 4, 2) == {3: 2, 6: 2}
    assert branch_splits(range(5), 4, 4) == {0: 4}
    for trained, group, factor in ((range(2), 8, 2), (range(5), 6, 2), (range(5), 4, 1)):
        with pytest.raises(ValueError, match="cannot split"):
            branch_splits(trained, group, factor)


@pytest.mark.parametrize("factor, group, fraction", [(2, 8, 0.2), (2, 6, 1.0), (1, 4, 1.0)])
def test_the_config_refuses_a_branch_factor_the_rollout_cannot_split(factor, group, fraction):
    with pytest.raises(UserError, match=f"grpo.branch_factor {factor} must split"):
        load_config(preset="tiny-sd3", overrides=[f"grpo.branch_factor={factor}", f"grpo.num_generations={group}",
                                                  "sampling.num_steps=10", f"grpo.timestep_fraction={fraction}"])


def test_split_at_cuts_the_span_that_holds_the_step_inside_it():
    """Where a two-expert model's experts switch: a span across it becomes two; one that starts there, or none
    (one transformer), is as it was."""
    assert split_at([range(1, 6)], 3) == [range(1, 3), range(3, 6)]
    assert split_at([range(0, 2), range(4, 6)], 4) == [range(0, 2), range(4, 6)]
    assert split_at([range(0, 6)], None) == [range(0, 6)]
