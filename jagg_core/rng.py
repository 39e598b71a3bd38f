"""Random numbers drawn aside: a block that draws from torch's generators without moving the run's own streams."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch


def forked_rng(device: torch.device) -> AbstractContextManager:
    """``torch.random.fork_rng`` over the CPU generator and, on a GPU, ``device``'s: what the block draws (a
    model's random weights, a judge's initialisation, an audit's or a probe's noise) leaves both generators as they
    were, so the run's draws after it are the same with or without the block."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
