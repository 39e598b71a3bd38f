"""JAGG: Jacobian-Aggregated Group Gradient, and the exact per-step backward it replaces.

The GRPO loss is a sum of step losses ``L_j(v_j)`` where ``v_j = v_theta(z_j, sigma_j, c)``, so
``dL/dtheta = sum_j (dv_j/dtheta)^T s_j`` with the upstream gradient ``s_j = dL_j/dv_j`` (autograd
through the SDE step and loss only, never the model). The exact backward runs one transformer
backward per step. JAGG groups the steps into windows a..b and, assuming the parameter Jacobian
of v is affine in sigma along the window, ``dv_j/dtheta ~ (1 - alpha_j) dv_a/dtheta + alpha_j dv_b/dtheta``
with ``alpha_j = (sigma_a - sigma_j) / (sigma_a - sigma_b)``, so a window needs two backward passes::

    G_a = sum_j (1 - alpha_j) s_j,    G_b = sum_j alpha_j s_j

One formulation serves every mode. Each step is either a *pass step* (it gets a forward with grad
and a backward: every step of an exact window, and the endpoints of a JAGG window) or an
*interpolated* step (strictly inside a JAGG window). A pass step e is backpropagated with the
surrogate ``L_e(v_e) + <v_e, G_e>`` where ``G_e`` collects the interpolated steps' weighted
``s_j``; its own loss term is exact because ``alpha`` is 0 or 1 at the endpoints. With shared
knots adjacent windows share their endpoint, so K windows cost K + 1 passes instead of 2K.

Intermediate velocities ``v_j`` (needed for ``s_j``) come from a no-grad forward per step
(``forward``, the paper), or from the rollout with a first-order endpoint correction (``cached``)::

    v_j ~ v_j_old + (1 - alpha_j)(v_a - v_a_old) + alpha_j (v_b - v_b_old)

exact on-policy (then ``v_a = v_a_old``) at no extra forward.

Routing (``frac``, ``min_fidelity``) ranks windows by a score that predicts their fidelity: the linearity score,
the mean cosine similarity between the rollout velocities ``v_j`` and their interpolation
``(1 - alpha_j) v_a + alpha_j v_b`` (``route_by: linearity``), or the window's gradient cosine in the latest
fidelity audit (``route_by: audit``, :mod:`jagg_core.audit`). A window without
interior steps (at most two steps) is exact under either backward and takes no part in routing; of the
``K'`` others, the top ``round(frac K')`` by score use JAGG unless their score is below ``min_fidelity``,
and the rest take the exact backward.

Routing across processes: each process scores the windows on its own rollout batch, so with
``frac < 1`` processes can route differently, and windows of different lengths (the last one,
shared knots) then cost different numbers of passes. Plain data parallelism does not mind (the
gradients are averaged after the backward), but when the transformer is sharded every forward and
backward is a collective that all processes must make together. ``make_plan(agree=...)`` then
replaces the scores by a cross-process agreement before routing: :mod:`jagg_core.sharding` passes
the mean of each window's score over all processes (one gather of K floats), so every process routes
the same windows and gets the same passes, stacked the same way, from the rollout of the whole
global batch. Reducing the decision was chosen over padding with no-op passes: padding would spend
real transformer forwards and backwards (with their all-gathers) on nothing, while agreement costs
one tiny gather and routes on more samples.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Callable, Literal, Mapping

import torch

from .config import BackwardConfig
from .grpo import LossSettings, loss_scale, step_loss
from .models.base import Conditioning, FlowModel
from .sampler import Trajectory, shared_velocity


@dataclass(frozen=True)
class Window:
    """Consecutive steps ``start..end`` (both included)."""

    start: int
    end: int

    @property
    def steps(self) -> range:
        return range(self.start, self.end + 1)

    @property
    def intermediates(self) -> range:
        return range(self.start + 1, self.end)


def cover_with_windows(num_steps: int, window: int, shared_knots: bool, first: int = 0) -> list[Window]:
    """Cover steps ``first..first+num_steps-1`` with windows of ``window`` steps; the last may be shorter.

    Without shared knots the windows are disjoint (``[0, W-1], [W, 2W-1], ...`` from ``first = 0``). With
    shared knots consecutive windows share an endpoint (``[0, W-1], [W-1, 2W-2], ...``).
    """
    last = first + num_steps - 1
    if window <= 1 or num_steps <= 1:
        return [Window(i, i) for i in range(first, last + 1)]
    stride = window - 1 if shared_knots else window
    windows, start = [], first
    while start <= last:
        end = min(start + window - 1, last)
        windows.append(Window(start, end))
        if end == last:
            break
        start += stride
    return windows


def interpolation_weights(sigmas: torch.Tensor, win: Window) -> dict[int, float]:
    """``alpha_j = (sigma_a - sigma_j) / (sigma_a - sigma_b)`` for every step j of the window."""
    if win.start == win.end:
        return {win.start: 0.0}
    sigma_a, sigma_b = float(sigmas[win.start]), float(sigmas[win.end])
    return {j: (sigma_a - float(sigmas[j])) / (sigma_a - sigma_b) for j in win.steps}


def linearity_score(velocities: torch.Tensor, sigmas: torch.Tensor, win: Window) -> float:
    """Mean over intermediate steps and samples of ``cos(v_j, (1 - alpha_j) v_a + alpha_j v_b)``;
    1 for a window without intermediate steps."""
    if len(win.intermediates) == 0:
        return 1.0
    alpha = interpolation_weights(sigmas, win)
    v_a, v_b = velocities[win.start].flatten(1).float(), velocities[win.end].flatten(1).float()
    cosines = [torch.nn.functional.cosine_similarity(
        velocities[j].flatten(1).float(), (1 - alpha[j]) * v_a + alpha[j] * v_b, dim=1).mean()
        for j in win.intermediates]
    return float(torch.stack(cosines).mean())


def route_windows(windows: list[Window], scores: list[float], frac: float,
                  min_fidelity: float | None = None) -> list[bool]:
    """Which windows use JAGG. Only the ``K'`` windows with interior steps can (the others are exact anyway and
    count for nothing): the ``round(frac * K')`` of them with the highest score (ties: earlier first), less
    those whose score is below ``min_fidelity`` (None: no threshold)."""
    interior = [k for k, win in enumerate(windows) if len(win.intermediates) > 0]
    count = int(frac * len(interior) + 0.5)
    ranked = sorted(interior, key=lambda k: (-scores[k], k))
    chosen = {k for k in ranked[:count] if min_fidelity is None or scores[k] >= min_fidelity}
    return [k in chosen for k in range(len(windows))]


@dataclass
class BackwardPlan:
    """The backward of one rollout batch, made once by :func:`make_plan` and followed by every micro-batch
    and inner epoch: which steps are passes and which are interpolated (with their endpoint weights), how
    passes are batched, where intermediate velocities come from, and the loss with its batch geometry."""

    windows: list[Window]
    use_jagg: list[bool]
    scores: list[float]               # each window's routing score (backward.route_by)
    linearity: list[float]            # each window's linearity score on this rollout batch (1: no interior step)
    loss: LossSettings
    batch_size: int                   # samples in the rollout batch
    trained_steps: int                # T: the number of trained steps (the windows' steps), the loss's normalizer
    joint: bool = False               # pass steps two at a time, stacked in one forward
    velocities: Literal["cached", "forward"] = "cached"
    pass_steps: list[int] = field(default_factory=list)
    interpolated: dict[int, tuple[int, int, float]] = field(default_factory=dict)  # j -> (a, b, alpha_j)

    @property
    def routed_frac(self) -> float:
        """The fraction of the windows with interior steps (the only ones routing decides) that use JAGG."""
        return sum(self.use_jagg) / max(sum(len(win.intermediates) > 0 for win in self.windows), 1)

    @property
    def linearity_mean(self) -> float:
        return sum(self.linearity) / max(len(self.linearity), 1)


def make_plan(config: BackwardConfig, batch: Trajectory, trained: int | list[range], loss: LossSettings,
              agree: Callable[[list[float]], list[float]] | None = None,
              audited: Mapping[Window, float] | None = None) -> BackwardPlan:
    """Plan the backward of the trained steps of the rollout batch ``batch`` under ``config``: ``trained`` = the
    spans of consecutive trained steps (:mod:`jagg_core.placement`; windows never cross a span's end), an int
    ``T`` = the one span ``0..T-1``. ``loss`` is the step loss (its ``scale`` is set per micro-batch by
    :func:`run_backward`).

    The windows' routing scores are their linearity scores (``backward.route_by: linearity``), or their cosines
    in the latest fidelity audit, ``audited`` (``route_by: audit``; a window not audited yet scores 1).
    ``agree`` maps this process's window scores to scores every process shares (e.g. their mean over the
    processes) before routing, so that all processes plan the same passes (see the module's "Routing across
    processes"); None routes on the local scores."""
    spans = [range(trained)] if isinstance(trained, int) else trained
    common = {"loss": loss, "batch_size": batch.batch_size, "trained_steps": sum(len(span) for span in spans)}
    window = 1 if config.mode == "exact" else config.window
    windows = [win for span in spans
               for win in cover_with_windows(len(span), window, config.shared_knots, span.start)]
    if config.mode == "exact":
        plan = BackwardPlan(windows, [False] * len(windows), [1.0] * len(windows), [1.0] * len(windows), **common)
        return routed(plan, plan.scores, config, batch.sigmas)
    linearity = [linearity_score(batch.velocities, batch.sigmas, w) for w in windows]
    plan = BackwardPlan(windows, [True] * len(windows), linearity, linearity, joint=config.joint,
                        velocities=config.velocities, **common)
    return rescored(plan, config, batch.sigmas, agree, audited)


def rescored(plan: BackwardPlan, config: BackwardConfig, sigmas: torch.Tensor,
             agree: Callable[[list[float]], list[float]] | None = None,
             audited: Mapping[Window, float] | None = None) -> BackwardPlan:
    """``plan`` (a JAGG plan) routed again by its windows' scores under ``config`` (``route_by``): the linearity
    scores it holds, or the cosines ``audited`` (a window not audited yet scores 1), made common by ``agree``."""
    scores = [(audited or {}).get(w, 1.0) for w in plan.windows] if config.route_by == "audit" else plan.linearity
    if agree is not None:
        scores = [float(score) for score in agree(scores)]
    return routed(plan, scores, config, sigmas)


def routed(plan: BackwardPlan, scores: list[float], config: BackwardConfig, sigmas: torch.Tensor) -> BackwardPlan:
    """``plan`` with its windows routed by ``scores`` (exact mode: none uses JAGG), and the pass and interpolated
    steps that follow."""
    use_jagg = [False] * len(plan.windows) if config.mode == "exact" else \
        route_windows(plan.windows, scores, config.frac, config.min_fidelity)
    passes: set[int] = set()
    interpolated: dict[int, tuple[int, int, float]] = {}
    for win, jagg in zip(plan.windows, use_jagg):
        if jagg:
            passes.update({win.start, win.end})
            alpha = interpolation_weights(sigmas, win)
            interpolated.update({j: (win.start, win.end, alpha[j]) for j in win.intermediates})
        else:
            passes.update(win.steps)
    return replace(plan, use_jagg=use_jagg, scores=list(scores), pass_steps=sorted(passes),
                   interpolated=interpolated)


def window_part(plan: BackwardPlan, win: Window, interpolate: bool) -> BackwardPlan:
    """The part of ``plan`` that backpropagates the steps of ``win`` alone, with the plan's loss, batch geometry,
    velocities and stacking: ``interpolate`` (``win`` is one of the plan's JAGG windows) = its two endpoint passes
    with its interpolated steps aggregated onto them, ``G_a = sum_j (1 - alpha_j) s_j``, ``G_b = sum_j alpha_j s_j``;
    otherwise one pass per step, the exact backward of those steps. Used by :mod:`jagg_core.audit`."""
    interpolated = {j: plan.interpolated[j] for j in win.intermediates} if interpolate else {}
    passes = sorted({win.start, win.end}) if interpolate else list(win.steps)
    k = plan.windows.index(win) if win in plan.windows else None
    score, linearity = (plan.scores[k], plan.linearity[k]) if k is not None else (1.0, 1.0)
    return replace(plan, windows=[win], use_jagg=[interpolate], scores=[score], linearity=[linearity],
                   pass_steps=passes, interpolated=interpolated)


@dataclass
class BackwardResult:
    loss: float
    kl: float
    ratio_mean: float
    clip_frac: float
    num_passes: int
    ratio_max_dev: float  # max |ratio - 1| over the micro-batch's samples and trained steps


def run_backward(model: FlowModel, plan: BackwardPlan, batch: Trajectory, cond: Conditioning,
                 advantages: torch.Tensor, *, on_policy: bool,
                 backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
                 autocast: Callable = nullcontext) -> BackwardResult:
    """Accumulate this micro-batch's share of ``dL/dtheta`` into the parameters' ``.grad`` following ``plan``.

    ``batch``, ``cond`` and ``advantages`` are a micro-batch of the planned rollout batch (or all of it);
    its step losses are scaled by :func:`~jagg_core.grpo.loss_scale`, so the micro-batches' gradients add
    up to the gradient of the batch's loss. ``on_policy`` says the parameters are those that made the
    rollout, so the rollout's endpoint velocities are the current ones. ``backward`` runs a scalar's
    backward (accelerate's, for loss scaling); ``autocast`` opens the mixed-precision context for forwards.
    """
    settings = replace(plan.loss, scale=loss_scale(batch.batch_size, plan.batch_size, plan.trained_steps))
    stats: list[dict[str, torch.Tensor]] = []
    loss_total = 0.0

    def forward(steps: list[int]) -> list[torch.Tensor]:
        """The velocities at ``steps``, stacked into one call; once per node of a group rollout's tree."""
        z = torch.cat([batch.latents[j] for j in steps])
        sigma = torch.cat([batch.sigmas[j].expand(batch.latents.shape[1]) for j in steps]).to(z.device)
        nodes = None
        if batch.node_ids is not None:  # ids made distinct across the stacked steps
            nodes = torch.cat([batch.node_ids[j] + k * (int(batch.node_ids.max()) + 1) for k, j in enumerate(steps)])
        with autocast():
            v = shared_velocity(model, z, sigma, FlowModel.tile_conditioning(cond, len(steps)), nodes)
        return list(v.float().chunk(len(steps)))

    group = 2 if plan.joint else 1  # pass steps per forward
    references = _reference_velocities(model, plan, batch, forward, group) if settings.kl_beta > 0 else {}

    # Upstream gradients of the interpolated steps, aggregated at their window's endpoints.
    composite: dict[int, torch.Tensor] = {}
    if plan.interpolated:
        velocities = _intermediate_velocities(plan, batch, forward, on_policy)
        for j, (a, b, alpha) in plan.interpolated.items():
            v_j = velocities[j].detach().float().requires_grad_(True)
            loss_j, step_stats = step_loss(v_j, j, batch, advantages, settings, references.get(j))
            (s_j,) = torch.autograd.grad(loss_j, v_j)
            composite[a] = composite.get(a, 0) + (1 - alpha) * s_j
            composite[b] = composite.get(b, 0) + alpha * s_j
            loss_total += float(loss_j.detach())
            stats.append(step_stats)

    # One forward with grad and one backward per pass step (two stacked at a time when joint).
    for k in range(0, len(plan.pass_steps), group):
        steps = plan.pass_steps[k:k + group]
        surrogate = 0
        for e, v_e in zip(steps, forward(steps)):
            loss_e, step_stats = step_loss(v_e, e, batch, advantages, settings, references.get(e))
            loss_total += float(loss_e.detach())
            stats.append(step_stats)
            surrogate = surrogate + loss_e
            if e in composite:
                surrogate = surrogate + (v_e * composite[e]).sum()
        backward(surrogate)

    def average(key: str) -> float:
        return float(torch.stack([s[key] for s in stats]).mean())

    return BackwardResult(loss_total, average("kl"), average("ratio"), average("clip_frac"), len(plan.pass_steps),
                          float(torch.stack([s["ratio_dev"] for s in stats]).max()))


def _reference_velocities(model: FlowModel, plan: BackwardPlan, batch: Trajectory, forward,
                          group: int) -> dict[int, torch.Tensor]:
    """The base model's velocity (adapter disabled) at every trained step, for the KL term: the rollout's, when it
    recorded them (``grpo.kl_reference: rollout``); else computed here, only where gradients flow: a no-grad
    forward with the adapter disabled at the pass steps (``group`` stacked, as the passes), and at an interpolated
    step j of window a..b the rollout velocity with the endpoints' reference offsets interpolated, as the cached
    velocities are::

        v_ref_j ~ v_j_old + (1 - alpha_j)(v_ref_a - v_a_old) + alpha_j (v_ref_b - v_b_old)

    exact when the adapter's part of the velocity, ``v - v_ref``, is affine in sigma along the window and does not
    depend on z (where JAGG itself is exact)."""
    if batch.ref_velocities is not None:
        return {j: batch.reference_velocity(j) for j in [*plan.pass_steps, *plan.interpolated]}
    references = {}
    with torch.no_grad(), model.adapters_disabled():
        for k in range(0, len(plan.pass_steps), group):
            steps = plan.pass_steps[k:k + group]
            references.update(zip(steps, forward(steps)))
    return {**references, **_endpoint_corrected(plan, batch, references)}


def _endpoint_corrected(plan: BackwardPlan, batch: Trajectory, at_endpoints: dict[int, torch.Tensor]
                        ) -> dict[int, torch.Tensor]:
    """At every interpolated step j of window a..b, the rollout velocity corrected by the endpoints' change from
    the rollout's, ``v_j_old + (1 - alpha_j)(u_a - v_a_old) + alpha_j (u_b - v_b_old)``, where ``u`` is
    ``at_endpoints`` (the current velocities, or the reference's)."""
    old = batch.velocities
    return {j: old[j] + (1 - alpha) * (at_endpoints[a] - old[a]) + alpha * (at_endpoints[b] - old[b])
            for j, (a, b, alpha) in plan.interpolated.items()}


def _intermediate_velocities(plan: BackwardPlan, batch: Trajectory, forward, on_policy: bool) -> dict[int, torch.Tensor]:
    """``v_j`` of every interpolated step under the current parameters (no grad).

    ``forward``: one stacked no-grad forward per window over its intermediate steps. ``cached``: the
    rollout velocity plus the endpoint correction; on-policy the correction is zero, and off-policy
    the current endpoint velocities come from one stacked no-grad forward.
    """
    with torch.no_grad():
        if plan.velocities == "forward":
            by_window: dict[tuple[int, int], list[int]] = {}
            for j, (a, b, _) in plan.interpolated.items():
                by_window.setdefault((a, b), []).append(j)
            return {j: v for steps in by_window.values() for j, v in zip(steps, forward(steps))}
        if on_policy:
            return {j: batch.velocities[j] for j in plan.interpolated}
        endpoints = sorted({e for a, b, _ in plan.interpolated.values() for e in (a, b)})
        return _endpoint_corrected(plan, batch, dict(zip(endpoints, forward(endpoints))))
