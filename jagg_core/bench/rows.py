"""The train phase's rows (sections 1, 2 and 4): each variant's seconds, gradient and memory against exact."""

from __future__ import annotations

import statistics
import tempfile
import time

from ..audit import gradient_agreement
from .memory import ROLLOUT, measure_memory, memory_basis
from .variants import EXACT, BenchOptions, Variant
from .workload import Workload, time_variants

ROW_KEYS = ("section", "model", "params_m", "mode", "window", "joint", "frac", "seconds", "speedup",
            "peak_mem_ratio", "peak_mem_basis", "grad_cosine", "grad_rel_err")


def train_phase_rows(work: Workload, variants: list[Variant], seconds, gradients, plans, rollouts,
                     memory) -> list[dict]:
    """One row per variant, compared with ``exact`` (which must be among them); ``rollouts`` are the rollout's
    seconds (the same batch for every variant), so ``iteration_s`` is the rollout's plus the train phase's."""
    exact_seconds, exact_grad = min(seconds[EXACT]), gradients[EXACT]
    exact_mem, rollout_mem = memory.get(EXACT.label), memory.get(ROLLOUT)
    rollout_s = min(rollouts)
    rows = []
    for variant in variants:
        grad, plan, mem = gradients[variant], plans[variant], memory.get(variant.label)
        cosine, rel_err = gradient_agreement(grad, exact_grad)
        row = {"section": "routing" if variant.frac < 1 else "train_phase", "model": work.model_name,
               "params_m": work.params_m, "mode": variant.mode, "window": variant.window, "joint": variant.joint,
               "frac": variant.frac, "routed_frac": plan.routed_frac, "passes": len(plan.pass_steps),
               "linearity": [round(s, 5) for s in plan.linearity] if variant.mode != "exact" else None,
               "seconds": min(seconds[variant]), "seconds_median": statistics.median(seconds[variant]),
               "repeats": len(seconds[variant]), "speedup": exact_seconds / min(seconds[variant]),
               "train_s": min(seconds[variant]), "rollout_s": rollout_s,
               "iteration_s": rollout_s + min(seconds[variant]),
               "iteration_speedup": (rollout_s + exact_seconds) / (rollout_s + min(seconds[variant])),
               "grad_cosine": cosine, "grad_rel_err": rel_err,
               "peak_mem_basis": memory_basis(work.device) if mem else None,
               "base_mem_mb": mem["base_mb"] if mem else None, "peak_mem_mb": mem["peak_mb"] if mem else None,
               "peak_mem_ratio": ((mem["peak_mb"] - mem["base_mb"]) / (exact_mem["peak_mb"] - exact_mem["base_mb"])
                                  if mem else None),
               "rollout_peak_mem_mb": rollout_mem["peak_mb"] if rollout_mem else None,
               "device": str(work.device)}
        rows.append(row)
    return rows


def bench_train_phase(model: str, variants: list[Variant], options: BenchOptions, threads: int,
                      log=lambda line: None) -> list[dict]:
    """Train-phase rows of ``model``: timings and gradients here, peak memory per :func:`measure_memory`; ``log``
    gets the seconds of each phase (set-up, timing, memory: where a GPU check step's time went)."""
    with tempfile.TemporaryDirectory() as run_dir:
        start = time.perf_counter()
        work = Workload(model, run_dir, options.overrides)
        log(f"[bench] {model}: set up and first rollout in {time.perf_counter() - start:.1f} s")
        start = time.perf_counter()
        seconds, gradients, plans, rollouts = time_variants(work, variants, options.repeats, options.warmup)
        log(f"[bench] {model}: {options.warmup} warm-up and {options.repeats} timed repeat(s) of "
            f"{len(variants)} variants in {time.perf_counter() - start:.1f} s")
        start = time.perf_counter()
        memory = measure_memory(work, variants, threads) if options.memory else {}
        if options.memory:
            log(f"[bench] {model}: peak memory in {time.perf_counter() - start:.1f} s")
        return train_phase_rows(work, variants, seconds, gradients, plans, rollouts, memory)
