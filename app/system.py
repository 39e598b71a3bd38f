"""What this machine offers a run, in words for the page: each GPU's name, free memory and usage (read with
``nvidia-smi``, so the app process never takes a CUDA context), else the CPU's cores, load and free memory."""

from __future__ import annotations

import shutil
import subprocess

import psutil

QUERY = "name,memory.free,memory.total,utilization.gpu"


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


def hardware_words() -> str:
    """One line per GPU (``**GPU 0:** NVIDIA L4 · 21.3 / 22.5 GiB free · 12% busy``), else the CPU's."""
    lines = []
    for index, (name, free, total, usage) in enumerate(gpu_rows()):
        try:
            memory = f"{float(free) / 1024:.1f} / {float(total) / 1024:.1f} GiB free"
        except ValueError:
            memory = "memory unknown"
        lines.append(f"**GPU {index}:** {name} · {memory} · {usage}% busy")
    if lines:
        return "  \n".join(lines)
    memory = psutil.virtual_memory()
    return (f"**No CUDA GPU:** runs train on the CPU ({psutil.cpu_count(logical=False) or 1} cores, "
            f"{psutil.cpu_percent():.0f}% busy, {memory.available / 2**30:.1f} / {memory.total / 2**30:.1f} GiB memory free)")
