"""Rewrite a bitsandbytes wheel without the GPU libraries of other CUDA majors and of ROCm (scripts/gpu_wheels.sh).

    python3 scripts/trim_wheel.py CUDA_MAJOR WHEEL

bitsandbytes ships ``bitsandbytes/libbitsandbytes_{cudaNNN,rocmNN,cpu,xpuNNNN}.so``, one per release (43 MB in all),
and loads the one of torch's CUDA version. The wheel keeps every other file, and of those libraries the ones of
CUDA ``CUDA_MAJOR`` (``cuda13*`` for 13), the CPU's and the XPU's; RECORD loses the lines of the dropped files (the
others keep their hashes), so pip installs it as any wheel.
"""

from __future__ import annotations

import os
import re
import sys
import zipfile

GPU_LIBRARY = re.compile(r"bitsandbytes/libbitsandbytes_(cuda|rocm)(\d+)\.so$")


def kept(name: str, cuda_major: str) -> bool:
    """Whether the wheel keeps the file ``name``: anything but another CUDA major's or a ROCm library."""
    match = GPU_LIBRARY.search(name)
    return match is None or (match[1] == "cuda" and match[2].startswith(cuda_major))


def trim_wheel(wheel: str, cuda_major: str) -> None:
    """Rewrite ``wheel`` in place (through a ``.part`` file) with the files :func:`kept` keeps."""
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(wheel + ".part", "w", zipfile.ZIP_DEFLATED) as target:
        for entry in source.infolist():
            if not kept(entry.filename, cuda_major):
                continue
            data = source.read(entry)
            if entry.filename.endswith(".dist-info/RECORD"):
                data = "".join(line for line in data.decode().splitlines(keepends=True)
                               if kept(line.split(",")[0], cuda_major)).encode()
            target.writestr(entry, data)
    os.replace(wheel + ".part", wheel)


if __name__ == "__main__":
    trim_wheel(sys.argv[2], sys.argv[1])
