"""What this machine offers a run, in words for the page: each GPU's name, free memory and usage (read with
``nvidia-smi``, :mod:`jagg_core.gpus`, so the app process never takes a CUDA context), else the CPU's cores, load
and free memory (its container's, :mod:`jagg_core.host`)."""

from __future__ import annotations

import os

import psutil

from jagg_core.gpus import gpu_free_gb, gpu_rows
from jagg_core.host import available_memory, cpu_name, total_memory

#: a GPU is free for a new run when at least this share of its memory is free and it is this idle (percent busy)
FREE_MEMORY_SHARE = 0.9
IDLE_PERCENT = 10


def hardware_words() -> str:
    """One line per GPU (``**GPU 0:** NVIDIA L4 · 21.3 / 22.5 GiB free · 12% busy``), else the CPU's, with its name
    where Linux gives one (a run reproduces to the digit on one kind of CPU)."""
    lines = []
    for index, (name, free, total, usage) in enumerate(gpu_rows()):
        try:
            memory = f"{float(free) / 1024:.1f} / {float(total) / 1024:.1f} GiB free"
        except ValueError:
            memory = "memory unknown"
        lines.append(f"**GPU {index}:** {name} · {memory} · {usage}% busy")
    if lines:
        return "  \n".join(lines)
    name = cpu_name()
    named = "" if name == "CPU" else f"{name}, "
    return (f"**No CUDA GPU:** runs train on the CPU ({named}{psutil.cpu_count(logical=False) or 1} cores, "
            f"{psutil.cpu_percent():.0f}% busy, {available_memory() / 2**30:.1f} / {total_memory() / 2**30:.1f} GiB "
            "memory free)")


def sampling_environment() -> dict[str, str]:
    """The environment of Try it's and Evaluate's processes, which load the run's model on one GPU: on a machine of
    several, the one with the most free memory (``CUDA_VISIBLE_DEVICES``, numbered in PCI bus order as nvidia-smi
    lists them: ``CUDA_DEVICE_ORDER=PCI_BUS_ID``), not GPU 0, where a run trains first; a ``CUDA_VISIBLE_DEVICES``
    the page was started with is kept."""
    environment = dict(os.environ)
    rows = gpu_rows()
    if len(rows) < 2 or "CUDA_VISIBLE_DEVICES" in environment:
        return environment

    def free(index: int) -> float:
        try:
            return float(rows[index][1])
        except ValueError:
            return -1.0
    environment.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=str(max(range(len(rows)), key=free)))
    return environment


def free_gpus() -> int:
    """How many GPUs no other work holds (:data:`FREE_MEMORY_SHARE` of their memory free, at most
    :data:`IDLE_PERCENT` busy)."""
    free = 0
    for _name, available, total, usage in gpu_rows():
        try:
            free += float(available) >= FREE_MEMORY_SHARE * float(total) and float(usage) <= IDLE_PERCENT
        except ValueError:
            continue
    return free


def process_choices() -> tuple[int, int]:
    """``(default, most)`` processes for a run: all free GPUs (at least 1) of all GPUs; on a CPU 1 of its cores."""
    gpus = len(gpu_rows())
    if gpus:
        return max(1, free_gpus()), gpus
    return 1, psutil.cpu_count(logical=False) or 1


def placement_for(config, processes: int, plan=None):
    """How a run of ``config`` uses ``processes`` processes, and why, in words: data parallel when the memory plan
    (``plan``, made here when not given) fits the smallest free memory of the GPUs, the transformer sharded (FSDP)
    when it does not; on a CPU always data parallel."""
    from jagg_core.memory_plan import GB, fits, plan_memory  # torch: loaded on first use

    from .jobs import Placement

    free_gb = gpu_free_gb(processes) if processes > 1 else None
    if free_gb is None:
        return Placement(processes), ""
    plan = plan or plan_memory(config)
    planned = plan.total / GB
    if fits(plan, free_gb):
        return Placement(processes), (f"data parallel: the plan ({planned:.1f} GB and a CUDA context) fits each GPU "
                                      f"({free_gb:.1f} GB free)")
    return Placement(processes, sharded=True), (f"the transformer sharded over {processes} GPUs (FSDP): the plan "
                                                f"({planned:.1f} GB and a CUDA context) does not fit one GPU "
                                                f"({free_gb:.1f} GB free)")
