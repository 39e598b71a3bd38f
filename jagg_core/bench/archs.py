"""The real-architecture bench (``--arch``): the model's name, its config overrides and what runs."""

from __future__ import annotations

from ..archs import RANDOM_PREFIX, arch_names, hub_id, parse_random_model
from ..errors import UserError
from .variants import BenchOptions, bench_config

#: the real-architecture bench: exact, and JAGG at W = 2, 4, 5 with forward and cached velocities (joint and
#: sequential endpoints), 3 repeats, a 3-iteration training; ``--quick``: W = 2, 5 cached, 2 repeats, no training
ARCH_OPTIONS = {"windows": (2, 4, 5), "modes": ("forward", "cached"), "fracs": (), "repeats": 3, "iterations": 3,
                "seeds": (0,)}
ARCH_OPTIONS_QUICK = {**ARCH_OPTIONS, "windows": (2, 5), "modes": ("cached",), "repeats": 2, "iterations": 0}
#: default image side of the real-architecture bench, by device type
ARCH_RESOLUTION = {"cuda": 512, "cpu": 64}


def arch_model(arch: str | None, random_weights: bool, layers: int | None = None) -> str:
    """``model.name`` of the ``--arch`` bench: ``random:ARCH[@LAYERS]`` with random weights, else the arch's
    Hub id (its real weights, downloaded); a missing or unknown arch is a :class:`UserError`."""
    if arch is None:
        raise UserError(f"--random-weights needs --arch NAME; archs: {', '.join(arch_names())}")
    if not random_weights:
        if layers is not None:
            raise UserError("--layers needs --random-weights (the Hub model has its real depth)")
        return hub_id(arch)
    name = RANDOM_PREFIX + arch + (f"@{layers}" if layers is not None else "")
    parse_random_model(name)  # an unknown arch or a layer count out of range
    return name


def arch_overrides(device_type: str, resolution: int | str | None = None, quantize: str | None = None) -> list[str]:
    """Config overrides of the real-architecture bench: the resolution (default :data:`ARCH_RESOLUTION`),
    bf16 weights and bf16 autocast on a GPU (float32 on a CPU), and ``model.quantize``."""
    overrides = [f"sampling.resolution={resolution or ARCH_RESOLUTION.get(device_type, ARCH_RESOLUTION['cpu'])}"]
    if device_type == "cuda":
        overrides += ["model.dtype=bfloat16", "train.mixed_precision=bf16"]
    if quantize:
        overrides.append(f"model.quantize={quantize}")
    return overrides


def arch_options(model: str, overrides: list[str], quick: bool = False, **changes) -> BenchOptions:
    """The real-architecture bench of ``model`` (:data:`ARCH_OPTIONS`, or :data:`ARCH_OPTIONS_QUICK`) under
    ``overrides``, which are checked here."""
    bench_config(model, overrides)
    return BenchOptions(models=[model], overrides=tuple(overrides),
                        **{**(ARCH_OPTIONS_QUICK if quick else ARCH_OPTIONS), **changes})
