"""Training jobs: launch, stop and find the one training process of this machine.

A job is ``accelerate launch -m jagg_core.run --config RUN/config.yaml --output-dir RUN`` started in its own
process group (``start_new_session``), with stdout and stderr in the run's output log (``RUN/stdout.log``).
The app never imports training state: it only starts and signals the process group and reads the run directory.

One job at a time per machine. The runs root holds a lock file, ``.active-job.json``, with the job's pid, process
group and run directory. It is created exclusively (``O_EXCL``), so two Start clicks, two browser tabs or two app
processes cannot both launch. The lock is how the app reattaches to a job after a page reload or an app restart,
and it goes stale when no process of the group is left: then it is removed, and a run that ended without writing a
final state (killed, crashed while importing) is marked ``failed`` with the last error line of its output.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from jagg_core.errors import UserError
from jagg_core.run_queue import RunQueue, runs_root
from jagg_core.rundir import RunDirectory

__all__ = ["JobControl", "runs_root"]

LOCK_NAME = ".active-job.json"
RUN_STAMP = re.compile(r"-(\d{8}-\d{6})(-\d+)?$")
STOP_GRACE_S = 120.0  # the trainer finishes its iteration and checkpoints it before it exits
MAX_NAME = 120  # characters of a run folder's name
LAUNCHING_GRACE_S = 60.0  # an empty lock younger than this is a launch in progress, older is stale
QUEUE_POLL_S = 2.0  # how often the queue's worker looks for a free machine
PLACEMENT_FILE = "placement.json"  # a queued run's processes and sharding, chosen when it was queued
FSDP_CONFIG = Path(__file__).resolve().parent.parent / "presets" / "accelerate" / "fsdp.yaml"


@dataclass(frozen=True)
class Placement:
    """How many processes a job runs (one per GPU; on a CPU, processes sharing its cores) and whether they shard
    the transformer (FSDP, ``presets/accelerate/fsdp.yaml``) or each hold all of it (data parallel)."""

    processes: int = 1
    sharded: bool = False

    def words(self) -> str:
        if self.processes == 1:
            return "1 process"
        return f"{self.processes} processes, " + ("the transformer sharded (FSDP)" if self.sharded else "data parallel")


def launch_command(run_dir: Path, mixed_precision: str, resume: bool, placement: Placement = Placement()) -> list[str]:
    """The ``accelerate launch`` command line of a job: one process, several data parallel (gloo on a CPU), or
    several sharding the transformer with the FSDP config (``--cpu`` for one process without a CUDA GPU). Several
    processes meet on a free port accelerate picks (``--main_process_port 0``): its default, 29500, is taken while
    another job of several processes runs on the machine (two jobs on two GPUs each, from the queue), and accelerate
    would then warn in the run's log and fall back."""
    import psutil
    import torch

    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(placement.processes),
               "--num_machines", "1", "--mixed_precision", mixed_precision, "--dynamo_backend", "no",
               "--quiet"]  # a failed run's log ends with its one-line error, not the launcher's traceback
    if placement.sharded:
        command += ["--config_file", str(FSDP_CONFIG)]
    elif placement.processes > 1:
        command += ["--multi_gpu"]
    if placement.processes > 1:
        command += ["--main_process_port", "0"]
    if not torch.cuda.is_available():  # the thread count accelerate picks; given, it keeps a warning out of the log
        cores = max(1, (psutil.cpu_count(logical=False) or 1) // placement.processes)
        command += (["--cpu"] if placement.processes == 1 else []) + ["--num_cpu_threads_per_process", str(cores)]
    command += ["-m", "jagg_core.run", "--config", str(RunDirectory(run_dir).config_file), "--output-dir", str(run_dir)]
    return command + (["--resume"] if resume else [])


def queue_placement(run_dir: Path, placement: Placement) -> None:
    """Keep a queued run's placement beside its config (``RUN/placement.json``), for the queue's launch."""
    RunDirectory(run_dir).write_json(run_dir / PLACEMENT_FILE, {"processes": placement.processes,
                                                                "sharded": placement.sharded})


def queued_placement(run_dir: Path) -> Placement:
    """The placement a queued run was queued with (:func:`queue_placement`); one process without one."""
    try:
        kept = json.loads((run_dir / PLACEMENT_FILE).read_text())
        return Placement(max(1, int(kept.get("processes", 1))), bool(kept.get("sharded", False)))
    except (OSError, ValueError, TypeError, AttributeError):
        return Placement()


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still running (zombies do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        state, group = fields[0], int(fields[2])
        if group == pgid and state not in ("Z", "X"):
            return True
    return False


def last_error_line(run_dir: Path) -> str:
    """The most telling line of the job's output: the last ``error``/exception line, else the last line."""
    try:
        lines = [line.strip() for line in RunDirectory(run_dir).output_log.read_text(errors="replace").splitlines()
                 if line.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if "error:" in line.lower() or line.split(":")[0].endswith(("Error", "Exception")):
            return line
    return lines[-1] if lines else ""


@dataclass(frozen=True)
class Job:
    """The running job: its run directory and process group."""

    run_dir: Path
    pid: int
    pgid: int
    started_at: float
    resumed: bool


class JobControl:
    """Launches, stops and finds the single training job of the runs root."""

    def __init__(self, root: Path):
        self.root = root
        self.lock_file = root / LOCK_NAME
        self._mutex = threading.Lock()
        self._children: dict[int, subprocess.Popen] = {}  # jobs this process launched, reaped by poll()
        self._stopping: int | None = None  # pid of the job stop() is ending
        self.queue = RunQueue(root)

    # ----- the lock ------------------------------------------------------------------------
    def _read_lock(self) -> dict | None:
        try:
            text = self.lock_file.read_text()
        except FileNotFoundError:
            return None
        try:
            return json.loads(text)
        except ValueError:
            age = time.time() - self.lock_file.stat().st_mtime
            return {"launching": True} if age < LAUNCHING_GRACE_S else {}

    def active(self) -> Job | None:
        """The running job, or None (a stale lock is cleared and its run's final state recorded)."""
        lock = self._read_lock()
        if lock is None or lock.get("launching"):
            return None
        if lock:
            child = self._children.get(lock["pid"])
            if child is not None:
                child.poll()
            if _group_alive(lock["pgid"]):
                return Job(Path(lock["run_dir"]), lock["pid"], lock["pgid"], lock["started_at"], lock["resumed"])
            if lock["pid"] == self._stopping:
                return None  # stop() records the end and removes the lock itself
            self._finish(Path(lock["run_dir"]), lock["pid"], stopped=False)
        self.lock_file.unlink(missing_ok=True)
        return None

    def _finish(self, run_dir: Path, pid: int, stopped: bool) -> None:
        """Record the end of a job whose process did not write a final state itself."""
        child = self._children.pop(pid, None)
        code = child.poll() if child is not None else None
        run = RunDirectory(run_dir)
        if run.read_status().get("state", "running") != "running":
            return
        if stopped:
            run.write_status("stopped", message="stopped before the trainer could save its state; "
                                                "resume continues from the last checkpoint")
            return
        why = last_error_line(run_dir) or "no output"
        exit_part = f" (exit code {code})" if code is not None else ""
        run.write_status("failed", message=f"the training process ended{exit_part}: {why}")

    # ----- launch and stop -------------------------------------------------------------------
    def launch(self, run_dir: Path, mixed_precision: str, resume: bool = False,
               placement: Placement = Placement()) -> Job:
        """Start the job of ``run_dir`` (its config.yaml must exist) on ``placement``; refuse if a job is active."""
        with self._mutex:
            busy = self.active()
            if busy is not None:
                raise UserError(f"a run is active: {busy.run_dir.name}; stop it before starting another")
            try:
                fd = os.open(self.lock_file, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                raise UserError("another run is being launched right now; wait a moment") from None
            os.close(fd)
            try:
                with RunDirectory(run_dir).output_log.open("ab") as output:
                    command = launch_command(run_dir, mixed_precision, resume, placement)
                    process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
            except BaseException:
                self.lock_file.unlink(missing_ok=True)
                raise
            self._children[process.pid] = process
            job = Job(run_dir, process.pid, os.getpgid(process.pid), time.time(), resume)
            tmp = self.lock_file.with_name(f"{LOCK_NAME}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"run_dir": str(run_dir), "pid": job.pid, "pgid": job.pgid,
                                       "started_at": job.started_at, "resumed": resume}))
            os.replace(tmp, self.lock_file)
            return job

    def stop(self, grace_s: float = STOP_GRACE_S) -> Job | None:
        """End the active job's process group: SIGTERM (the trainer records "stopped" and exits), then SIGKILL
        after ``grace_s``. The last checkpoint stays; returns the stopped job, or None if none was running."""
        with self._mutex:
            job = self.active()
            if job is None:
                return None
            self._stopping = job.pid
            try:
                self._signal(job.pgid, signal.SIGTERM)
                deadline = time.monotonic() + grace_s
                while self._alive(job) and time.monotonic() < deadline:
                    time.sleep(0.2)
                if self._alive(job):
                    self._signal(job.pgid, signal.SIGKILL)
                    while self._alive(job) and time.monotonic() < deadline + 10:
                        time.sleep(0.2)
                self._finish(job.run_dir, job.pid, stopped=True)
                self.lock_file.unlink(missing_ok=True)
            finally:
                self._stopping = None
            return job

    def _alive(self, job: Job) -> bool:
        child = self._children.get(job.pid)
        if child is not None:
            child.poll()
        return _group_alive(job.pgid)

    @staticmethod
    def _signal(pgid: int, signum: int) -> None:
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            pass

    # ----- the queue ---------------------------------------------------------------------------
    def start_next_queued(self) -> Job | None:
        """Launch the first queued run (:mod:`jagg_core.run_queue`) when no run trains on this machine, neither this
        app's job nor one started elsewhere; the launched job, or None."""
        run_dir = self.queue.next()
        if run_dir is None or self.active() is not None or self.trained_elsewhere() is not None:
            return None
        precision = (RunDirectory(run_dir).read_config().get("train") or {}).get("mixed_precision", "no")
        try:
            job = self.launch(run_dir, precision, placement=queued_placement(run_dir))
        except UserError:  # another launch won the race; the queue waits for the next free moment
            return None
        self.queue.started(run_dir.name)
        return job

    def run_queue_in_background(self, poll_s: float = QUEUE_POLL_S) -> threading.Thread:
        """A daemon thread that starts the queued runs in turn, for as long as the app lives."""
        def work() -> None:
            while True:
                try:
                    self.start_next_queued()
                except (OSError, UserError):  # a run folder removed or damaged meanwhile: look again later
                    pass
                time.sleep(poll_s)

        thread = threading.Thread(target=work, name="run-queue", daemon=True)
        thread.start()
        return thread

    # ----- runs ----------------------------------------------------------------------------
    def runs(self) -> list[Path]:
        """The run directories under the root, newest first (by the ``-YYYYmmdd-HHMMSS`` of their name)."""
        found = [p for p in self.root.iterdir() if self.run_dir(p.name) is not None]
        return sorted(found, key=_created, reverse=True)

    def run_dir(self, name: str) -> Path | None:
        """The run called ``name``: a folder directly in the root (no path, not a link) holding a run."""
        if not name or len(name) > MAX_NAME or name in (".", "..") or "/" in name or "\\" in name:
            return None
        path = self.root / name
        inside = not path.is_symlink() and path.resolve().parent == self.root.resolve()
        return path if inside and path.is_dir() and RunDirectory(path).is_run() else None

    def trained_elsewhere(self) -> Path | None:
        """A run of the root that a live process started outside this app is training (it holds the run's lock)."""
        job = self.active()
        return next((p for p in self.runs() if (job is None or p != job.run_dir) and RunDirectory(p).trainer_alive()),
                    None)

    def new_run_dir(self, name: str) -> Path:
        """A fresh, empty run directory ``NAME-YYYYmmdd-HHMMSS`` (``-2``, ``-3``... if taken)."""
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")[:MAX_NAME - 20].strip("-.") or "run"
        base = f"{slug}-{time.strftime('%Y%m%d-%H%M%S')}"
        for n in itertools.count(1):
            path = self.root / (base if n == 1 else f"{base}-{n}")
            try:
                path.mkdir()
                return path
            except FileExistsError:
                continue


def _created(run_dir: Path) -> tuple[str, int]:
    """Sort key: the timestamp (and ``-N`` suffix) in the run's name, else its config's modification time."""
    match = RUN_STAMP.search(run_dir.name)
    if match:
        return match.group(1), int((match.group(2) or "-1")[1:])
    modified = RunDirectory(run_dir).config_file.stat().st_mtime
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(modified)), 0
