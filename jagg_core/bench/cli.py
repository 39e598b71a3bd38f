"""``python -m jagg_core.bench``: the command line, and every section run in order (:func:`run_bench`)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from ..archs import arch_names
from ..errors import UserError, exit_on_user_error
from ..quiet import log_to_stderr, quiet_libraries
from .archs import ARCH_RESOLUTION, arch_model, arch_options, arch_overrides
from .fidelity import fidelity_rows
from .iterations import bench_iterations, iteration_setups
from .memory import memory_worker
from .rows import ROW_KEYS, bench_train_phase
from .tables import write_outputs
from .training import SETUP_LABELS, format_training, is_setup, plot_training, training_rows, with_earlier
from .variants import EMBEDDED_MODEL, BenchOptions, bench_config, default_models

DESCRIPTION = "Benchmark: the exact backward against JAGG, side by side, in one run."


def run_bench(options: BenchOptions, threads: int = 2, log=print) -> list[dict]:
    """All sections for ``options``; returns the rows."""
    rows = []
    for index, model in enumerate(options.models if options.train_phase else []):
        variants = options.grid(index)
        log(f"[bench] {model}: train phase, {len(variants)} variants x {options.repeats} repeats")
        rows += bench_train_phase(model, variants, options, threads, log)
    if options.iterations and options.seeds:
        for model in options.models:
            setups = iteration_setups(bench_config(model, options.overrides))
            log(f"[bench] {model}: {options.iterations} iterations x {len(options.seeds)} seeds, whole iterations: "
                + ", ".join(SETUP_LABELS[name] for name in setups))
            rows += bench_iterations(model, options)
    if options.fidelity_rollouts:
        log(f"[bench] {options.models[0]}: fidelity along the trajectory, {options.fidelity_rollouts} rollouts")
        rows += [{**dict.fromkeys(ROW_KEYS), **row}
                 for row in fidelity_rows(bench_config(options.models[0], options.overrides),
                                             options.fidelity_rollouts)]
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jagg_core.bench", description=DESCRIPTION)
    parser.add_argument("--quick", action="store_true", help="W = 2, 3, 5 on the first model and W = 3, 5 on the "
                        "others, 2 repeats, 6 iterations (with --arch: W = 2, 5 cached, 2 repeats, no training)")
    parser.add_argument("--json", help="write the rows as JSON here")
    parser.add_argument("--table", help="write the markdown tables here")
    parser.add_argument("--plot", help="write the reward-vs-seconds PNG here")
    parser.add_argument("--models", help=f"comma-separated models (default: {','.join(default_models())})")
    parser.add_argument("--repeats", type=int, help="timed repeats per variant")
    parser.add_argument("--iterations", type=int, help="iterations of each short training (0: skip)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    parser.add_argument("--no-train-phase", action="store_true", help="skip the train phase of every variant "
                        "(sections 1, 2, 4): only the whole iterations (and --fidelity)")
    parser.add_argument("--training", action="store_true", help="instead: full-length trainings of the first model's "
                        "task (default: the default preset) with the exact and its JAGG backward, same seeds 0, 1, 2: "
                        "held-out gain, wall clock and gain per minute with their spread (jagg_core.bench.training)")
    parser.add_argument("--setups", default="exact,default", help="with --training: the setups trained, of "
                        f"{','.join(SETUP_LABELS)} (flow_grpo: Flow-GRPO's default iteration, every step SDE, exact "
                        "backward, reference in the rollout; tree, flat: the default with tree rollouts, or without "
                        "its own (the default task's); cps: the default "
                        "with Flow-CPS rollout steps; guard: the default with GRPO-Guard's loss; reuse: 2 optimizer "
                        "steps a rollout; dppo: reuse with DPPO's trust region; per_reward: each reward's own group "
                        "advantage (grpo.multi_reward); dora: a DoRA in place of the LoRA; nft, awm: DiffusionNFT "
                        "and AWM as the shapes-nft and shapes-awm presets; a+b: the changes of both, e.g. guard+flat); default "
                        "exact,default")
    parser.add_argument("--journal", metavar="FILE", help="with --training: append each finished run to FILE and reuse "
                        "the runs already there (same setup, seed and config), so a stopped bench goes on where it was")
    parser.add_argument("--earlier", metavar="JSON", help="with --training: also the rows of this earlier --json "
                        "whose setups are not trained now (marked as measured earlier), in the table and plot")
    parser.add_argument("--fidelity", type=int, metavar="ROLLOUTS", help="also the per-window fidelity along the "
                        "trajectory and the Spearman correlation of the routing predictors with it, over ROLLOUTS "
                        "rollouts of the first model at noise levels 0.7 and 1.2 (jagg_core.bench.fidelity)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override of every run of the bench (repeatable), "
                        "e.g. train.gradient_checkpointing=true")
    real = parser.add_argument_group("real architectures", "one real model: " + ", ".join(arch_names()))
    real.add_argument("--arch", help="bench this architecture (its Hub model, or random weights with --random-weights)")
    real.add_argument("--random-weights", action="store_true",
                      help="the arch built from its shipped configs with random weights (model random:ARCH[@LAYERS])")
    real.add_argument("--layers", type=int,
                      help="transformer blocks of the random-weight model (default: the real depth)")
    real.add_argument("--resolution",
                      help=f"image size: a square's side in pixels or WIDTHxHEIGHT, as sampling.resolution (default "
                      f"{ARCH_RESOLUTION['cuda']} on a GPU, {ARCH_RESOLUTION['cpu']} on a CPU)")
    real.add_argument("--quantize", choices=("none", "nf4", "int8"), help="model.quantize of the transformer")
    parser.add_argument("--memory-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quiet_libraries()
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    if args.memory_worker:
        memory_worker(args.memory_worker)
        return
    with exit_on_user_error(parser.prog):
        if args.training:
            run_training(args)
            return
        options = bench_options(args)
        run_and_report(options, args)


def run_training(args: argparse.Namespace) -> None:
    """``--training``: the trainings of :mod:`jagg_core.bench.training`, written to ``--json``/``--table``/``--plot``
    and printed."""
    model = args.models.split(",")[0] if args.models else EMBEDDED_MODEL
    setups = [name.strip() for name in args.setups.split(",") if name.strip()]
    unknown = [name for name in setups if not is_setup(name)]
    if unknown or not setups:
        raise UserError(f"--setups {args.setups}: choose from {', '.join(SETUP_LABELS)}, or join GRPO setups with + "
                        "(guard+flat)")
    earlier = read_earlier_rows(args.earlier) if args.earlier else None
    journal = Path(args.journal) if args.journal else None
    if journal:
        journal.parent.mkdir(parents=True, exist_ok=True)
    rows = training_rows(bench_config(model), setups=setups, journal=journal,
                         overrides=args.overrides)
    if earlier is not None:
        rows = with_earlier(rows, earlier, args.earlier)
    table = format_training(rows)
    for path, write in ((args.json, lambda p: p.write_text(json.dumps(rows, indent=1))),
                        (args.table, lambda p: p.write_text(table)), (args.plot, lambda p: plot_training(rows, p))):
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            write(Path(path))
    print(table)


def read_earlier_rows(path: str) -> list[dict]:
    """The rows of an earlier ``--training --json``, or a one-line error."""
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"--earlier {path}: not a readable bench JSON ({error})") from None
    if not isinstance(rows, list) or not all(isinstance(row, dict) and "setup" in row for row in rows):
        raise UserError(f"--earlier {path}: not the JSON of python -m jagg_core.bench --training")
    return rows


def bench_options(args: argparse.Namespace) -> BenchOptions:
    """The :class:`BenchOptions` of the command line."""
    changes = {key: value for key, value in (("repeats", args.repeats), ("iterations", args.iterations),
                                             ("fidelity_rollouts", args.fidelity)) if value is not None}
    if args.no_memory:
        changes["memory"] = False
    if args.no_train_phase:
        changes["train_phase"] = False
    if args.arch or args.random_weights:
        if args.models:
            raise UserError("--models and --arch exclude each other")
        model = arch_model(args.arch, args.random_weights, args.layers)
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        overrides = arch_overrides(device_type, args.resolution, args.quantize) + args.overrides
        return arch_options(model, overrides, quick=args.quick, **changes)
    given = [flag for flag, value in (("--layers", args.layers), ("--resolution", args.resolution),
                                      ("--quantize", args.quantize)) if value is not None]
    if given:
        raise UserError(f"{', '.join(given)}: only with --arch NAME")
    if args.models:
        changes["models"] = args.models.split(",")
    changes["overrides"] = tuple(args.overrides)
    return BenchOptions.quick(**changes) if args.quick else BenchOptions(**changes)


def run_and_report(options: BenchOptions, args: argparse.Namespace) -> None:
    """Run the bench, write ``--json``/``--table``/``--plot``, print the tables and the machine's load."""
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    rows = run_bench(options, threads=args.threads, log=log_to_stderr)
    table = write_outputs(rows, args.json, args.table, args.plot)
    print(table)
    print(f"{time.perf_counter() - start:.0f} s on {rows[0]['device'] if rows else 'cpu'}, "
          f"{torch.get_num_threads()} threads; load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
