"""The host: its CPU's name, and its room for a run: the memory this process may still take, its container's limit
included, and a folder's free disk.

A container (a Hugging Face Space, Docker with ``--memory``) sees the whole machine's memory in ``/proc/meminfo``
but is killed at its control group's limit, so the memory available is the smaller of the two:

    available = min(MemAvailable, limit - usage)

with the limit and usage of cgroup v2 (``memory.max``, ``memory.current``) or v1 (``memory.limit_in_bytes``,
``memory.usage_in_bytes``); no limit (``max``, or v1's huge number) leaves the machine's figure.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import psutil

#: the control group's limit and usage files: cgroup v2, then v1
CGROUP_FILES = ((Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
                (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")))


#: Linux's description of the CPUs
CPUINFO = Path("/proc/cpuinfo")


def cpu_name(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name (``AMD EPYC 7B13 64-Core Processor``) from ``/proc/cpuinfo``; ``CPU`` where it names none
    (another system, many ARM machines). A run records it: a run reproduces to the digit on one kind of CPU, not across
    kinds, whose math libraries round a few operations apart."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return "CPU"
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return " ".join(value.split())
    return "CPU"


def available_memory() -> int:
    """Bytes of memory a new allocation can take without swapping or meeting the container's limit."""
    available = psutil.virtual_memory().available
    container = _container_memory()
    return available if container is None else max(0, min(available, container[0] - container[1]))


def total_memory() -> int:
    """Bytes of memory of the machine, or of the container's limit when lower."""
    container = _container_memory()
    return psutil.virtual_memory().total if container is None else container[0]


def _container_memory() -> tuple[int, int] | None:
    """The control group's memory limit and usage in bytes; None without a limit below the machine's memory."""
    for limit_file, usage_file in CGROUP_FILES:
        try:
            limit, usage = limit_file.read_text().strip(), int(usage_file.read_text())
        except (OSError, ValueError):
            continue
        return (int(limit), usage) if limit.isdigit() and int(limit) < psutil.virtual_memory().total else None
    return None


def free_disk(folder: Path) -> int:
    """Free bytes on the disk that holds ``folder`` (or its nearest existing parent, for a folder not made yet)."""
    folder = Path(folder).expanduser().absolute()
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    return shutil.disk_usage(existing).free
