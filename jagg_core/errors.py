"""User-facing errors.

Anything a user can fix (a wrong preset key, an unknown model, a missing token, a reward server
that is down) raises :class:`UserError` with a one-line message that says what is wrong and how
to fix it. Command-line entry points print that line and exit with code 2, without a traceback.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager


class UserError(Exception):
    """An error caused by the user's input or environment; its message is shown as is."""


@contextmanager
def exit_on_user_error(prog: str):
    """Turn a :class:`UserError` raised inside the block into ``prog: error: ...`` and exit 2."""
    try:
        yield
    except UserError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
