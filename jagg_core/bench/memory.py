"""Peak memory of a rollout and of each variant's backward (:class:`~jagg_core.memory_meter.PeakMemory`): in this
process on a GPU, in a fresh subprocess on a CPU (the resident set is the process's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from ..memory_meter import MALLOC_ENV, PeakMemory, basis
from .variants import EXACT, Variant
from .workload import Workload


def memory_basis(device: torch.device) -> str:
    """The rows' ``peak_mem_basis``: the meter's basis on ``device``, as the increment over the memory before."""
    return f"{basis(device)} increment"


#: the key of the rollout's figures in :func:`peak_memory`'s result
ROLLOUT = "rollout"


def peak_memory(work: Workload, variants: list[Variant], warm_up: bool = True) -> dict[str, dict[str, float]]:
    """Base and peak memory (MB = 2^20 bytes) of a rollout (key :data:`ROLLOUT`) and of each variant's backward
    (key: its label), after one exact backward as warm-up (``warm_up=False``: the workload has run one)."""
    if warm_up:
        work.backward(EXACT)
    figures = {}
    for key, run in [(ROLLOUT, work.rollout), *((v.label, lambda v=v: work.backward(v)) for v in variants)]:
        with PeakMemory(work.device) as meter:
            run()
        figures[key] = {"base_mb": meter.base / 2 ** 20, "peak_mb": meter.peak / 2 ** 20}
    return figures


def measure_memory(work: Workload, variants: list[Variant], threads: int) -> dict[str, dict[str, float]]:
    """:func:`peak_memory` of ``work``, which has run every variant (:func:`~.workload.time_variants`): in this
    process on a GPU, warm already; on a CPU in a fresh subprocess with :data:`MALLOC_ENV` that rebuilds the same
    workload (same model, seeds and rollout)."""
    if work.device.type == "cuda":
        return peak_memory(work, variants, warm_up=False)
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"model": work.model_name, "overrides": work.overrides,
                                    "variants": [asdict(v) for v in variants],
                                    "threads": threads, "out": str(Path(tmp) / "memory.json")}))
        subprocess.run([sys.executable, "-m", "jagg_core.bench", "--memory-worker", str(spec)],
                       env={**os.environ, **MALLOC_ENV}, check=True, stdout=subprocess.DEVNULL)
        return json.loads((Path(tmp) / "memory.json").read_text())


def memory_worker(spec_file: str) -> None:
    """Entry of the memory subprocess: build the workload, measure, write the figures as JSON."""
    spec = json.loads(Path(spec_file).read_text())
    torch.set_num_threads(spec["threads"])
    with tempfile.TemporaryDirectory() as run_dir:
        work = Workload(spec["model"], run_dir, spec["overrides"])
        figures = peak_memory(work, [Variant(**v) for v in spec["variants"]])
    Path(spec["out"]).write_text(json.dumps(figures))
