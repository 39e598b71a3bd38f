"""Stopping a run on SIGTERM/SIGINT without losing anything.

:func:`install_stop_handlers` makes both signals raise :class:`StopRequested` in the main thread,
wherever the process is (loading a model, sampling the base eval). Inside :meth:`StopHandler.deferred`
(one training iteration with its bookkeeping) the first signal is only recorded: the trainer finishes
the iteration, writes a checkpoint and then stops, so a stopped run resumes exactly where it stopped.
A second signal while deferred raises at once. The exit code is ``128 + signal number`` (130 for
Ctrl-C, 143 for SIGTERM).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager


class StopRequested(Exception):
    """SIGTERM/SIGINT: stop after leaving the run directory consistent."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class AlarmStop(Exception):
    """The reward-hacking alarm ended the run (``train.on_hacking: stop``); the message is the alarm's line."""

    exit_code = 3


class StopHandler:
    def __init__(self):
        self.requested: int | None = None   # the signal received while deferred
        self._deferring = False

    def __call__(self, signum, frame) -> None:
        if self._deferring and self.requested is None:
            self.requested = signum
            return
        raise StopRequested(signum)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """Within the block the first stop signal is recorded in :attr:`requested` instead of raised."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False


STOP = StopHandler()


def install_stop_handlers() -> StopHandler:
    """SIGTERM/SIGINT go to :data:`STOP` (raise :class:`StopRequested`, or wait for the end of the iteration)."""
    STOP.requested = None
    signal.signal(signal.SIGTERM, STOP)
    signal.signal(signal.SIGINT, STOP)
    return STOP
