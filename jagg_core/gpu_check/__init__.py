"""One-command GPU check that resumes: it runs first what no earlier check has measured, each step in a process of
its own under its own time cap, and keeps every outcome in the repo until the table is full.

    bash scripts/gpu_check.sh [--budget S] [--out DIR]   # = python -m jagg_core.gpu_check, ledger docs/gpu/
    python -m jagg_core.gpu_check --table                # the tables of what is measured, without running
    python -m jagg_core.gpu_check --reduced              # the same at toy size on any machine, with a simulated
                                                         # crash and hang (ledger and outputs in gpu_check/)

The ledger (:mod:`.ledger`) is ``docs/gpu/*.json``; the order puts the device first, then the triage's cases not yet
answered (a failure is an answer), the other steps last failed, then those never measured, then those measured ok under
other settings than the product's today (:mod:`.settings`); a step starts only while its cap fits in what is left of
``--budget``. Each step (:mod:`.steps`, :mod:`.triage`) is a process of its own (:class:`.driver.StepProcess`): a CUDA
error is its ``failed`` row, a dead process a ``crashed`` row, one past its cap is killed (with its children) and
``timed out``; the next step starts in a fresh process with a fresh CUDA context. The steps whose figures are not
seconds (the isolated triage cases, the memory peaks of unquantized presets, the tiny runs) run side by side, up to
``--parallel`` (4 on a GPU, 1 on a CPU) at once within 85% of the GPU's memory, each in its own process and CUDA
context; the timed ones run alone. The steps:

1. ``device``: the GPU, its memory, CUDA, cuDNN and library versions.
2. ``triage-*``: the FLUX.1-dev crash taken apart (:mod:`.triage`): attention alone under each SDPA backend,
   a LoRA's matmuls alone, the project's FLUX path with and without each suspect.
3. ``memory-PRESET`` for each 16/24 GB preset: planned against measured peak memory of its recipe at real size
   with random weights, set-up and training apart (:func:`.steps.memory_recipe`); ``memory-PRESET-VARIANT`` the
   same with a setting no such preset turns on (:data:`.steps.MEMORY_VARIANTS`: offloaded text encoders, the
   allocator's expandable segments).
4. ``bench-ARCH``: a whole iteration (rollout + train) per family at the real depth with random weights, 512 px,
   bf16, gradient checkpointing: exact against JAGG W = 5 (cached, joint): speed-ups, gradient cosine, peak.
5. ``quantize-sd35-medium-BASE``: JAGG's same iteration on a bf16, an int8 and an NF4 base: seconds and peak.
6. ``tiny-sd3``, ``tiny-flux``, ``tiny-qwen``: each tiny model trains 2 iterations on each base with 8-bit AdamW.

Each run writes ``OUT/STEP.json`` (date, cap, seconds, settings, rows with ``status`` and ``reason``), ``OUT/STEP.log``
(the step's whole output) and ``OUT/gpu_check.md`` (every step's last outcome and date, and the figures).
"""

from .common import CheckOptions
from .driver import format_tables, main, next_batch, run_check
from .ledger import plan_order, read_ledger
from .steps import all_steps, memory_presets, memory_recipe, step_names
from .triage import triage_verdict

__all__ = ["CheckOptions", "all_steps", "format_tables", "main", "memory_presets", "memory_recipe", "next_batch",
           "plan_order", "read_ledger", "run_check", "step_names", "triage_verdict"]
