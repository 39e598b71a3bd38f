"""Which adapter of a run a push, a model card, a download or a try-it uses: the latest, the best, or a checkpoint's.

    latest       RUN/lora/             the adapter of the last checkpoint (the default)
    best         RUN/best/             the adapter of the best eval so far by ``eval.best_by``, with best.json's record
    iter_N       RUN/checkpoints/iter_N/

:func:`choose_adapter` is the one resolution of these names, for :mod:`jagg_core.hub` (and its model card),
:mod:`jagg_core.generate` and the page. Like :mod:`jagg_core.rundir` it imports no deep-learning library.
"""

from __future__ import annotations

import hashlib

from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError
from .rundir import RunDirectory, adapter_files, iteration_dirname

BEST = "best"
LATEST_LABEL = "latest adapter"


@dataclass(frozen=True)
class Adapter:
    """One adapter of a run. ``choice`` is None for the latest, :data:`BEST`, or a checkpoint's ``iter_NNNNNN``;
    ``iteration`` is the best's or the checkpoint's (None for the latest: the run's last metrics row says it);
    ``record`` is best.json's ``{"iteration", "metric", "label", "value", "reason"}`` for the best."""

    file: Path
    choice: str | None
    iteration: int | None
    record: dict = field(default_factory=dict)

    @property
    def files(self) -> list[Path]:
        """The adapter's files: :attr:`file`, and the low-noise expert's beside it when the run trained both experts
        of a two-expert model (:func:`~jagg_core.rundir.adapter_files`)."""
        return adapter_files(self.file)

    def digest(self) -> str:
        """The SHA-256 of the adapter's files one after the other (of one file: that file's), hex: which weights an
        evaluation of it scored."""
        digest = hashlib.sha256()
        for file in self.files:
            with file.open("rb") as weights:
                for chunk in iter(lambda: weights.read(1 << 20), b""):
                    digest.update(chunk)
        return digest.hexdigest()

    @property
    def label(self) -> str:
        """``latest adapter``, ``best adapter`` or ``iter_000120``."""
        if self.choice is None:
            return LATEST_LABEL
        return "best adapter" if self.choice == BEST else self.choice


def choose_adapter(run_dir: str | Path, checkpoint: str | None = None) -> Adapter:
    """The adapter named ``checkpoint``: None (or "") for the latest, ``best``, or ``iter_N``; a one-line
    :class:`UserError` when the run has none of that kind yet."""
    run = RunDirectory(run_dir)
    if not checkpoint:
        if not run.lora_file.is_file():
            raise UserError(f"{run.path} has no adapter yet ({run.lora_file} is missing): wait for the first "
                            "checkpoint")
        return Adapter(run.lora_file, None, None)
    if checkpoint == BEST:
        record = run.read_best()
        if not record:
            raise UserError(f"{run.path} has no best adapter yet: it is written at the first eval after training "
                            "starts")
        return Adapter(run.best_lora_file, BEST, int(record["iteration"]), record)
    iteration, file = run.checkpoint_adapter(checkpoint)
    return Adapter(file, iteration_dirname(iteration), iteration)


def best_words(record: dict) -> str:
    """best.json's record in a few words: ``iteration 40, judge shapes_fidelity 0.912``."""
    return f"iteration {record['iteration']}, {record['label']} {record['value']:.3f}"
