"""The host's room for a run: the memory this process may still take, its container's limit included, and a
folder's free disk.

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


def available_memory() -> int:
    """Bytes of memory a new allocation can take without swapping or meeting the container's limit."""
    available = psutil.virtual_memory().available
    for limit_file, usage_file in CGROUP_FILES:
        try:
            limit, usage = limit_file.read_text().strip(), int(usage_file.read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < psutil.virtual_memory().total:
            return max(0, min(available, int(limit) - usage))
        return available
    return available


def total_memory() -> int:
    """Bytes of memory of the machine, or of the container's limit when lower."""
    total = psutil.virtual_memory().total
    for limit_file, _usage in CGROUP_FILES:
        try:
            limit = limit_file.read_text().strip()
        except OSError:
            continue
        return min(total, int(limit)) if limit.isdigit() else total
    return total


def free_disk(folder: Path) -> int:
    """Free bytes on the disk that holds ``folder`` (or its nearest existing parent, for a folder not made yet)."""
    folder = Path(folder).expanduser().absolute()
    existing = next(path for path in (folder, *folder.parents) if path.exists())
    return shutil.disk_usage(existing).free
