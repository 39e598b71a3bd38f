"""The variants under test, what the bench runs (:class:`BenchOptions`), and each model's run config."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import BackwardConfig, RunConfig, list_presets, load_config
from ..models import embedded_models

EMBEDDED_MODEL = "jagg-shapes"
LARGE_MODEL = "bench-sd3-31m"
JAGG_MODES = ("forward", "cached", "cached_shared")
#: The preset a model runs with when its name is not a preset's (default: tiny-sd3's), and overrides: the CPU
#: models run the default task.
MODEL_PRESETS = {EMBEDDED_MODEL: "shapes", LARGE_MODEL: "shapes"}
MODEL_OVERRIDES = {
    LARGE_MODEL: ["model.max_sequence_length=16"],
}


@dataclass(frozen=True)
class Variant:
    """One backward configuration under test."""

    mode: str            # exact | forward | cached | cached_shared
    window: int = 1
    joint: bool = False
    frac: float = 1.0

    def backward_config(self, **settings) -> BackwardConfig:
        """The backward section of this variant, with other keys of it (``audit_every`` ...) from ``settings``."""
        if self.mode == "exact":
            return BackwardConfig(mode="exact", **settings)
        return BackwardConfig(mode="jagg", window=self.window, joint=self.joint, frac=self.frac, route_by="linearity",
                              velocities="forward" if self.mode == "forward" else "cached",
                              shared_knots=self.mode == "cached_shared", **settings)

    @property
    def label(self) -> str:
        if self.mode == "exact":
            return "exact"
        routed = f" frac={self.frac:g}" if self.frac < 1 else ""
        return f"{self.mode} W={self.window} {'joint' if self.joint else 'seq'}{routed}"


EXACT = Variant("exact")


def variant_grid(windows, joints=(True, False), modes=JAGG_MODES, fracs=(), routing_window: int = 5) -> list[Variant]:
    """``exact``, every JAGG mode x window x endpoint layout, then the routed (``frac < 1``) variants."""
    grid = [EXACT] + [Variant(m, w, j) for m in modes for w in windows for j in joints]
    return grid + [Variant("cached", routing_window, True, f) for f in fracs]


@dataclass
class BenchOptions:
    """What to run. The first model gets ``windows`` and the routing rows; the others ``other_windows``."""

    models: list[str] = field(default_factory=lambda: default_models())
    windows: tuple[int, ...] = (2, 4, 5, 10)
    other_windows: tuple[int, ...] = (2, 4, 5, 10)
    modes: tuple[str, ...] = JAGG_MODES
    joints: tuple[bool, ...] = (True, False)
    fracs: tuple[float, ...] = (0.5, 0.75)
    routing_window: int = 5
    repeats: int = 5
    warmup: int = 1
    memory: bool = True
    #: sections 1, 2 and 4 (the train phase of each variant); False: only the whole iterations (and fidelity)
    train_phase: bool = True
    iterations: int = 20
    seeds: tuple[int, ...] = (0, 1)
    #: rollouts of the fidelity section (:mod:`jagg_core.bench.fidelity`, on the first model); 0 = skip
    fidelity_rollouts: int = 0
    #: config overrides (``key=value``) of every run the bench makes, after the model's own
    overrides: tuple[str, ...] = ()

    @classmethod
    def quick(cls, **changes) -> "BenchOptions":
        """The ``--quick`` set: W in {2, 3, 5} (exactness, the default window, the widest on the default task's
        five trained steps), W = 3 and 5 on the larger models, 2 repeats, 6 iterations."""
        return cls(**{"windows": (2, 3, 5), "other_windows": (3, 5), "repeats": 2, "iterations": 6, **changes})

    def grid(self, index: int) -> list[Variant]:
        if index == 0:
            return variant_grid(self.windows, self.joints, self.modes, self.fracs, self.routing_window)
        return variant_grid(self.other_windows, self.joints, self.modes)


def default_models() -> list[str]:
    """The embedded pretrained model (tiny-sd3 while it is not there) and the larger DiT."""
    return [EMBEDDED_MODEL if EMBEDDED_MODEL in embedded_models() else "tiny-sd3", LARGE_MODEL]


def bench_config(model: str, overrides: list[str] = ()) -> RunConfig:
    """The run config for ``model``: its preset if there is one, else that of :data:`MODEL_PRESETS`
    (tiny-sd3's by default) with the model swapped in."""
    if model in list_presets():
        return load_config(preset=model, overrides=list(overrides))
    return load_config(preset=MODEL_PRESETS.get(model, "tiny-sd3"),
                       overrides=[f"model.name={model}", *MODEL_OVERRIDES.get(model, []), *overrides])
