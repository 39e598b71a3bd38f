"""The training algorithms (``train.algorithm``), each one module behind :class:`~.base.Algorithm`:

    grpo   GRPO with the exact or the JAGG backward (:mod:`.grpo`), the default
    nft    DiffusionNFT, forward-process RL with implicit positive and negative policies (:mod:`.nft`)
    awm    Advantage Weighted Matching, the advantage-weighted flow-matching loss (:mod:`.awm`)
"""

from __future__ import annotations

from .awm import AwmAlgorithm
from .base import Algorithm, TrainingContext
from .grpo import GrpoAlgorithm
from .nft import NftAlgorithm

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (GrpoAlgorithm, NftAlgorithm, AwmAlgorithm)}


def make_algorithm(ctx: TrainingContext) -> Algorithm:
    """The algorithm ``train.algorithm`` names, over ``ctx``."""
    return ALGORITHMS[ctx.config.train.algorithm](ctx)
