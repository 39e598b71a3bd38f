"""``python -m jagg_core.bench``: see :mod:`jagg_core.bench`."""

from .cli import main

main()
