"""The check's driver: the order (:mod:`.ledger`), one process per step under its cap, the files, the tables."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..errors import without_torch_boilerplate
from ..report import cell, markdown_table
from .common import GB, NOT_OK, CheckOptions, Step, one_line
from .ledger import Outcome, describe_order, plan_order, read_ledger, stale_changes, step_status
from .settings import CurrentSettings, describe_changes
from .steps import all_steps, run_step, step_names
from .triage import triage_verdict

#: one call on the GPU machine: the device time lent is about 15 minutes in all, with the machine's start
DEFAULT_BUDGET_S = 480
#: steps run side by side at most (those that share the GPU: :attr:`~.common.Step.shares_gb`), and the part of the
#: GPU's memory they may take together (the rest: their CUDA contexts)
DEFAULT_PARALLEL, GPU_ROOM = 4, 0.85
#: the ledger and outputs of a real-size check, and of a ``--reduced`` one (git-ignored)
DEFAULT_OUT, REDUCED_OUT = Path("docs/gpu"), Path("gpu_check")
TABLE_FILE = "gpu_check.md"
#: the lines around the README's copy of the tables (HTML comments: Markdown shows neither), see :func:`write_readme`
README_START = "<!-- the GPU check's tables: python -m jagg_core.gpu_check --table --readme README.md -->"
README_END = "<!-- end of the GPU check's tables -->"


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass
class StepProcess:
    """A step running in a process of its own (a session: its children die with it), its output into its log."""

    step: Step
    cap_s: float
    log_file: Path
    result_file: Path
    process: subprocess.Popen
    date: str
    started: float

    @classmethod
    def start(cls, step: Step, options: CheckOptions, cap_s: float, log_file: Path, result_file: Path) -> StepProcess:
        command = [sys.executable, "-m", "jagg_core.gpu_check", "--step", step.name, "--result", str(result_file),
                   "--threads", str(options.threads), *(["--reduced"] if options.reduced else [])]
        with log_file.open("w") as handle:
            process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1", **step.env})
        return cls(step, cap_s, log_file, result_file, process, now(), time.perf_counter())

    def finish(self) -> list[dict]:
        """Its rows, once it has ended. Killed at its cap: a ``timed out`` row; dead without its rows (a signal, a
        CUDA context gone): a ``crashed`` row with the signal and the log's last error line."""
        try:
            code = self.process.wait(timeout=max(0.0, self.started + self.cap_s - time.perf_counter()))
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            return [{"step": self.step.name, "status": "timed out", "reason": f"ran past its {self.cap_s:g} s cap"}]
        if self.result_file.is_file():  # the rows came out, whatever the exit (a broken CUDA context may fail it)
            return json.loads(self.result_file.read_text())
        died = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
        error = last_error(self.log_file)
        return [{"step": self.step.name, "status": "crashed", "reason": died + (f"; {error}" if error else "")}]

    def stop(self) -> None:
        """Kill its session if it still runs: a check stopped (Ctrl-C, SIGTERM) takes its steps with it, which
        their own sessions would otherwise keep alive on the GPU."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def next_batch(queue: list[Step], parallel: int, room_gb: float | None) -> list[Step]:
    """The steps to run together next: the first of ``queue``, and when it shares the GPU (``Step.shares_gb``) the
    later steps of the queue that share it too, in their order, at most ``parallel`` in all, their memory within
    ``room_gb`` (None: no GPU's memory to count, a CPU)."""
    first = queue[0]
    batch = [first]
    if first.shares_gb is None:
        return batch
    for step in queue[1:]:
        if len(batch) == parallel:
            break
        if step.shares_gb is not None and (room_gb is None or sum(s.shares_gb for s in batch) + step.shares_gb
                                           <= room_gb):
            batch.append(step)
    return batch


def last_error(log: Path) -> str:
    """The last line of the log that names an error (a traceback ends with it)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)]
    return errors[-1][:300] if errors else ""


def write_archive(out: Path, archive: Path) -> None:
    """Every file of ``out`` in the gzipped tar ``archive``, replaced whole (a lent machine returns at most 8 files: the
    check's dozens travel as one)."""
    part = archive.with_name(archive.name + ".part")
    with tarfile.open(part, "w:gz") as tar:
        for path in sorted(p for p in out.iterdir() if p.is_file() and p.name not in (archive.name, part.name)):
            tar.add(path, arcname=path.name)
    os.replace(part, archive)


def run_check(out: Path, options: CheckOptions, budget_s: float = DEFAULT_BUDGET_S, only: list[str] | None = None,
              ledger_folder: Path | None = None, caps: dict[str, float] | None = None, log=print,
              parallel: int | None = None, archive: Path | None = None) -> list[dict]:
    """The steps of :func:`~.ledger.plan_order` within ``budget_s``: a step starts only while its whole cap
    (``caps`` or its own) fits in what is left, else the next, shorter one gets the time. Steps that share the GPU
    run side by side (:func:`next_batch`, at most ``parallel``, within :data:`GPU_ROOM` of the device's memory),
    each in its own process; the others alone. ``parallel`` None: :data:`DEFAULT_PARALLEL` on a GPU, 1 on a CPU
    (whose cores are what the steps compute with). Each step leaves ``out/STEP.json`` and ``out/STEP.log``;
    ``out/gpu_check.md`` (the tables of the ledger and this run) is rewritten after each batch, and so is ``archive``
    (:func:`write_archive`) when given; a real-size check stops when the device step finds no GPU. Returns this run's
    rows."""
    def tables() -> None:
        (out / TABLE_FILE).write_text(format_tables(ledger, steps, options, settings))
        if archive is not None:
            write_archive(out, archive)

    steps = all_steps(options)
    cap = {step.name: (caps or {}).get(step.name, step.cap(options)) for step in steps}
    check_step_names(only, steps)
    out.mkdir(parents=True, exist_ok=True)
    ledger = read_ledger([ledger_folder or out, out], options)
    settings = CurrentSettings(steps, options)
    queue = plan_order(steps, ledger, settings, only)
    log(f"[gpu-check] {len(ledger)} step(s) already measured; this run's order, within {budget_s:g} s:")
    for line in describe_order(queue, ledger, settings, options):
        log(f"[gpu-check]   {line}")
    tables()
    start, rows, not_started = time.perf_counter(), [], []
    while queue:
        left = max(0.0, budget_s - (time.perf_counter() - start))
        too_long = [s for s in queue if cap[s.name] > left]  # the time left only shrinks: never started
        not_started += [f"{s.name} ({cap[s.name]:g} s > {left:.0f} s)" for s in too_long]
        queue = [s for s in queue if s not in too_long]
        if not queue:
            break
        room = _gpu_room(ledger)
        batch = next_batch(queue, parallel or (DEFAULT_PARALLEL if room else 1), room)
        queue = [s for s in queue if s not in batch]
        log(f"[gpu-check] {' + '.join(f'{s.name} (cap {cap[s.name]:g} s)' for s in batch)}"
            f"{' side by side' if len(batch) > 1 else ''}, {left:.0f} s left")
        with tempfile.TemporaryDirectory() as tmp:
            running = []
            try:
                running += [StepProcess.start(s, options, cap[s.name], out / f"{s.name}.log",
                                              Path(tmp) / f"{s.name}.json") for s in batch]
                for process in running:
                    step_rows = process.finish()
                    seconds = time.perf_counter() - process.started
                    name = process.step.name
                    record = {"date": process.date, "step": name, "cap_s": process.cap_s, "seconds": seconds,
                              "options": asdict(options), "rows": step_rows,
                              **({"beside": [s.name for s in batch if s is not process.step]}
                                 if len(batch) > 1 else {}),
                              **({"settings": settings[name]} if settings[name] is not None else {})}
                    (out / f"{name}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
                    ledger[name] = Outcome(step_status(step_rows), process.date, step_rows, seconds, settings[name])
                    log(f"[gpu-check] {name}: {ledger[name].status} in {seconds:.0f} s")
                    rows += step_rows
            finally:
                for process in running:
                    process.stop()
        tables()
        if batch[0].name == "device" and ledger["device"].status != "ok":
            log("[gpu-check] no GPU to check: the other steps would measure the CPU; stopping")
            break
    if not_started:
        log(f"[gpu-check] not started, their cap more than the time left: {', '.join(not_started)}")
    return rows


def _gpu_room(ledger: dict[str, Outcome]) -> float | None:
    """GB the steps side by side may take: :data:`GPU_ROOM` of the GPU the device step found (None: no GPU)."""
    device = ledger["device"].rows[0] if "device" in ledger else {}
    return GPU_ROOM * device["gpu_total_gb"] if device.get("gpu_total_gb") else None


# ----- the tables ---------------------------------------------------------------------------------------
def _f(value, spec: str = ".2f") -> str:
    return cell(value, spec)


def _with_reason(status: str, reason: str | None) -> str:
    """``status: reason`` for a row not ok, less torch's request for better messages (the records keep it)."""
    return status + (f": {without_torch_boilerplate(reason)}" if reason and status != "ok" else "")


def _status(row: dict) -> str:
    return _with_reason(row["status"], row.get("reason"))


def _backward(row: dict) -> str:
    if row.get("mode") in (None, "exact"):
        return row.get("mode") or "-"
    return f"JAGG W={row['window']} {row['mode']} {'joint' if row.get('joint') else 'sequential'}"


def _peak(row: dict) -> str:
    return _f(row["peak_mem_mb"] * 2 ** 20 / GB if row.get("peak_mem_mb") else None)


def format_tables(ledger: dict[str, Outcome], steps: list[Step], options: CheckOptions,
                  settings: dict[str, dict | None]) -> str:
    """The markdown report of the ledger: every step's last outcome and date (or never measured; stale: measured
    under other settings than ``settings``, today's), the triage's verdict, then the figures by table: triage,
    whole iterations, quantization, memory, tiny runs."""
    size = "reduced: 1 block, 64 px, on the CPU" if options.reduced else "real size"
    device = ledger["device"].rows[0] if "device" in ledger else {}
    machine = (f"{device.get('gpu', 'no GPU')}; torch {device['versions']['torch']}, "
               f"checked {ledger['device'].date[:10]}" if device.get("versions") else "device not checked")
    if device.get("cuda_context_gb") is not None:
        machine += f"; CUDA context with cuBLAS, cuDNN and attention loaded: {device['cuda_context_gb']:.2f} GB"
    if device.get("tmp_free_gb") is not None:
        machine += f"; {device['tmp_free_gb']:.0f} GB free in its temporary folder"
    parts = [f"GPU check ({size}). Last device: {machine}.",
             markdown_table(["step", "cap s", "last outcome", "date", "s"],
                            [[s.name, _f(s.cap(options), ".0f"), _outcome(ledger.get(s.name), settings, s.name),
                              ledger[s.name].date[:10] if s.name in ledger else "-",
                              _f(ledger[s.name].seconds, ".0f") if s.name in ledger else "-"] for s in steps])]
    rows = {table: [row for s in steps if s.table == table and s.name in ledger for row in ledger[s.name].rows]
            for table in {s.table for s in steps}}
    statuses = {name: "skipped" if all(row["status"] == "skipped" for row in outcome.rows) else outcome.status
                for name, outcome in ledger.items()}  # a kernel this device lacks answers nothing
    parts.append("Triage of the FLUX.1-dev crash:\n\n" + "\n".join(f"- {line}" for line in triage_verdict(statuses)))
    if rows.get("triage"):
        parts.append(markdown_table(["triage case", "status", "out err", "grad err", "shape"],
                                    [[r["step"], _status(r), _f(r.get("out_err"), ".1e"),
                                      _f(r.get("grad_err", r.get("grad_down_err")), ".1e"), _shape(r)]
                                     for r in rows["triage"]]))
    if rows.get("bench") or rows.get("quantize"):
        parts.append(markdown_table(
            ["whole iteration (random weights)", "base", "px", "backward", "status", "rollout s", "train s",
             "train speed-up", "iteration speed-up", "grad cosine", "peak GB"],
            [[r.get("model", r["step"]), r.get("quantize", "none"), _f(r.get("resolution"), ""), _backward(r),
              _status(r), _f(r.get("rollout_s")), _f(r.get("train_s")), _f(r.get("speedup")),
              _f(r.get("iteration_speedup")), _f(r.get("grad_cosine"), ".4f"), _peak(r)]
             for r in rows.get("bench", []) + rows.get("quantize", [])]))
    if rows.get("memory"):
        parts.append(markdown_table(
            ["preset recipe (random weights)", "status", "set-up planned / measured GB",
             "training planned / measured GB", "planned / measured", "training reserved GB", "preset's plan GB"],
            [[" + ".join([r.get("preset", r["step"]), *r.get("overrides", []),
                          *(f"{key}={value}" for key, value in r.get("env", {}).items())]), _status(r),
              f"{_f(r.get('planned_setup_gb'))} / {_f(r.get('measured_setup_gb'))}",
              f"{_f(r.get('planned_gb'))} / {_f(r.get('measured_gb'))}", _f(r.get("planned_over_measured")),
              _f(r.get("measured_reserved_gb")), _f(r.get("preset_planned_gb"))] for r in rows["memory"]]))
    if rows.get("tiny"):
        parts.append(markdown_table(
            ["model", "base (bf16, 8-bit AdamW)", "status", "loss", "reward", "eval reward", "s", "peak GB"],
            [[r["step"], r.get("recipe", "-"), _status(r), _f(r.get("loss"), "+.5f"), _f(r.get("reward"), ".3f"),
              _f(r.get("eval_reward"), ".3f"), _f(r.get("seconds"), ".1f"), _f(r.get("peak_gb"))]
             for r in rows["tiny"]]))
    return "\n\n".join(parts) + "\n"


def _outcome(outcome: Outcome | None, settings: dict[str, dict | None], name: str) -> str:
    if outcome is None:
        return "never measured"
    if changes := stale_changes(outcome, settings, name):
        return f"ok, stale: {describe_changes(changes)}"
    reasons = [row["reason"] for row in outcome.rows if row["status"] == outcome.status and row.get("reason")]
    return _with_reason(outcome.status, reasons[0] if reasons else None)


def _shape(row: dict) -> str:
    if "rank" in row:
        return f"rank {row['rank']}, {row['rows']} x {row['width']}, {row['dtype']}"
    if "tokens" in row:
        return (f"{row['samples']} x {row['heads']} heads x {row['tokens']} tokens x {row['head_dim']}, {row['dtype']}"
                + (", permuted views" if row.get("layout") == "permuted" else ""))
    return f"{_backward(row)}, {row['setting']}" if "setting" in row else "-"


# ----- the command ----------------------------------------------------------------------------------------
def _cap(text: str) -> tuple[str, float]:
    name, _, seconds = text.partition("=")
    return name, float(seconds)


def check_step_names(only: list[str] | None, steps: list[Step]) -> None:
    """Refuse, in one line naming the steps, the names in ``only`` that are no step's."""
    unknown = sorted(set(only or ()) - {step.name for step in steps})
    if unknown:
        from ..errors import UserError
        raise UserError(f"unknown step(s) {', '.join(unknown)}; steps: {', '.join(s.name for s in steps)}")


def main(argv: list[str] | None = None) -> int:
    from . import __doc__ as overview
    parser = argparse.ArgumentParser(prog="python -m jagg_core.gpu_check", description=overview.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help=f"folder of each step's STEP.json and STEP.log and of {TABLE_FILE} "
                        f"(default {DEFAULT_OUT}, with --reduced {REDUCED_OUT})")
    parser.add_argument("--archive", type=Path, help="also keep every file of --out in this .tar.gz, rewritten after "
                        "each step (a lent GPU machine returns at most 8 files: --archive \"$OUT/gpu_check.tar.gz\")")
    parser.add_argument("--ledger", type=Path, help="folder of the earlier checks' *.json (default: --out)")
    parser.add_argument("--reduced", action="store_true",
                        help="real architectures at 1 block and 64 px, the simulated crash and hang (no GPU needed)")
    parser.add_argument("--only", help="comma-separated steps to run whatever the ledger says: "
                        + ", ".join(step_names()))
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for the whole check; a step starts only if its cap fits (default "
                        f"{DEFAULT_BUDGET_S})")
    parser.add_argument("--cap", type=_cap, action="append", default=[], metavar="STEP=SECONDS",
                        help="another cap for one step (repeatable)")
    parser.add_argument("--table", action="store_true", help=f"print the ledger's tables ({TABLE_FILE}) and exit")
    parser.add_argument("--readme", type=Path, metavar="FILE",
                        help="with --table: also put the tables into FILE between its lines "
                        f"'{README_START}' and '{README_END}'")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads of the steps (default 2)")
    parser.add_argument("--parallel", type=int,
                        help="most steps side by side, of those that share the GPU (kernel errors, memory peaks, "
                        f"tiny runs; not the timed ones); 1: one at a time (default {DEFAULT_PARALLEL} on a GPU, 1 "
                        "on a CPU)")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    options = CheckOptions(reduced=args.reduced, threads=args.threads)
    from ..errors import UserError, exit_on_user_error
    with exit_on_user_error(parser.prog):  # before the libraries load (seconds): a typo is answered at once
        if args.parallel is not None and args.parallel < 1:
            raise UserError(f"--parallel must be at least 1, not {args.parallel}")
        if args.readme and not args.table:
            raise UserError("--readme goes with --table: python -m jagg_core.gpu_check --table --readme README.md")
        check_step_names(args.only.split(",") if args.only else None, all_steps(options))
    from ..quiet import log_to_stderr, quiet_libraries
    quiet_libraries()
    if args.step:
        return _run_one_step(args.step, Path(args.result), options)
    out = args.out or (REDUCED_OUT if args.reduced else DEFAULT_OUT)
    if args.table:
        ledger, steps = read_ledger([args.ledger or out, out], options), all_steps(options)
        tables = format_tables(ledger, steps, options, CurrentSettings(steps, options))
        if args.readme:
            with exit_on_user_error(parser.prog):
                write_readme(args.readme, tables)
        print(tables, end="")
        return 0
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))  # its steps stop too (run_check)
    with exit_on_user_error(parser.prog):
        rows = run_check(out, options, args.budget, args.only.split(",") if args.only else None, args.ledger,
                         dict(args.cap), log=log_to_stderr,
                         parallel=args.parallel, archive=args.archive)
        print((out / TABLE_FILE).read_text(), end="")
        not_ok = sorted({r["step"] for r in rows if r["status"] in NOT_OK})
        print(f"{len(rows)} rows this run, {len(not_ok)} step(s) not ok{': ' + ', '.join(not_ok) if not_ok else ''}; "
              f"{out / TABLE_FILE}")
        return 1 if not_ok else 0


def write_readme(readme: Path, tables: str) -> None:
    """Replace what stands between ``readme``'s :data:`README_START` and :data:`README_END` lines with ``tables``
    (after a lease, the README's GPU section is then the ledger's tables, as ``docs/gpu/gpu_check.md`` is), written
    whole (:func:`~jagg_core.rundir.atomic_write_text`)."""
    from ..errors import UserError
    from ..rundir import atomic_write_text
    text = readme.read_text()
    start, end = text.find(README_START + "\n"), text.find("\n" + README_END)
    if start < 0 or end < start:
        raise UserError(f"{readme} has no line {README_START!r} followed later by a line {README_END!r}: put both "
                        "where the GPU check's tables belong")
    body = start + len(README_START) + 1
    atomic_write_text(readme, text[:body] + "\n" + tables.strip("\n") + "\n" + text[end:])


def _run_one_step(name: str, result: Path, options: CheckOptions) -> int:
    """A step's process: its rows into ``result``, then out at once (a broken CUDA context can hang the exit)."""
    import torch
    torch.set_num_threads(options.threads)
    try:
        rows = run_step(name, options)
    except Exception as err:  # a step's failure is its row; the check goes on with the next step
        traceback.print_exc()
        rows = [{"step": name, "status": "failed", "reason": one_line(err)}]
    result.write_text(json.dumps(rows, default=str))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
