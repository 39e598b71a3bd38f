"""One-command GPU check: the project's GPU paths, at real size, in a few minutes, with one JSON and one table.

    bash scripts/gpu_check.sh [OUT_DIR]                 # = python -m jagg_core.gpu_check --out OUT_DIR
    python -m jagg_core.gpu_check --reduced [--only S]  # the same code at toy size, on any machine (the tests)

The steps, in this order, each in a subprocess of its own (so every memory figure starts from a fresh CUDA
allocator, and each has its own accelerate state), each bounded by what is left of ``--budget-s``:

1. ``device``: CUDA visible, the GPU, its memory, the versions of the libraries on the GPU paths.
2. ``tiny-sd3``, ``tiny-flux``, ``tiny-qwen``: each family's tiny model trains 2 iterations through the run
   CLI's :func:`~jagg_core.run.train`, in bf16 with bitsandbytes 8-bit AdamW, for each of :data:`RECIPES`
   (a bf16 base, an NF4 base where bitsandbytes runs (CUDA), an int8 base); a row per recipe with the
   loss, reward and eval reward, seconds, and peak GPU memory.
3. ``bench-sd35-medium``, ``bench-flux-dev``: the real-size bench (:mod:`jagg_core.bench`) of the real
   architecture with random weights at its real depth, 512 px, bf16, gradient checkpointing: the exact
   backward against JAGG W = 5 (cached velocities, joint endpoints) on one rollout batch: rollout and train
   seconds, the whole-iteration speed-up, the gradient cosine, peak memory.
4. ``memory-PRESET`` for each 16/24 GB preset (:func:`memory_presets`): the preset's recipe at real size with
   random weights, planned (:func:`~jagg_core.memory_plan.plan_memory`) against measured peak memory
   (``torch.cuda.max_memory_allocated``), set-up and training apart. The measured run keeps every setting the
   memory depends on (dtype, quantization, resolution, LoRA, rollout chunk, micro-batch, checkpointing,
   endpoints, optimizer) and shrinks only what adds time (:func:`memory_recipe`): one prompt of one rollout
   chunk, an eval of one chunk, and a reward without weights; the plan is of that same config, and the
   preset's own plan (its reward model included) is listed beside.

``--reduced`` runs the real architectures at one transformer block, 64 px, 16 prompt tokens, 6 steps and float32
(the bench on one prompt of two samples), for machines without a GPU.
``OUT_DIR`` gets ``gpu_check.json`` (every row, with ``status`` ok | failed | skipped and the reason),
``gpu_check.md`` (the tables) and ``gpu_check.log`` (the steps' output), rewritten after every step, so a
check cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

from .report import cell, markdown_table

#: one check on one 80-140 GB GPU fits in 8 minutes
DEFAULT_BUDGET_S = 480
#: a step is not started with less time left than this
MIN_STEP_S = 20
TINY_MODELS = ("tiny-sd3", "tiny-flux", "tiny-qwen")
#: the tiny runs: every one in bf16 with 8-bit AdamW, then the base as named
TINY_BASE = ("train.iterations=2", "train.sample_every=2", "train.checkpoint_every=2", "model.dtype=bfloat16",
             "train.mixed_precision=bf16", "train.optimizer=adamw8bit")
RECIPES = {"bf16": (), "nf4": ("model.quantize=nf4",), "int8": ("model.quantize=int8",)}
BENCH_ARCHS = ("sd35-medium", "flux-dev")
#: the real-size bench's window: W = 5, cached velocities, joint endpoints (the project's default backward)
BENCH_WINDOW = 5
REDUCED_LAYERS, REDUCED_RESOLUTION = 1, 64
#: and shorter prompts and trajectories, in float32 (a CPU is slow in bf16), so a CPU runs a step in a minute or so
REDUCED_OVERRIDES = ("model.max_sequence_length=16", "sampling.num_steps=6", "model.dtype=float32",
                     "train.mixed_precision=no")
#: the reduced bench's rollout batch: one prompt, two samples
REDUCED_BENCH_BATCH = ("grpo.prompts_per_iteration=1", "grpo.num_generations=2")
#: the weightless reward of the measured memory runs
MEASURE_REWARD = "jpeg_compressibility"
GB = 1e9
LIBRARIES = ("torch", "diffusers", "transformers", "peft", "accelerate", "bitsandbytes", "torchao")


@dataclass(frozen=True)
class CheckOptions:
    reduced: bool = False
    threads: int = 2

    @property
    def layers(self) -> int | None:
        """Transformer blocks of the real architectures (None: the real depth)."""
        return REDUCED_LAYERS if self.reduced else None

    @property
    def resolution(self) -> int | None:
        """Image side of the real-size steps (None: the bench's default, 512 px on a GPU)."""
        return REDUCED_RESOLUTION if self.reduced else None

    @property
    def overrides(self) -> list[str]:
        """Config overrides of the real-size steps."""
        return list(REDUCED_OVERRIDES) if self.reduced else []


def memory_presets() -> list[str]:
    """The presets made for 16 and 24 GB cards (named ``...-16gb``, ``...-24gb``)."""
    from .config import list_presets
    return [name for name in list_presets() if re.search(r"-(16|24)gb$", name)]


def step_names() -> list[str]:
    return ["device", *TINY_MODELS, *(f"bench-{arch}" for arch in BENCH_ARCHS),
            *(f"memory-{preset}" for preset in memory_presets())]


# ----- the steps (each runs in its own process) -------------------------------------------------
def _device():
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _reset_peak(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gb(device) -> float | None:
    import torch
    return torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None


def step_device(options: CheckOptions) -> list[dict]:
    """Whether CUDA is visible, the GPU and its memory, and the library versions."""
    import torch
    row = {"step": "device", "status": "ok", "cuda": torch.cuda.is_available(),
           "versions": {name: _version(name) for name in LIBRARIES}}
    if row["cuda"]:
        free, total = torch.cuda.mem_get_info()
        row.update(gpu=torch.cuda.get_device_name(), gpu_total_gb=total / GB, gpu_free_gb=free / GB,
                   cuda_version=torch.version.cuda, bf16=torch.cuda.is_bf16_supported())
    else:
        row.update(status="failed", reason="CUDA is not visible: torch.cuda.is_available() is False")
        if options.reduced:
            row.update(status="ok", reason="no GPU (--reduced runs on the CPU)")
    return [row]


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def step_tiny(model: str, options: CheckOptions) -> list[dict]:
    """2-iteration runs of the tiny ``model`` for each of :data:`RECIPES`."""
    from .config import load_config
    from .errors import UserError
    from .rundir import RunDirectory
    from .run import train
    from . import metrics
    device = _device()
    rows = []
    for recipe, overrides in RECIPES.items():
        row = {"step": model, "recipe": recipe, "status": "ok"}
        rows.append(row)
        if recipe == "nf4" and device.type != "cuda":
            row.update(status="skipped", reason="NF4 (bitsandbytes) needs a CUDA GPU")
            continue
        config = load_config(preset="tiny-sd3", overrides=[f"model.name={model}", *TINY_BASE, *overrides])
        with tempfile.TemporaryDirectory() as run_dir:
            _reset_peak(device)
            start = time.perf_counter()
            try:
                train(config, Path(run_dir), resume=False)
            except Exception as err:  # one recipe's failure is its row; the next recipe still runs
                traceback.print_exc()
                row.update(status="failed", reason=str(err) if isinstance(err, UserError) else _one_line(err))
                continue
            last = RunDirectory(run_dir).read_metrics()[-1]
            row.update(seconds=time.perf_counter() - start, peak_gb=_peak_gb(device),
                       loss=last.get(metrics.LOSS), reward=last.get(metrics.REWARD_MEAN),
                       eval_reward=last.get(metrics.EVAL_REWARD_MEAN))
            if not all(math.isfinite(row[key]) for key in ("loss", "reward", "eval_reward")):
                row.update(status="failed", reason="a non-finite loss or reward")
    return rows


def step_bench(arch: str, options: CheckOptions) -> list[dict]:
    """The real-size bench of ``arch`` (random weights): exact against JAGG W = :data:`BENCH_WINDOW`."""
    from .bench import EXACT, BenchOptions, Variant, arch_model, arch_overrides, bench_train_phase
    device = _device()
    model = arch_model(arch, random_weights=True, layers=options.layers)
    overrides = [*arch_overrides(device.type, options.resolution), "train.gradient_checkpointing=true",
                 *options.overrides, *(REDUCED_BENCH_BATCH if options.reduced else ())]
    bench = BenchOptions(models=[model], overrides=tuple(overrides), repeats=2, warmup=1,
                         memory=device.type == "cuda", iterations=0)
    jagg = Variant("cached", window=BENCH_WINDOW, joint=True)
    rows = bench_train_phase(model, [EXACT, jagg], bench, options.threads)
    resolution = next(int(o.split("=")[1]) for o in overrides if o.startswith("sampling.resolution="))
    return [{"step": f"bench-{arch}", "status": "ok", "arch": arch, "resolution": resolution, **row}
            for row in rows]


def memory_recipe(preset: str, options: CheckOptions):
    """The preset's config at real size with random weights, shrunk where the memory does not depend on it:
    one prompt with one rollout chunk of samples (at least 2), the same micro-batch, an eval of one chunk
    of 4 steps, the weightless reward :data:`MEASURE_REWARD`, 2 iterations (the second is measured)."""
    from .archs import arch_for_model
    from .config import load_config
    config = load_config(preset=preset)
    arch = arch_for_model(config.model.name)
    samples = config.grpo.num_generations * config.grpo.prompts_per_iteration
    micro = math.ceil(samples / config.train.gradient_accumulation_steps)
    chunk = config.sampling.rollout_batch_size or samples
    generations = max(2, chunk)
    layers = f"@{options.layers}" if options.layers else ""
    overrides = [f"model.name=random:{arch}{layers}", f"rewards=[{{name: {MEASURE_REWARD}}}]",
                 "grpo.prompts_per_iteration=1", f"grpo.num_generations={generations}",
                 f"train.gradient_accumulation_steps={math.ceil(generations / micro)}",
                 f"prompts.eval_count={min(chunk, generations)}", "sampling.eval_num_steps=4",
                 "train.iterations=2", "train.sample_every=2", "train.checkpoint_every=2", *options.overrides]
    if options.resolution:
        overrides.append(f"sampling.resolution={options.resolution}")
    return load_config(preset=preset, overrides=overrides)


def step_memory(preset: str, options: CheckOptions) -> list[dict]:
    """Planned against measured peak memory of ``preset``'s recipe (:func:`memory_recipe`)."""
    from .config import load_config
    from .memory_plan import SETUP_PHASE, measured_peak, plan_memory
    from .quiet import quiet_libraries
    from .trainer import Trainer
    device = _device()
    config = memory_recipe(preset, options)
    row = {"step": f"memory-{preset}", "status": "ok", "preset": preset, "model": config.model.name,
           "quantize": config.model.quantize, "resolution": config.sampling.resolution}
    if config.model.quantize == "nf4" and device.type != "cuda":
        return [{**row, "status": "skipped", "reason": "NF4 (bitsandbytes) needs a CUDA GPU"}]
    plan = plan_memory(config)
    training_phases = {p: t for p, t in plan.totals.items() if p != SETUP_PHASE}
    row.update(planned_setup_gb=plan.totals[SETUP_PHASE] / GB, planned_gb=max(training_phases.values()) / GB,
               planned_phase=max(training_phases, key=training_phases.get),
               preset_planned_gb=plan_memory(load_config(preset=preset)).total / GB)
    quiet_libraries()
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(config, run_dir)
        _reset_peak(device)
        trainer.setup()
        row["measured_setup_gb"] = _peak_gb(device)
        row["measured_gb"] = measured_peak(trainer) / GB
        trainer.close()
    row["planned_over_measured"] = row["planned_gb"] / row["measured_gb"]
    row["basis"] = "cuda max_memory_allocated" if device.type == "cuda" else "live tensors (LiveBytes)"
    return [row]


def run_step(name: str, options: CheckOptions) -> list[dict]:
    if name == "device":
        return step_device(options)
    if name in TINY_MODELS:
        return step_tiny(name, options)
    if name.startswith("bench-"):
        return step_bench(name.removeprefix("bench-"), options)
    if name.startswith("memory-"):
        return step_memory(name.removeprefix("memory-"), options)
    raise ValueError(f"unknown step {name}")


# ----- the driver ---------------------------------------------------------------------------------
def _step_process(name: str, options: CheckOptions, timeout: float, log: Path) -> list[dict]:
    """``name`` in a subprocess (its output appended to ``log``); a crash or a time-out is a failed row."""
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "rows.json"
        command = [sys.executable, "-m", "jagg_core.gpu_check", "--step", name, "--result", str(result_file),
                   "--threads", str(options.threads), *(["--reduced"] if options.reduced else [])]
        with log.open("a") as handle:
            handle.write(f"\n===== {name} =====\n")
            handle.flush()
            try:
                done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
            except subprocess.TimeoutExpired:
                return [{"step": name, "status": "failed", "reason": f"timed out after {timeout:.0f} s"}]
        if done.returncode != 0 or not result_file.is_file():
            return [{"step": name, "status": "failed", "reason": _last_error(log) or f"exit {done.returncode}"}]
        return json.loads(result_file.read_text())


def _one_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]


def _last_error(log: Path) -> str:
    """The last line of the log that names an error (the step's traceback ends with it)."""
    lines = [line.strip() for line in log.read_text().splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    return (errors or lines or [""])[-1][:300]


def run_check(out: Path, options: CheckOptions, budget_s: float = DEFAULT_BUDGET_S,
              only: list[str] | None = None, log=print) -> list[dict]:
    """Every step (or those of ``only``) within ``budget_s``; writes the outputs after each step."""
    out.mkdir(parents=True, exist_ok=True)
    log_file = out / "gpu_check.log"
    log_file.write_text("")
    names = step_names()
    unknown = sorted(set(only or ()) - set(names))
    if unknown:
        from .errors import UserError
        raise UserError(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(names)}")
    start = time.perf_counter()
    rows = []
    for name in (n for n in names if not only or n in only):
        left = budget_s - (time.perf_counter() - start)
        if left < MIN_STEP_S:
            rows.append({"step": name, "status": "skipped", "reason": f"the {budget_s:.0f} s budget is spent"})
        else:
            log(f"[gpu-check] {name} ({left:.0f} s left)")
            step_start = time.perf_counter()
            step_rows = _step_process(name, options, left, log_file)
            for row in step_rows:
                row.setdefault("step_s", time.perf_counter() - step_start)
            rows += step_rows
        write_outputs(rows, out, options, time.perf_counter() - start)
    return rows


# ----- output ---------------------------------------------------------------------------------------
def _f(value, spec: str = ".2f") -> str:
    return cell(value, spec)


def _status(row: dict) -> str:
    return row["status"] + (f": {row['reason']}" if row.get("reason") and row["status"] != "ok" else "")


def format_tables(rows: list[dict], options: CheckOptions, seconds: float) -> str:
    """The markdown report: the device, the tiny runs, the real-size bench, planned against measured memory."""
    device = next((r for r in rows if r["step"] == "device"), {})
    parts = [f"GPU check ({'reduced: 1 block, 64 px' if options.reduced else 'real size'}), {seconds:.0f} s: "
             f"{device.get('gpu', 'no GPU') if device else 'device not checked'}"
             + (f", {device['gpu_total_gb']:.0f} GB" if device.get("gpu_total_gb") else "")
             + (f"; torch {device['versions']['torch']}" if device.get("versions") else "")]
    tiny = [r for r in rows if r["step"] in TINY_MODELS]
    if tiny:
        parts.append(markdown_table(["model", "base (bf16, 8-bit AdamW)", "status", "loss", "reward", "eval reward",
                                     "s", "peak GB"],
                            [[r["step"], r.get("recipe", "-"), _status(r), _f(r.get("loss"), "+.5f"),
                              _f(r.get("reward"), ".3f"), _f(r.get("eval_reward"), ".3f"), _f(r.get("seconds"), ".1f"),
                              _f(r.get("peak_gb"))] for r in tiny]))
    bench = [r for r in rows if r["step"].startswith("bench-")]
    if bench:
        parts.append(markdown_table(["arch (random weights)", "px", "backward", "status", "rollout s", "train s",
                             "train speed-up", "iteration speed-up", "grad cosine", "peak GB"],
                            [[r.get("model", r["step"]), _f(r.get("resolution"), "d"), _backward(r), _status(r),
                              _f(r.get("rollout_s")), _f(r.get("train_s")), _f(r.get("speedup")),
                              _f(r.get("iteration_speedup")), _f(r.get("grad_cosine"), ".4f"),
                              _f(r["peak_mem_mb"] * 2 ** 20 / GB if r.get("peak_mem_mb") else None)]
                             for r in bench]))
    memory = [r for r in rows if r["step"].startswith("memory-")]
    if memory:
        parts.append(markdown_table(["preset recipe (random weights)", "status", "set-up planned / measured GB",
                             "training planned / measured GB", "planned / measured", "preset's plan GB"],
                            [[r.get("preset", r["step"]), _status(r),
                              f"{_f(r.get('planned_setup_gb'))} / {_f(r.get('measured_setup_gb'))}",
                              f"{_f(r.get('planned_gb'))} / {_f(r.get('measured_gb'))}",
                              _f(r.get("planned_over_measured")), _f(r.get("preset_planned_gb"))] for r in memory]))
    return "\n\n".join(parts) + "\n"


def _backward(row: dict) -> str:
    if row.get("mode") in (None, "exact"):
        return row.get("mode") or "-"
    return f"JAGG W={row['window']} {row['mode']} {'joint' if row.get('joint') else 'sequential'}"


def write_outputs(rows: list[dict], out: Path, options: CheckOptions, seconds: float) -> None:
    from .rundir import atomic_write_text
    atomic_write_text(out / "gpu_check.json", json.dumps({"options": asdict(options), "seconds": seconds,
                                                         "rows": rows}, indent=1, default=str))
    atomic_write_text(out / "gpu_check.md", format_tables(rows, options, seconds))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jagg_core.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check", help="folder of gpu_check.json/.md/.log (default gpu_check)")
    parser.add_argument("--reduced", action="store_true",
                        help=f"real architectures at {REDUCED_LAYERS} block and {REDUCED_RESOLUTION} px (no GPU needed)")
    parser.add_argument("--only", help="comma-separated steps (default: all): " + ", ".join(step_names()))
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for the whole check; steps not started in time are skipped "
                        f"(default {DEFAULT_BUDGET_S})")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads of the steps (default 2)")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    options = CheckOptions(reduced=args.reduced, threads=args.threads)
    from .errors import exit_on_user_error
    from .quiet import quiet_libraries
    quiet_libraries()
    if args.step:
        import torch
        torch.set_num_threads(args.threads)
        try:
            rows = run_step(args.step, options)
        except Exception as err:  # a step's failure is a row; the check goes on with the next step
            traceback.print_exc()
            rows = [{"step": args.step, "status": "failed", "reason": _one_line(err)}]
        Path(args.result).write_text(json.dumps(rows, default=str))
        return 0
    with exit_on_user_error(parser.prog):
        out = Path(args.out)
        rows = run_check(out, options, args.budget_s, args.only.split(",") if args.only else None,
                         log=lambda line: print(line, file=sys.stderr, flush=True))
        print((out / "gpu_check.md").read_text(), end="")
        failed = [r["step"] for r in rows if r["status"] == "failed"]
        print(f"{len(rows)} rows, {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}; "
              f"{out / 'gpu_check.json'}")
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
