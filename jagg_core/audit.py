"""Fidelity audit: the JAGG gradient of a rollout batch beside the exact per-step one, measured, never applied.

Every ``backward.audit_every`` iterations the trainer backpropagates ``backward.audit_samples`` samples of the
rollout batch (:func:`audit_indices`) again, before its update: under the iteration's own JAGG plan and under
the exact per-step backward. With ``g_j = (dv_j/dtheta)^T s_j`` the exact gradient of step j (one pass per
step) and ``c_k`` the JAGG gradient of window k's steps alone (:func:`~jagg_core.jagg.window_part`: its two
endpoint passes carrying its interpolated steps)::

    e_k     = sum_{j in window k} g_j                 the exact gradient of window k's steps
    g_exact = sum_j g_j
    g_jagg  = sum_k c_k - sum_j (n_j - 1) g_j         n_j = windows holding step j (2 at a shared knot)

(a knot shared by two windows is a pass of both, with its own exact term in both, so one is taken off), and::

    jagg/grad_cosine    = cos(g_jagg, g_exact)
    jagg/grad_rel_err   = |g_jagg - g_exact| / |g_exact|
    jagg/window_cosines = [cos(c_k, e_k) for every window k]

A window without interpolated steps (routed to the exact backward by ``backward.frac`` or ``backward.min_fidelity``,
or of at most two steps) is backpropagated exactly by JAGG as well: its ``c_k`` is ``e_k``, taken without another pass, and its
cosine is 1. A plan that interpolates no step (``backward.mode: exact``, W <= 2, ``frac: 0``) has nothing to
audit. The cost is ``T`` exact passes plus two per interpolated window, on the audited samples only, in
micro-batches no larger than the training's and stacked as the plan says, so the audit's transformer passes
need no more memory than the training's; it keeps ``K + 3`` flattened LoRA gradients for ``K`` windows.

What the audit leaves alone (:func:`run_audit`): the gradients already in ``.grad`` are set aside and put back,
so the iteration's update is the one it would be without the audit, and the random number generators are
forked, so the forwards' dropout draws nothing from the run's streams and later iterations are unchanged too.
The audit's backwards are plain local backwards (the trainer averages gradients across processes only in its
optimizer step). Every process audits its own samples at the same iterations, so under a sharded transformer
all processes make the same transformer calls; the metrics row holds rank 0's audit.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from .jagg import BackwardPlan, Window, window_part
from .rng import forked_rng


@dataclass(frozen=True)
class Fidelity:
    """What one audit measured (see the module's formulas)."""

    cosine: float
    rel_err: float
    window_cosines: list[float]


def audit_indices(batch_size: int, samples: int) -> torch.Tensor:
    """``min(samples, B)`` sample indices evenly spread over the ``B`` samples of a rollout batch; the samples
    are prompt-major, so every prompt's group is audited once ``samples`` reaches the number of prompts."""
    return torch.linspace(0, batch_size - 1, min(samples, batch_size)).round().long()


def gradient_agreement(approx: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """``cos(approx, exact)`` and ``|approx - exact| / |exact|`` of two flattened gradients, in float64."""
    approx, exact = approx.double(), exact.double()
    cosine = torch.nn.functional.cosine_similarity(approx, exact, dim=0)
    return float(cosine), float((approx - exact).norm() / exact.norm())


def flat_gradient(params: list[torch.Tensor]) -> torch.Tensor:
    """The parameters' ``.grad`` as one float32 vector (zeros where a parameter got none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().float()
                      for p in params])


def measure_fidelity(plan: BackwardPlan, gradient_of: Callable[[BackwardPlan], torch.Tensor]) -> Fidelity:
    """The audit's figures for ``plan``, where ``gradient_of(part)`` is the flattened gradient of the audited
    samples under the partial plan ``part`` (:func:`~jagg_core.jagg.window_part`)."""
    exact_of_window = [0] * len(plan.windows)
    exact = counted_twice = 0
    for j in sorted({j for win in plan.windows for j in win.steps}):
        step = gradient_of(window_part(plan, Window(j, j), interpolate=False))
        holders = [k for k, win in enumerate(plan.windows) if j in win.steps]
        exact = exact + step
        counted_twice = counted_twice + (len(holders) - 1) * step
        for k in holders:
            exact_of_window[k] = exact_of_window[k] + step
    jagg, window_cosines = -counted_twice, []
    for win, interpolated, exact_here in zip(plan.windows, plan.use_jagg, exact_of_window):
        if interpolated and len(win.intermediates) > 0:
            here = gradient_of(window_part(plan, win, interpolate=True))
            window_cosines.append(gradient_agreement(here, exact_here)[0])
        else:
            here = exact_here
            window_cosines.append(1.0)
        jagg = jagg + here
    cosine, rel_err = gradient_agreement(jagg, exact)
    return Fidelity(cosine, rel_err, window_cosines)


@contextmanager
def gradients_set_aside(params: list[torch.Tensor]):
    """Inside, every parameter's ``.grad`` starts empty; on leaving, the gradients held before are put back (the
    same tensors, untouched)."""
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(params, held):
            p.grad = grad


def run_audit(params: list[torch.Tensor], plan: BackwardPlan, backward_of: Callable[[BackwardPlan], None],
              device: torch.device) -> Fidelity:
    """:func:`measure_fidelity` of ``plan``, where ``backward_of(part)`` adds the audited samples' gradient under
    ``part`` to the ``params``' ``.grad``; the gradients already there and the random number generators (CPU,
    and ``device``'s) are as they were afterwards."""
    def gradient_of(part: BackwardPlan) -> torch.Tensor:
        backward_of(part)
        gradient = flat_gradient(params)
        for p in params:
            p.grad = None
        return gradient

    with forked_rng(device), gradients_set_aside(params):
        return measure_fidelity(plan, gradient_of)
