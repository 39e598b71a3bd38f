"""Silence the libraries' import-time chatter so a user sees our lines, not theirs; our progress lines go to
stderr at once."""

from __future__ import annotations

import logging
import os
import sys
import warnings


#: the libraries' settings, read as they import, for errors only and no progress bars (a user's own value stays)
QUIET_SETTINGS = {"TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error",
                  "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def quiet_environment() -> None:
    """:data:`QUIET_SETTINGS` in this process's environment, a value already set kept."""
    for key, value in QUIET_SETTINGS.items():
        os.environ.setdefault(key, value)


def quiet_libraries() -> None:
    """Errors only from the libraries' loggers, and no loading progress bars."""
    quiet_environment()
    for name in ("bitsandbytes", "torchao", "transformers", "diffusers", "huggingface_hub", "accelerate", "peft",
                 "torch.utils._pytree"):  # torchao's import-time enum registration notices
        logging.getLogger(name).setLevel(logging.ERROR)
    import diffusers.utils.logging
    import transformers.utils.logging
    diffusers.utils.logging.disable_progress_bar()  # "Loading pipeline components"
    transformers.utils.logging.disable_progress_bar()  # "Loading weights"
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*torchvision.*")


def log_to_stderr(line: str) -> None:
    """One of our progress lines on stderr, flushed at once (the bench's phases, the GPU check's order and steps:
    a step's log keeps them in order with the libraries' output)."""
    print(line, file=sys.stderr, flush=True)
