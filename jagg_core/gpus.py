"""This machine's NVIDIA GPUs as ``nvidia-smi`` reports them: each one's name, free and total memory and usage.

Read without torch, so that asking takes no CUDA context: torch's ``mem_get_info`` would keep ~0.5 GB of GPU 0 in
the asking process (the page's, for as long as it runs) and load torch into it.
"""

from __future__ import annotations

import shutil
import subprocess

QUERY = "name,memory.free,memory.total,utilization.gpu"
#: bytes in a MiB, nvidia-smi's unit, and in a GB, the unit of the memory plan and of the page's GB figures
MIB, GB = 2 ** 20, 1e9


def gpu_rows() -> list[list[str]]:
    """``[name, free MiB, total MiB, usage %]`` of each NVIDIA GPU; empty without one (or without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [[part.strip() for part in line.split(",")] for line in out.splitlines() if line.count(",") == 3]


def gpu_free_gb(gpus: int = 1) -> float | None:
    """The least free memory of the first ``gpus`` GPUs, in GB (10^9 bytes); None without a GPU (or when
    nvidia-smi cannot say)."""
    try:
        free = [float(available) for _name, available, _total, _usage in gpu_rows()[:gpus]]
    except ValueError:
        return None
    return min(free) * MIB / GB if free else None
