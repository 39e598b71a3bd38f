"""The benchmark's plumbing on a minimal run: rows, keys, gradients against an independent exact gradient,
memory figures, files. No timing asserts but one: every figure in seconds lies within the bench's own wall clock."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from jagg_core.bench.cli import run_bench
from jagg_core.bench.rows import ROW_KEYS
from jagg_core.bench.tables import write_outputs
from jagg_core.bench.variants import EXACT, BenchOptions, Variant
from jagg_core.bench.workload import Workload

WINDOW_TWO, WINDOW_THREE = Variant("cached", 2, True), Variant("cached", 3, True)


@pytest.fixture(scope="module")
def bench():
    """(rows, the train-phase workload, each variant's gradient as the bench took it, the bench's wall clock)."""
    options = BenchOptions(models=["tiny-sd3"], windows=(2, 3), modes=("cached",), joints=(True,), fracs=(),
                           repeats=1, warmup=0, iterations=1, seeds=(0,), overrides=("grpo.prompts_per_iteration=1",))
    assert options.grid(0) == [EXACT, WINDOW_TWO, WINDOW_THREE]
    workloads, gradients, last = [], {}, {}
    backward, gradient = Workload.backward, Workload.gradient

    def spy_backward(self, variant):
        if self not in workloads:
            workloads.append(self)
        last["variant"] = variant
        return backward(self, variant)

    def spy_gradient(self):
        grad = gradient(self)
        assert last["variant"] not in gradients, "one gradient per variant (repeat 0)"
        gradients[last["variant"]] = grad.clone()
        return grad

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Workload, "backward", spy_backward)
        patch.setattr(Workload, "gradient", spy_gradient)
        start = time.perf_counter()
        rows = run_bench(options, threads=2, log=lambda line: None)
        elapsed = time.perf_counter() - start
    assert len(workloads) == 1 and set(gradients) == {EXACT, WINDOW_TWO, WINDOW_THREE}
    return rows, workloads[0], gradients, elapsed


@pytest.fixture(scope="module")
def rows(bench):
    return bench[0]


def per_step_exact_gradient(work: Workload) -> torch.Tensor:
    """The LoRA gradient of the on-policy GRPO loss of ``work``'s rollout batch, computed here without the
    project's loss or backward code: for every step i, one forward with grad and one backward of
    ``1/T mean_b max(-A r, -A clip(r, 1 - eps, 1 + eps))``, ``r = p_theta(z_{i+1} | z_i) / p_old``, the Gaussian
    of Flow-GRPO's SDE step (mean ``z (1 + std^2 / (2 s) dt) + v (1 + std^2 (1 - s) / (2 s)) dt``, standard
    deviation ``std sqrt(-dt)``) written out."""
    trainer, traj, cond, adv = work.trainer, work.traj, work.cond, work.advantages
    cfg = trainer.config
    assert cfg.grpo.kl_beta == 0 and cfg.grpo.timestep_fraction == 1 and not cfg.grpo.ode_after_trained
    steps, clip = traj.num_steps, cfg.grpo.clip_range
    for param in trainer.params:
        param.grad = None
    for i in range(steps):
        s, s_next, std_t = float(traj.sigmas[i]), float(traj.sigmas[i + 1]), float(traj.std_t[i])
        dt = s_next - s
        z, z_next = traj.latents[i].float(), traj.latents[i + 1].float()
        v = trainer.model.velocity(z, traj.sigmas[i].to(z.device), cond).float()
        mean = z * (1 + std_t ** 2 / (2 * s) * dt) + v * (1 + std_t ** 2 * (1 - s) / (2 * s)) * dt
        log_prob = torch.distributions.Normal(mean, std_t * math.sqrt(-dt)).log_prob(z_next).flatten(1).mean(1)
        ratio = torch.exp(log_prob - traj.log_probs[i].to(log_prob.device))
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)).mean() / steps
        loss.backward()
    grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double().cpu()
                      for p in trainer.params])
    for param in trainer.params:
        param.grad = None
    return grad


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def relative_error(a: torch.Tensor, reference: torch.Tensor) -> float:
    return float((a - reference).norm() / reference.norm())


def test_rows_have_the_required_keys(rows):
    assert [(r["section"], r.get("setup"), r["mode"], r["window"]) for r in rows] == [
        ("train_phase", None, "exact", 1), ("train_phase", None, "cached", 2), ("train_phase", None, "cached", 3),
        ("iteration", "flow_grpo", "exact", 1), ("iteration", "exact", "exact", 1),
        ("iteration", "default", "cached", 5), ("iteration", "tree", "cached", 5)]
    for row in rows:
        assert set(ROW_KEYS) <= set(row), set(ROW_KEYS) - set(row)
        assert row["model"] == "tiny-sd3" and row["params_m"] > 0 and row["seconds"] > 0


def test_every_time_lies_within_the_benchs_wall_clock(bench):
    """The rows' seconds against a clock read outside the bench: the train phase's rollout and backward (the
    fastest of the repeats) and each setup's iteration all ran inside it, so none can exceed it (a figure in
    milliseconds, or summed over repeats or iterations where one is meant, would)."""
    rows, _, _, elapsed = bench
    phase, iteration = rows[:3], [r for r in rows if r["section"] == "iteration"]
    assert 0 < phase[0]["rollout_s"] and sum(r["train_s"] for r in phase) + phase[0]["rollout_s"] < elapsed
    assert 0 < sum(r["seconds"] for r in iteration) < elapsed
    assert all(0 < r[key] for r in iteration for key in ("rollout_s", "train_s"))


def test_whole_iterations_compare_the_default_with_flow_grpos_default_and_the_exact_backward(rows):
    flow_grpo, exact, default, tree = (r for r in rows if r["section"] == "iteration")
    assert (flow_grpo["trained_steps"], flow_grpo["sde_every_step"], flow_grpo["backward"]) == (9, True, "exact")
    assert (exact["trained_steps"], exact["sde_every_step"], exact["backward"]) == (
        default["trained_steps"], default["sde_every_step"], "exact")  # the default's rollout
    assert (default["trained_steps"], default["backward"]) == (10, "cached W=5")  # the tiny-sd3 preset's
    assert (tree["trained_steps"], tree["backward"]) == (10, "cached W=5")


def test_the_jagg_iteration_row_has_the_cost_of_one_audit(bench):
    rows, _, _, elapsed = bench
    _, exact, jagg, _ = (r for r in rows if r["section"] == "iteration")
    assert exact["audit_s"] is None and exact["audit_ratio"] is None  # the exact backward has nothing to audit
    assert 0 < jagg["audit_s"] < elapsed and jagg["audit_ratio"] > 0
    assert -1 <= jagg["audit_cosine"] <= 1


def test_the_overrides_apply_to_the_workload(bench):
    _, work, _, _ = bench
    assert work.overrides == ("grpo.prompts_per_iteration=1",) and work.traj.batch_size == 4  # 1 prompt x G = 4


def test_the_exact_row_is_the_per_step_gradient_and_window_two_is_exact(bench):
    rows, work, gradients, _ = bench
    exact, window_two = gradients[EXACT], gradients[WINDOW_TWO]
    assert torch.isfinite(exact).all() and exact.norm() > 0, "the exact gradient must not be zero"
    reference = per_step_exact_gradient(work)
    assert reference.norm() > 0
    assert relative_error(exact, reference) < 1e-4 and cosine(exact, reference) > 1 - 1e-6, (
        relative_error(exact, reference), cosine(exact, reference))
    # W = 2 has no intermediate step: every step is a pass, the gradient is the exact one
    assert rows[1]["window"] == 2 and rows[1]["passes"] == rows[0]["passes"] == work.traj.num_steps
    assert relative_error(window_two, reference) < 1e-4, relative_error(window_two, reference)
    assert rows[1]["grad_cosine"] == pytest.approx(1.0, abs=1e-6) and rows[1]["grad_rel_err"] < 1e-4


def test_a_wider_window_on_a_nonlinear_model_is_close_to_exact_but_not_exact(bench):
    """W = 3 interpolates the intermediate steps' velocities: on the (nonlinear) DiT its gradient differs from the
    exact one, and the row's cosine and relative error are those of the gradients themselves."""
    rows, work, gradients, _ = bench
    row, exact, approx = rows[2], gradients[EXACT], gradients[WINDOW_THREE]
    assert row["window"] == 3 and row["passes"] < work.traj.num_steps
    for r, variant in zip(rows[:3], (EXACT, WINDOW_TWO, WINDOW_THREE)):
        grad = gradients[variant]
        assert r["grad_cosine"] == pytest.approx(cosine(grad, exact), abs=1e-9)
        assert r["grad_rel_err"] == pytest.approx(relative_error(grad, exact), abs=1e-9)
    assert row["grad_cosine"] < 1 - 1e-6 and row["grad_rel_err"] > 1e-4, row
    assert relative_error(approx, exact) > 1e-4 and approx.norm() > 0
    assert row["grad_cosine"] > 0.5, "the JAGG gradient still points the exact one's way"


def test_memory_figures_exist_with_the_peak_above_the_base(rows):
    for row in rows[:3]:
        assert row["peak_mem_basis"] and row["rollout_peak_mem_mb"] > 0, row
        assert row["base_mem_mb"] > 0 and row["peak_mem_mb"] >= row["base_mem_mb"], row
        assert row["peak_mem_ratio"] is not None and math.isfinite(row["peak_mem_ratio"]), row
        assert row["peak_mem_ratio"] >= 0, row
    for row in rows[3:]:
        assert row["peak_mem_ratio"] is None and row["peak_mem_basis"] is None


def test_outputs_are_written(rows, tmp_path):
    paths = {"json_path": tmp_path / "out" / "bench.json", "table_path": tmp_path / "bench.md",
             "plot_path": tmp_path / "reward.png"}
    table = write_outputs(rows, **paths)
    assert json.loads(paths["json_path"].read_text()) == json.loads(json.dumps(rows))
    assert paths["table_path"].read_text() == table and "| tiny-sd3 |" in table
    assert paths["plot_path"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

