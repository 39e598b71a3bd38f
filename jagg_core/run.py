"""Headless runs: ``python -m jagg_core.run [--preset NAME | --config FILE] [--set a.b=c ...]``.

With no arguments it runs the default preset. Works the same under ``accelerate launch``.
``--help``, ``--list-presets``, ``--dry-run`` and mistakes in the input are answered without
importing torch or diffusers; those load only when a run starts.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import time
from pathlib import Path

from .config import DEFAULT_PRESET, RunConfig, list_presets, load_config
from .errors import UserError, exit_on_user_error, fixable_gpu_failure
from .preflight import check_model, check_references
from .rewards.catalog import CATALOG
from .run_queue import RunQueue, runs_dir
from .rundir import RunDirectory

PROG = "jagg_core.run"
PRINT_EVERY_S = 5.0  # a download's progress line in the output, at most this often


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", help=f"preset name (default {DEFAULT_PRESET}); see --list-presets")
    source.add_argument("--config", help="a run config YAML file")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set train.iterations=20 (repeatable)")
    parser.add_argument("--output-dir", help="run directory (default runs/NAME-TIMESTAMP)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --output-dir (default: the latest run of this name)")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the resolved config, then exit")
    parser.add_argument("--list-presets", action="store_true", help="list the presets and exit")
    parser.add_argument("--list-rewards", action="store_true",
                        help="list the rewards (for rewards and eval.judges) and their options, and exit")
    parser.add_argument("--plan", action="store_true",
                        help="print the expected peak GPU memory by part (from the model's configs), then exit")
    parser.add_argument("--queue", action="store_true",
                        help="write and check the run's config, then add it to the page's queue of runs (the app "
                        "starts it when no run trains); the run folder must be in $JAGG_RUNS_DIR (default runs)")
    parser.add_argument("--doctor", action="store_true",
                        help="run the base eval and one iteration, print the doctor's checklist and stop (resumable "
                        "with --resume); exit 1 when a check fails")
    parser.add_argument("--gpu-memory", type=float, metavar="GB",
                        help="with --plan: the GPU memory to fit (default: the free memory of this machine's GPU)")
    return parser.parse_args(argv)


def latest_run_dir(name: str) -> Path:
    candidates = sorted(runs_dir().glob(f"{name}-*"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise UserError(f"--resume found no run named '{name}' under {runs_dir()}/; pass --output-dir RUN")
    return candidates[-1]


def resolve(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    """The config and run directory this invocation means."""
    run_dir = Path(args.output_dir) if args.output_dir else None
    if run_dir is not None and run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--output-dir {run_dir} is a file; give a folder for the run")
    if args.resume and run_dir is not None and not (args.preset or args.config):
        previous = RunDirectory(run_dir)
        if not previous.is_run():
            raise UserError(f"{run_dir} holds no run to resume (no config.yaml); start it with --preset NAME or "
                            "--config FILE")
        config = load_config(config_file=previous.config_file, overrides=args.overrides)
    else:
        config = load_config(preset=args.preset, config_file=args.config, overrides=args.overrides)
    if run_dir is None and config.output_dir:
        run_dir = Path(config.output_dir)
    if run_dir is None:
        run_dir = latest_run_dir(config.name) if args.resume else runs_dir() / f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    checkpoints = RunDirectory(run_dir).checkpoints_dir
    if not args.resume and checkpoints.is_dir() and any(checkpoints.iterdir()):
        raise UserError(f"{run_dir} already holds a run; add --resume to continue it or choose another --output-dir")
    return config, run_dir


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with exit_on_user_error(PROG):
        if args.list_presets:
            for name, description in list_presets().items():
                print(f"{name:28s} {description}")
            return 0
        if args.list_rewards:
            for entry in CATALOG.values():
                fields = list(entry.options.model_fields)
                options = f"options: {', '.join(fields)}" if fields else "no options"
                print(f"{entry.name:22s} {entry.about} ({options})")
            return 0
        if args.gpu_memory is not None and not args.gpu_memory > 0:
            raise UserError(f"--gpu-memory {args.gpu_memory:g}: give the GPU's memory in GB, a positive number")
        if args.queue and (args.resume or args.doctor):
            raise UserError("--queue adds a new run to the queue; drop --resume and --doctor")
        if args.doctor and args.resume:
            raise UserError("--doctor checks a new run's first iteration; drop --resume (or --doctor)")
        config, run_dir = resolve(args)
        # a memory plan and a dry run need the configs, not the room for the weights, nor the weights offline
        plan = check_references(config, disk=not (args.plan or args.dry_run))
        if plan is not None and plan.left:
            print(f"{PROG}: {plan.summary()}", file=sys.stderr)
        if args.plan:
            return print_plan(config, args.gpu_memory, run_dir)
        if args.dry_run:
            print(config.to_yaml(), end="")
            print(f"# run directory: {run_dir}", file=sys.stderr)
            return 0
        if args.queue:
            return enqueue(config, run_dir)
        return train(config, run_dir, resume=args.resume, doctor_only=args.doctor)


def enqueue(config: RunConfig, run_dir: Path) -> int:
    """``--queue``: the run's folder with its config, added to the queue the app runs (:mod:`.run_queue`)."""
    if run_dir.resolve().parent != runs_dir().resolve():
        raise UserError(f"--queue: the run folder must be directly in {runs_dir()} (the app's runs folder, "
                        "$JAGG_RUNS_DIR); leave out --output-dir or give a folder there")
    run = RunDirectory(run_dir)
    run.write_config(config.to_yaml())
    position = RunQueue(run_dir.parent).add(run_dir)
    print(f"queued {run_dir} at position {position}; the app (python app.py) starts it when no run trains")
    return 0


def print_plan(config: RunConfig, gpu_memory: float | None, run_dir: Path) -> int:
    """``--plan``: the memory plan's table, then whether it fits the GPU and, if not, the cheapest change that does,
    and whether the host holds its text-embedding cache."""
    from .quiet import quiet_libraries
    quiet_libraries()
    from .gpus import gpu_free_gb
    from .memory_plan import check_fits, check_host, plan_memory
    plan = plan_memory(config)
    print(plan.table())
    print(check_fits(plan, config, gpu_memory if gpu_memory is not None else gpu_free_gb()))
    if host := check_host(plan, run_dir):
        print(host)
    return 0


def train(config: RunConfig, run_dir: Path, resume: bool, doctor_only: bool = False) -> int:
    """Train in ``run_dir``; its lock is taken first (another live trainer there is a one-line error and changes
    nothing), then SIGTERM/SIGINT at any moment end with status ``stopped`` and exit 128 + signal; the reward-hacking
    alarm under ``train.on_hacking: stop`` ends it ``stopped`` with exit 3. ``doctor_only`` (``--doctor``): the base
    eval and the first iteration, then ``stopped``; exit 1 when a check of the doctor failed."""
    from .stopping import AlarmStop, StopRequested, install_stop_handlers

    install_stop_handlers()
    run = RunDirectory(run_dir)
    is_main = os.environ.get("RANK", "0") == "0"  # accelerate's launcher numbers the processes
    if is_main:
        run.acquire_trainer_lock()
    trainer = None
    try:
        if is_main:  # what the run does from its first second: the page and the log say it
            _say_loading(run, config)
        if download_base_model(config, run, report=is_main, resume=resume) and is_main:
            _say_loading(run, config)
        from .quiet import quiet_libraries
        quiet_libraries()
        from .trainer import Trainer
        trainer = Trainer(config, run_dir, resume=resume, doctor_only=doctor_only)
        trainer.setup()
        trainer.fit()
        if doctor_only:
            passed = bool((trainer.doctor_report or {}).get("passed"))
            print(f"{PROG}: doctor {'passed' if passed else 'FAILED'}; the run stopped after iteration 1, continue it "
                  f"with --resume --output-dir {run_dir}")
            return 0 if passed else 1
        if config.hub.push and is_main:
            from .hub import push_if_configured
            print(f"pushed to {push_if_configured(run_dir, config)}")
    except AlarmStop as alarm:
        if is_main:
            _record_end(run, "stopped", f"{alarm}; stopped by the alarm (train.on_hacking stop), checkpoint kept")
        print(f"{PROG}: stopped by the reward-hacking alarm: {alarm}; the best adapter is in {run.best_dir}; resume "
              f"with --resume --output-dir {run_dir} (--set train.on_hacking=warn to go on regardless)",
              file=sys.stderr)
        return AlarmStop.exit_code
    except StopRequested as stopped:
        if is_main:
            _record_end(run, "stopped", f"stopped by {stopped}; resume with --resume")
        print(f"{PROG}: stopped ({stopped}); resume with --resume --output-dir {run_dir}", file=sys.stderr)
        return stopped.exit_code
    except UserError as err:
        if is_main:
            _record_end(run, "failed", str(err))
        raise
    except OSError as err:
        if is_main:
            _record_end(run, "failed", f"{type(err).__name__}: {err}")
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise UserError(f"the disk holding {run_dir} is full ({err.strerror}); free some space, then resume "
                            f"with --resume --output-dir {run_dir}") from None
        raise
    except BaseException as err:
        fixable = fixable_gpu_failure(err, run_dir, config.model.cudnn_attention)
        if is_main:
            _record_end(run, "failed", fixable or f"{type(err).__name__}: {err}")
        if fixable:
            raise UserError(fixable) from None
        raise
    finally:
        if trainer is not None:
            trainer.close()
    return 0


def _say_loading(run: RunDirectory, config: RunConfig) -> None:
    loading = f"loading the model {config.model.name}"
    run.write_status("running", pid=os.getpid(), phase="loading", message=loading, download=None)
    print(f"{PROG}: {loading}", flush=True)


def download_base_model(config: RunConfig, run: RunDirectory, *, report: bool = True, resume: bool = False) -> bool:
    """The ``downloading`` phase: a Hub base model with files not yet in the Hugging Face cache is downloaded there
    (:mod:`jagg_core.download`: it continues an interrupted download) before the trainer loads it; True if it was.
    A text-embedding cache the host cannot hold is refused first, sized from the model's configs (a resume with its
    cache written checks it as it reads it back).

    With ``report`` (the main process) it is reported about once a second in status.json: ``phase: downloading``,
    ``message`` ("downloading OWNER/NAME: 3.2 of 23.8 GB, 41 MB/s, about 8 min left") and ``download``: ``{"done":
    bytes of the model in the cache, "total": bytes of the files the run needs, "rate": bytes/s}``, and the message
    is printed at most every :data:`PRINT_EVERY_S` seconds and at the end. Every process downloads (each file under a
    lock, so a file is fetched once): none loads the model before its files are complete."""
    from .download import download_model
    plan = check_model(config.model)  # again: the cache may have changed since the pre-flight
    if plan is None or not plan.pending:
        return False
    if not (resume and run.text_embeddings_file.is_file()):
        from .memory_plan import check_text_cache_before_download
        check_text_cache_before_download(config, run.path, int(os.environ.get("WORLD_SIZE", "1")))
    printed = [float("-inf")]  # when the last line was printed (time.monotonic())

    def say(transfer, end: bool = False) -> None:
        line = transfer.line(config.model.name)
        run.write_status("running", phase="downloading", message=line,
                         download={"done": transfer.done, "total": transfer.total, "rate": round(transfer.rate)})
        if end or time.monotonic() - printed[0] >= PRINT_EVERY_S:
            print(f"{PROG}: {line}", flush=True)
            printed[0] = time.monotonic()

    end = download_model(plan, say if report else None)
    if report:
        say(end, end=True)
    return True


def _record_end(run: RunDirectory, state: str, message: str) -> None:
    """Write the final status and remove this process's half-written files, as far as the disk allows."""
    try:
        run.remove_temporaries()
        run.write_status(state, message=message)
    except OSError as err:
        print(f"{PROG}: could not record the run's end in {run.status_file} ({err.strerror})", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
