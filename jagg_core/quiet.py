"""Silence the libraries' import-time chatter so a user sees our lines, not theirs."""

from __future__ import annotations

import logging
import os
import warnings


def quiet_libraries() -> None:
    """Errors only from the libraries' loggers, and no loading progress bars."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in ("bitsandbytes", "torchao", "transformers", "diffusers", "huggingface_hub", "accelerate", "peft",
                 "torch.utils._pytree"):  # torchao's import-time enum registration notices
        logging.getLogger(name).setLevel(logging.ERROR)
    import diffusers.utils.logging
    import transformers.utils.logging
    diffusers.utils.logging.disable_progress_bar()  # "Loading pipeline components"
    transformers.utils.logging.disable_progress_bar()  # "Loading weights"
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*torchvision.*")
