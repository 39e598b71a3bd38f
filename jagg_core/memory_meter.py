"""Peak memory of a piece of code: the project's one meter (the bench, the memory plan's check, the GPU check).

    with PeakMemory(device) as meter:        # PeakMemory(device, cpu="tensors", resident=[...]) on a CPU
        run()
    meter.base, meter.peak                    # bytes before, and at the high-water mark inside

What is counted, by device and CPU basis (:func:`basis`):

    cuda           base = torch.cuda.memory_allocated, peak = torch.cuda.max_memory_allocated (reset on entry,
                   the device synchronized on entry and exit)
    cpu "rss"      base = VmRSS, peak = VmHWM of this process (the high-water mark reset to the resident set on
                   entry through /proc/self/clear_refs); meaningful in a process started with MALLOC_ENV
    cpu "tensors"  base = bytes of the storages of ``resident`` (weights, optimizer states),
                   peak = base + the high-water mark of every other tensor alive inside (:class:`LiveBytes`)

:class:`LiveBytes` also runs on ``meta`` tensors, so the same instrument measures a run and plans one
(:mod:`jagg_core.memory_plan`).
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

#: glibc settings of a process measured on the "rss" basis: every buffer of 64 KiB or more is its own mapping,
#: returned to the system when freed, so the resident set follows the live tensors and its peak is theirs.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
CPU_BASES = ("rss", "tensors")


def plain_tensors(tensors):
    """The tensors holding the data of ``tensors``: a wrapper subclass (torchao's quantized weights) is replaced by
    its inner tensors, since its own storage is a placeholder of the dequantized size."""
    for tensor in tensors:
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            yield from plain_tensors(getattr(tensor, name) for name in names)
        else:
            yield tensor


class LiveBytes(TorchDispatchMode):
    """The bytes of tensor storage alive, and their high-water mark, of everything run under this mode.

    Each op's outputs are followed by storage (views share one); a storage counts from the op that made it
    until it is freed. Storages that existed before (``ignore``: weights, inputs) never count. Works on real
    and on ``meta`` tensors, so the same instrument measures a run and plans one."""

    def __init__(self, ignore: list[torch.Tensor] = ()):
        super().__init__()
        self.current = self.peak = 0
        self._live: dict[int, weakref.ref] = {}
        self._ignored = {t.untyped_storage()._cdata for t in plain_tensors(ignore)}

    def _follow(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):
            for inner in plain_tensors([tensor]):
                self._follow(inner)
            return
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self._live or key in self._ignored:
            return
        size = storage.nbytes()

        def freed(_ref, key=key, size=size):
            if self._live.pop(key, None) is not None:
                self.current -= size

        self._live[key] = weakref.ref(storage, freed)
        self.current += size
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in tree_flatten(out)[0]:
            if isinstance(item, torch.Tensor):
                self._follow(item)
        return out


def basis(device: torch.device, cpu: str = "rss") -> str:
    """What :class:`PeakMemory` counts on ``device`` with the CPU basis ``cpu``, in words."""
    if device.type == "cuda":
        return "cuda max_memory_allocated"
    return {"rss": "cpu peak RSS", "tensors": "live tensors (LiveBytes)"}[cpu]


def _proc_status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} is not in /proc/self/status")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """``base`` (bytes before) and ``peak`` (bytes at the high-water mark) of what runs inside ``with``, on the
    basis of the module's table; :meth:`start` and :meth:`stop` where a ``with`` does not fit."""

    def __init__(self, device: torch.device, cpu: str = "rss", resident: list[torch.Tensor] = ()):
        if cpu not in CPU_BASES:
            raise ValueError(f"cpu basis {cpu!r}: one of {', '.join(CPU_BASES)}")
        self.device, self.cpu, self.resident = torch.device(device), cpu, list(resident)
        self.base = self.peak = None
        self._live: LiveBytes | None = None

    @property
    def basis(self) -> str:
        return basis(self.device, self.cpu)

    def start(self) -> PeakMemory:
        gc.collect()
        if self.device.type == "cuda":
            _synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        elif self.cpu == "rss":
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            self.base = _proc_status_bytes("VmRSS")
        else:
            storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                        for t in plain_tensors(self.resident)}
            self.base = sum(storages.values())
            self._live = LiveBytes(ignore=self.resident).__enter__()
        return self

    def stop(self) -> PeakMemory:
        if self.device.type == "cuda":
            _synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self.cpu == "rss":
            self.peak = _proc_status_bytes("VmHWM")
        else:
            self._live.__exit__(None, None, None)
            self.peak = self.base + self._live.peak
        return self

    def __enter__(self) -> PeakMemory:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def measured_peak(trainer) -> int:
    """Bytes at the peak of one training iteration with its eval (the trainer's next two iterations: the first makes
    the optimizer states, without its eval, and the second is measured), the weights and optimizer states the device
    holds included.

    On a GPU: ``torch.cuda.max_memory_allocated`` over the second iteration. On a CPU: the storages of the weights
    and optimizer states plus the high-water mark of every other tensor (the "tensors" basis); the prompt cache is
    host memory and not counted.
    """
    start = trainer.start_iteration
    trainer.iteration(start, evaluate=False)  # the optimizer states exist from here on
    modules = [*trainer.model.denoisers, trainer.model.pipe.vae]
    resident = [t for m in modules for t in [*m.parameters(), *m.buffers()]]
    resident += [v for state in trainer.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    with PeakMemory(trainer.accelerator.device, cpu="tensors", resident=resident) as meter:
        trainer.iteration(start + 1)
    return meter.peak
