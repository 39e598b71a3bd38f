"""Which denoising steps an iteration trains (``grpo.window_placement``).

``T = ceil(num_steps * grpo.timestep_fraction)`` steps are trained (at least one), as *spans* of consecutive
steps; the backward plans its windows inside each span (:func:`~jagg_core.jagg.make_plan`)::

    range:  one span, steps  s .. s + T - 1        with s = grpo.trained_start (0: from the noise end), or
            with grpo.slide_every = E > 0 at iteration k (from 1)
            s_k = min(grpo.trained_start + floor((k - 1) / E), num_steps - T)   (MixGRPO's sliding window)
    random: the schedule is cut into blocks of W = backward.window steps, [0, W-1], [W, 2W-1], ... (the last
            may be shorter); each iteration trains ceil(T / W) of them, drawn without replacement

The random draw of iteration ``k`` is seeded by ``(train.seed, k)`` alone, so every process draws the same
blocks (their transformer calls and gradient collectives match) and a resumed run draws them again, as
DanceGRPO draws its trained timesteps per iteration. Steps outside the spans get no loss and no gradient;
with ``grpo.ode_after_trained`` they take the ODE step in the rollout (Flow-GRPO-Fast, MixGRPO).
Tree rollouts (``grpo.branch_factor``) split their groups at trained steps (:func:`branch_splits`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from .errors import UserError


def trained_count(num_steps: int, fraction: float) -> int:
    """``T = max(1, ceil(num_steps * fraction))``."""
    return max(1, math.ceil(num_steps * fraction))


def trained_spans(num_steps: int, fraction: float, placement: str, start: int, block: int,
                  seed: int, iteration: int = 1, slide_every: int = 0, first: int = 0) -> list[range]:
    """The spans of trained steps of ``iteration``, in step order, under ``placement`` (see the module's formulas);
    ``seed`` draws the blocks of ``random``. The steps placed in are ``first .. first + num_steps - 1`` (a two-expert
    model's trained expert's, ``first`` > 0 for its low-noise one): ``start`` and the blocks count from ``first``."""
    count = trained_count(num_steps, fraction)
    if placement == "range":
        if start + count > num_steps:
            raise UserError(f"grpo.trained_start {start} + {count} trained steps exceeds the {num_steps} steps the "
                            "trained expert denoises (model.expert): lower grpo.trained_start or "
                            "grpo.timestep_fraction")
        if slide_every:
            start = min(start + (iteration - 1) // slide_every, num_steps - count)
        return [range(first + start, first + start + count)]
    block = max(block, 1)
    blocks = [range(first + head, first + min(head + block, num_steps)) for head in range(0, num_steps, block)]
    chosen = random.Random(seed).sample(range(len(blocks)), min(math.ceil(count / block), len(blocks)))
    return [blocks[k] for k in sorted(chosen)]


def split_at(spans: list[range], step: int | None) -> list[range]:
    """The spans with the one holding ``step`` (not as its first) cut in two there, ``[a, step)`` and ``[step, b)``:
    a two-expert model's spans cut where the experts switch, so no JAGG window (planned inside a span) spans both.
    ``step`` None: the spans unchanged."""
    if step is None:
        return spans
    return [part for span in spans
            for part in ((span,) if not span.start < step < span.stop else (range(span.start, step),
                                                                             range(step, span.stop)))]


def most_trained_steps(num_steps: int, fraction: float, placement: str, block: int) -> int:
    """The most steps an iteration can train: ``T`` (range), ``min(num_steps, ceil(T / W) W)`` (random)."""
    count = trained_count(num_steps, fraction)
    return count if placement == "range" else min(num_steps, math.ceil(count / max(block, 1)) * max(block, 1))


def trained_steps(spans: list[range]) -> list[int]:
    """Every step of the spans, in order."""
    return [step for span in spans for step in span]


def branch_splits(trained: Sequence[int], group_size: int, factor: int) -> dict[int, int]:
    """Tree rollouts (BranchGRPO): a group of ``G = factor^k`` samples splits ``factor`` ways at ``k`` of the trained
    steps, spread evenly over them, first and last included: ``trained[round(q (n - 1) / (k - 1))]``,
    ``q = 0..k-1`` (``k = 1``: the first), over the ``n`` trained steps. A ValueError when ``factor < 2``,
    ``factor^k != G`` or ``k > n``: the one check of ``grpo.branch_factor`` (the config's and the rollout's)."""
    k = round(math.log(group_size, factor)) if factor > 1 else 0
    if factor < 2 or factor ** k != group_size or k > len(trained):
        raise ValueError(f"a group of {group_size} cannot split {factor} ways at {len(trained)} trained steps")
    n = len(trained)
    return {trained[round(q * (n - 1) / (k - 1)) if k > 1 else 0]: factor for q in range(k)}
