"""The fidelity audit (backward.audit_every): its figures against gradients computed independently, and in training:
bit-identical updates, its metrics on the audited iterations only, the model card's mean, the app's curve."""

from __future__ import annotations

import pytest
import torch

from app import live
from jagg_core import metrics
from jagg_core.audit import audit_indices, gradient_agreement, measure_fidelity, run_audit
from jagg_core.config import BackwardConfig
from jagg_core.grpo import LossSettings
from jagg_core.jagg import make_plan, run_backward
from jagg_core.model_card import build_model_card, read_run
from jagg_core.rundir import TRAINING_STATE_FILE, RunDirectory
from jagg_core.trainer import Trainer

from conftest import tiny_config
from test_jagg import SETTINGS, AffineJacobianModel, backward_gradient, exact_gradient, params_of, rollout

# -- the figures, on a model whose Jacobian is affine in sigma (JAGG exact) or curved (JAGG approximate) -------------

BACKWARDS = {"W=5": BackwardConfig(window=5), "W=4 shared knots": BackwardConfig(window=4, shared_knots=True),
             "W=3 forward, sequential": BackwardConfig(window=3, velocities="forward", joint=False),
             "W=5 frac=0.5": BackwardConfig(window=5, frac=0.5, route_by="linearity")}


def audit(model, config):
    """The audit of ``config``'s plan on the whole rollout batch of ``model`` (its ``.grad`` and RNG untouched)."""
    traj, cond, adv = rollout(model)
    plan = make_plan(config, traj, traj.num_steps, LossSettings(SETTINGS.clip_range, SETTINGS.kl_beta))
    fidelity = run_audit(params_of(model), plan, lambda part: run_backward(model, part, traj, cond, adv,
                                                                           on_policy=True), torch.device("cpu"))
    return fidelity, plan, (traj, cond, adv)


@pytest.mark.parametrize("name", list(BACKWARDS))
def test_where_jagg_is_exact_the_audit_measures_cosine_one(name):
    fidelity, plan, _ = audit(AffineJacobianModel(), BACKWARDS[name])
    assert plan.interpolated, "the plan must interpolate some steps for this test to mean anything"
    assert fidelity.cosine == pytest.approx(1.0, abs=1e-6) and fidelity.rel_err < 1e-5
    assert fidelity.window_cosines == pytest.approx([1.0] * len(plan.windows), abs=1e-6)


@pytest.mark.parametrize("name", list(BACKWARDS))
def test_the_audit_measures_the_training_gradient_against_the_exact_one(name):
    """On a curved Jacobian the audit's figures are those of the plan's whole JAGG gradient (run_backward as in
    training) against plain autograd, both computed here apart from the audit."""
    model = AffineJacobianModel(curvature=True)
    fidelity, plan, (traj, cond, adv) = audit(model, BACKWARDS[name])
    exact = exact_gradient(model, traj, cond, adv, SETTINGS)
    jagg, _, _ = backward_gradient(model, traj, cond, adv, SETTINGS, BACKWARDS[name])
    cosine, rel_err = gradient_agreement(jagg, exact)
    assert cosine < 1 - 1e-6 and rel_err > 1e-3
    assert fidelity.cosine == pytest.approx(cosine, abs=1e-6) and fidelity.rel_err == pytest.approx(rel_err, rel=1e-4)
    for window_cosine, win, interpolated in zip(fidelity.window_cosines, plan.windows, plan.use_jagg):
        if interpolated and len(win.intermediates) > 0:
            assert window_cosine < 1 - 1e-6
        else:
            assert window_cosine == 1.0  # backpropagated exactly by JAGG too


def test_one_window_cosine_is_the_whole_cosine_when_one_window_covers_every_step():
    fidelity, plan, _ = audit(AffineJacobianModel(curvature=True), BackwardConfig(window=10))
    assert len(plan.windows) == 1
    assert fidelity.window_cosines == pytest.approx([fidelity.cosine], abs=1e-9)


def test_the_audit_puts_back_the_gradients_and_the_random_state():
    model = AffineJacobianModel(curvature=True)
    traj, cond, adv = rollout(model)
    plan = make_plan(BackwardConfig(window=5), traj, traj.num_steps, SETTINGS)
    held = [torch.full_like(p, 7.0) for p in params_of(model)]
    for p, grad in zip(params_of(model), held):
        p.grad = grad
    state = torch.get_rng_state()

    def backward_of(part):
        torch.rand(3)  # as a dropout would
        run_backward(model, part, traj, cond, adv, on_policy=True)

    run_audit(params_of(model), plan, backward_of, torch.device("cpu"))
    assert all(p.grad is grad and bool((grad == 7.0).all()) for p, grad in zip(params_of(model), held))
    assert torch.equal(torch.get_rng_state(), state)


def test_audited_samples_are_spread_over_the_batch():
    assert audit_indices(32, 8).tolist() == [0, 4, 9, 13, 18, 22, 27, 31]  # all 4 groups of 8
    assert audit_indices(6, 10).tolist() == list(range(6)) and audit_indices(5, 1).tolist() == [0]


def test_measure_fidelity_asks_one_pass_per_step_and_one_part_per_interpolated_window():
    model = AffineJacobianModel()
    traj, _, _ = rollout(model)
    config = BackwardConfig(window=4, frac=0.5, route_by="linearity")
    plan = make_plan(config, traj, traj.num_steps, SETTINGS)  # windows 0-3, 4-7, 8-9
    parts = []
    measure_fidelity(plan, lambda part: parts.append(part) or torch.ones(3))
    jagg_windows = [w for w, jagg in zip(plan.windows, plan.use_jagg) if jagg and len(w.intermediates) > 0]
    steps = parts[:10]
    assert [p.pass_steps for p in steps] == [[j] for j in range(10)] and not any(p.interpolated for p in steps)
    assert [p.windows for p in parts[10:]] == [[w] for w in jagg_windows] and len(jagg_windows) == 1


# -- in training ---------------------------------------------------------------------------------------------------

AUDIT_EVERY, ITERATIONS = 2, 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory, offline_module):
    """The same tiny run (LoRA dropout, two micro-batches) without and with the audit every 2 iterations."""
    folders = {}
    for name, every in (("plain", 0), ("audited", AUDIT_EVERY)):
        folders[name] = tmp_path_factory.mktemp(name)
        config = tiny_config(train__iterations=ITERATIONS, train__keep_checkpoints=ITERATIONS, lora__dropout=0.2,
                             train__gradient_accumulation_steps=2, backward__audit_every=every,
                             backward__audit_samples=3)
        trainer = Trainer(config, folders[name])
        trainer.setup()
        trainer.fit()
    return folders


@pytest.fixture(scope="module")
def offline_module():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield


AUDIT_KEYS = {metrics.JAGG_GRAD_COSINE, metrics.JAGG_GRAD_REL_ERR, metrics.JAGG_WINDOW_COSINES, metrics.TIME_AUDIT}


def test_audited_updates_and_the_next_ones_are_bit_identical(runs):
    for iteration in range(1, ITERATIONS + 1):
        weights = [torch.load(RunDirectory(runs[name]).checkpoint_dir(iteration) / TRAINING_STATE_FILE,
                              weights_only=False)["lora"] for name in ("plain", "audited")]
        assert len(weights[0]) > 0
        for plain, audited in zip(*weights):
            assert torch.equal(plain, audited), f"iteration {iteration}"
    plain, audited = (RunDirectory(runs[name]).read_metrics() for name in ("plain", "audited"))

    def training_figures(row):
        return {k: v for k, v in row.items() if k not in AUDIT_KEYS and not k.startswith("time/")}
    assert [training_figures(r) for r in plain] == [training_figures(r) for r in audited]


def test_the_audit_metrics_are_on_the_audited_iterations_only(runs):
    rows = RunDirectory(runs["audited"]).read_metrics()
    assert [r[metrics.ITERATION] for r in rows] == list(range(ITERATIONS + 1))
    for row in rows:
        audited = row[metrics.ITERATION] > 0 and row[metrics.ITERATION] % AUDIT_EVERY == 0
        assert (AUDIT_KEYS <= set(row)) if audited else not (AUDIT_KEYS & set(row)), row
        if audited:
            assert -1 <= row[metrics.JAGG_GRAD_COSINE] < 0.99999 and row[metrics.JAGG_GRAD_REL_ERR] > 0
            assert len(row[metrics.JAGG_WINDOW_COSINES]) == row[metrics.JAGG_WINDOWS] == 2
            assert row[metrics.TIME_AUDIT] > 0
    assert not any(AUDIT_KEYS & set(row) for row in RunDirectory(runs["plain"]).read_metrics())


def test_the_model_card_reports_the_mean_audited_cosine(runs):
    rows = RunDirectory(runs["audited"]).read_metrics()
    cosines = [r[metrics.JAGG_GRAD_COSINE] for r in rows if metrics.JAGG_GRAD_COSINE in r]
    card = str(build_model_card(read_run(runs["audited"]), "alice/audited"))
    assert f"audited at {len(cosines)} iterations" in card
    assert f"mean cosine **{sum(cosines) / len(cosines):.3f}**" in card
    assert "audited" not in str(build_model_card(read_run(runs["plain"]), "alice/plain"))


def test_the_app_plots_the_audited_cosine(runs):
    rows = RunDirectory(runs["audited"]).read_metrics()
    fidelity = live.curves(runs["audited"])[2]
    assert set(fidelity["series"]) == set(live.FIDELITY_SERIES.values())
    assert fidelity[["iteration", "value"]].values.tolist() == [
        [r[metrics.ITERATION], r[metrics.JAGG_GRAD_COSINE]] for r in rows if metrics.JAGG_GRAD_COSINE in r]
    assert live.curves(runs["plain"])[2].dropna().empty
    from app.ui import _curves  # the page: a point per audit, the plot shown only to a run that has one
    audited, plain = _curves(runs["audited"])[2], _curves(runs["plain"])[2]
    assert audited["visible"] is True and audited["value"].equals(fidelity) and plain["visible"] is False
    cosines = fidelity["value"]  # every point inside the axes, the iterations over the whole run
    assert audited["y_lim"][0] < min(0, cosines.min()) and audited["y_lim"][1] > 1
    assert audited["x_lim"][0] == 0 and audited["x_lim"][1] > fidelity["iteration"].max()


def test_audit_routing_keeps_jagg_until_the_first_audit_then_routes_by_its_cosines(tmp_path, offline):
    """min_fidelity 1: every window the audit saw below 1 takes the exact backward from the audit's iteration on;
    the audit measures every window under JAGG, and the cosines are kept in the checkpoint."""
    config = tiny_config(train__iterations=3, backward__audit_every=2, backward__audit_samples=2,
                         backward__min_fidelity=1.0, backward__route_by="audit")
    trainer = Trainer(config, tmp_path)
    trainer.setup()
    trainer.fit()
    rows = {r[metrics.ITERATION]: r for r in RunDirectory(tmp_path).read_metrics()}
    assert rows[1][metrics.JAGG_ROUTED_FRAC] == 1.0 and metrics.JAGG_GRAD_COSINE not in rows[1]
    cosines = rows[2][metrics.JAGG_WINDOW_COSINES]
    assert len(cosines) == 2 and all(c < 1 for c in cosines)
    assert rows[2][metrics.JAGG_ROUTED_FRAC] == rows[3][metrics.JAGG_ROUTED_FRAC] == 0.0
    state = torch.load(RunDirectory(tmp_path).checkpoint_dir(3) / TRAINING_STATE_FILE, weights_only=False)
    assert [c for _, _, c in state["audited_cosines"]] == pytest.approx(cosines)
