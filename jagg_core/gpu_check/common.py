"""What every step of the GPU check shares: its options, its description (:class:`Step`) and the device helpers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

GB = 1e9
#: a row's status: ``ok``; ``skipped`` (the device lacks what it needs, e.g. a CPU and NF4); ``failed`` (the step
#: raised, e.g. a CUDA error); ``crashed`` (its process died, e.g. a segfault); ``timed out`` (it ran past its cap)
NOT_OK = ("failed", "crashed", "timed out")


@dataclass(frozen=True)
class CheckOptions:
    #: the real architectures at toy size, on any machine (the tests); real size otherwise
    reduced: bool = False
    threads: int = 2

    @property
    def layers(self) -> int | None:
        """Transformer blocks of the real architectures (None: the real depth)."""
        return REDUCED_LAYERS if self.reduced else None

    @property
    def resolution(self) -> int | None:
        """Image side of the real-size steps (None: the bench's default, 512 px on a GPU)."""
        return REDUCED_RESOLUTION if self.reduced else None

    @property
    def device_type(self) -> str:
        """The device the steps' configs are made for: a real-size check measures a GPU (on any other machine it
        stops after the device step), a reduced one the machine it runs on."""
        return torch_device().type if self.reduced else "cuda"

    @property
    def overrides(self) -> list[str]:
        """Config overrides of the real-size steps."""
        return list(REDUCED_OVERRIDES) if self.reduced else []


REDUCED_LAYERS, REDUCED_RESOLUTION = 1, 64
#: and shorter prompts and trajectories, in float32 (a CPU is slow in bf16), so a CPU runs a step in a minute or so
REDUCED_OVERRIDES = ("model.max_sequence_length=16", "sampling.num_steps=6", "model.dtype=float32",
                     "train.mixed_precision=no")


@dataclass(frozen=True)
class Step:
    """One step of the check: it runs in a process of its own, for at most ``cap_s`` seconds on the GPU machine
    (``reduced_cap_s`` with ``--reduced`` on a CPU), and returns its rows."""

    name: str
    #: the table its rows go to (:data:`TABLES`)
    table: str
    run: Callable[[CheckOptions], list[dict]]
    cap_s: float
    reduced_cap_s: float
    #: environment variables of its process (the triage's ``CUDA_LAUNCH_BLOCKING=1``)
    env: dict[str, str] = field(default_factory=dict)
    #: GPU memory (GB) it may take when it runs beside other steps: a step whose figures are not seconds (a
    #: kernel's errors, a peak memory, a tiny run's loss) shares the GPU, each in its own process and CUDA context;
    #: None: it runs alone (its seconds are the figures, or it may take the whole GPU)
    shares_gb: float | None = None
    #: the run configs it runs, by label (:mod:`.settings`: a measurement under other settings is stale); None: its
    #: figures depend on no config (the device, the triage's fixed kernels)
    configs: Callable[[CheckOptions], dict[str, Any]] | None = None

    def cap(self, options: CheckOptions) -> float:
        return self.reduced_cap_s if options.reduced else self.cap_s


def torch_device():
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]
