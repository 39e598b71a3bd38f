"""The queue of runs waiting for the machine: ``RUNS_ROOT/.queue.json``, the names of run folders of the runs root in
the order they start.

A queued run is a run directory whose config is written and checked, with status ``queued``; the app starts the
first one whenever no run trains (:meth:`app.jobs.JobControl.start_next_queued`), so the queue survives an app
restart. The page adds to it (Start while a run trains), removes from it and moves runs in it; the CLI adds to it
(``python -m jagg_core.run --preset P --queue``). Every change holds an exclusive lock on the queue file and
replaces it atomically, so the page and the CLI can change it at the same time. This module imports no
deep-learning library.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import UserError
from .rundir import RunDirectory, atomic_write_text

QUEUE_NAME = ".queue.json"
QUEUE_LOCK = ".queue.lock"
QUEUED = "queued"


class RunQueue:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.file = self.root / QUEUE_NAME

    def names(self) -> list[str]:
        """The queued runs, first to start first (names whose folder is gone are left out)."""
        return [name for name in self._read() if (self.root / name).is_dir()]

    def position(self, name: str) -> int | None:
        """1 for the next run to start; None when ``name`` is not queued."""
        names = self.names()
        return names.index(name) + 1 if name in names else None

    def add(self, run_dir: Path) -> int:
        """Queue the run of ``run_dir`` (a folder of the root whose config is written); its position."""
        run_dir = Path(run_dir)
        if run_dir.resolve().parent != self.root.resolve() or not RunDirectory(run_dir).is_run():
            raise UserError(f"{run_dir} is not a run folder of {self.root}; queue runs of the runs root only")
        with self._changing() as names:
            if run_dir.name not in names:
                names.append(run_dir.name)
            position = names.index(run_dir.name) + 1
        RunDirectory(run_dir).write_status(QUEUED, message=f"queued: position {position}")
        return position

    def remove(self, name: str) -> None:
        """Take ``name`` out of the queue; its run directory stays (status ``stopped``: it can be resumed)."""
        with self._changing() as names:
            if name not in names:
                raise UserError(f"{name} is not queued")
            names.remove(name)
        run = RunDirectory(self.root / name)
        if run.read_status().get("state") == QUEUED:
            run.write_status("stopped", message="taken out of the queue; Resume starts it")

    def move(self, name: str, offset: int) -> int:
        """Move ``name`` ``offset`` places (negative: sooner); its new position."""
        with self._changing() as names:
            if name not in names:
                raise UserError(f"{name} is not queued")
            index = max(0, min(len(names) - 1, names.index(name) + offset))
            names.remove(name)
            names.insert(index, name)
        return index + 1

    def next(self) -> Path | None:
        """The folder of the first queued run, or None when the queue is empty."""
        names = [name for name in self.names() if RunDirectory(self.root / name).is_run()]
        return self.root / names[0] if names else None

    def started(self, name: str) -> None:
        """Take ``name`` out of the queue once its job is launched (its status is the trainer's from then on)."""
        with self._changing() as names:
            if name in names:
                names.remove(name)

    def _read(self) -> list[str]:
        try:
            names = json.loads(self.file.read_text())
        except (OSError, ValueError):
            return []
        return [n for n in names if isinstance(n, str) and "/" not in n] if isinstance(names, list) else []

    @contextmanager
    def _changing(self) -> Iterator[list[str]]:
        """The queue's names to change in place, under the queue's lock; written back atomically."""
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / QUEUE_LOCK).open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            names = self.names()
            yield names
            atomic_write_text(self.file, json.dumps(names))
            fcntl.flock(lock, fcntl.LOCK_UN)


RUNS_DIR_ENV = "JAGG_RUNS_DIR"


def runs_dir() -> Path:
    """The folder that holds the runs, as given: ``$JAGG_RUNS_DIR``, default ``runs``."""
    return Path(os.environ.get(RUNS_DIR_ENV, "runs")).expanduser()


def runs_root() -> Path:
    """:func:`runs_dir`, absolute, created if missing."""
    root = runs_dir().resolve()
    root.mkdir(parents=True, exist_ok=True)
    return root
