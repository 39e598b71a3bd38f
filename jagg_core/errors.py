"""User-facing errors.

Anything a user can fix (a wrong preset key, an unknown model, a missing token, a reward server
that is down) raises :class:`UserError` with a one-line message that says what is wrong and how
to fix it. Command-line entry points print that line and exit with code 2, without a traceback.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from contextlib import contextmanager
from pathlib import Path


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


def made_folder(folder: Path) -> Path:
    """``folder``, made with its parents as needed; one that cannot be made is a :class:`UserError` saying why."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot write the folder {folder}: {err.strerror}") from None
    return folder


def require_packages(packages: tuple[str, ...], needed_by: str) -> None:
    """The ``packages`` that ``needed_by`` needs beyond requirements.txt (a family's or a reward's ``requires``) are
    installed, else one line naming the missing ones and the ``pip install`` that adds them."""
    if missing := [package for package in packages if importlib.util.find_spec(package) is None]:
        raise UserError(f"{needed_by} needs {', '.join(missing)}, which is not installed: pip install "
                        f"{' '.join(missing)} (the build that matches your torch)")


#: what torch appends to many of its errors, left out of the one-line messages
TORCH_BOILERPLATE = re.compile(r"\s*\(Could this error message be improved\?.*?\)")


def without_torch_boilerplate(text: str) -> str:
    """``text`` less :data:`TORCH_BOILERPLATE`."""
    return TORCH_BOILERPLATE.sub("", text)


#: what a failing cuDNN kernel or CUDA context says (the FLUX.1-dev crash with cuDNN attention on, docs/gpu)
CUDA_FAILURE_WORDS = ("mha_graph", "cuDNN", "CUDNN", "CUDA error", "CUBLAS_STATUS")


def fixable_gpu_failure(err: BaseException, run_dir: Path, cudnn_attention: bool) -> str | None:
    """The one line for a failure of a run on a GPU that its config can fix, or None (not one of them):

    - out of GPU memory (``torch.OutOfMemoryError``): torch's first sentences (what it tried to allocate, what the
      GPU had free), then where the memory plan names the cheapest change that fits, and how to resume with it;
    - a cuDNN or CUDA kernel error with ``model.cudnn_attention`` on: cuDNN's attention made FLUX.1-dev's backward
      fail on an H200 (the GPU check's triage), and the default turns it off; a resume with it off continues the
      run.
    """
    resume = f"python -m jagg_core.run --resume --output-dir {run_dir}"
    if type(err).__name__ == "OutOfMemoryError" or "CUDA out of memory" in str(err):
        said = ". ".join(str(err).split(". ")[:3]).rstrip(".")
        return (f"out of GPU memory ({said}); `{resume} --plan` shows the run's planned peak against this GPU and "
                f"the cheapest change that fits; resume with `{resume} --set KEY=VALUE` for that change")
    if cudnn_attention and isinstance(err, RuntimeError) and any(word in str(err) for word in CUDA_FAILURE_WORDS):
        said = without_torch_boilerplate(str(err).splitlines()[0])[:160] if str(err) else type(err).__name__
        return (f"a GPU kernel failed with cuDNN attention on ({said}); model.cudnn_attention: true made FLUX.1-dev's "
                f"backward fail on an H200, and its default is false: resume with `{resume} --set "
                "model.cudnn_attention=false`")
    return None
