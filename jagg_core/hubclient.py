"""Talking to the Hugging Face Hub: connectivity, the token, downloads, and one-line errors.

Every module that reaches the Hub (model loading, rewards' models, LoRA downloads, the push in
:mod:`jagg_core.hub`) goes through here, so an offline machine, a gated or missing repo or a bad
token reads the same everywhere: one :class:`~jagg_core.errors.UserError` line saying what to do.
The token is only handed to ``huggingface_hub`` for its HTTP headers, never written or logged.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from .errors import UserError
from .rundir import LORA_FILE

TOKENS_URL = "https://huggingface.co/settings/tokens"


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set or the Hub's host does not resolve: then only the local
    cache is used, instead of retrying a connection that cannot succeed."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except OSError:
        return True
    return False


def resolve_token(token: str | None = None) -> str | None:
    """The token to use: ``token`` if given, else ``HF_TOKEN``, else the one stored by ``hf auth login``."""
    from huggingface_hub import get_token

    return token or os.environ.get("HF_TOKEN") or get_token()


@contextmanager
def hub_errors(what: str, repo_id: str | None = None, denied: str = "your token has no access to it",
               filename: str = LORA_FILE) -> Iterator[None]:
    """Turn the Hub client's failures during ``what`` into one-line UserErrors.

    ``repo_id`` names the repo in the offline advice (``hf download REPO``) and the page where a gated repo's
    licence is accepted; ``denied`` explains an HTTP 403; ``filename`` is the file a "no such file in the repo"
    answer is about.
    """
    from huggingface_hub import constants
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RemoteEntryNotFoundError, RepositoryNotFoundError)
    try:  # the HTTP client huggingface_hub uses: httpx2 from huggingface_hub 2.x, httpx before
        from httpx2 import TransportError
    except ImportError:
        from httpx import TransportError

    offline_advice = f"run `hf download {repo_id}` while online" if repo_id else "use a local folder"
    try:
        yield
    except OfflineModeIsEnabled:
        raise UserError(f"cannot {what}: Hugging Face offline mode is on; unset HF_HUB_OFFLINE and retry") from None
    except (TransportError, ConnectionError):
        raise UserError(f"cannot {what}: the Hugging Face Hub is unreachable; check your connection "
                        "and retry") from None
    except LocalEntryNotFoundError:
        raise UserError(f"cannot {what}: the Hub is unreachable and it is not in the local cache; check your "
                        f"connection, or {offline_advice}") from None
    except GatedRepoError:
        page = f"at {constants.ENDPOINT}/{repo_id}" if repo_id else "on the Hub"
        raise UserError(f"cannot {what}: the repo is gated; accept its licence {page}, then `hf auth login` (or set "
                        "HF_TOKEN) with a token of that account") from None
    except RepositoryNotFoundError:
        raise UserError(f"cannot {what}: no such Hub repo, or it is private; check the name, or use a token "
                        "that can read it (`hf auth login`)") from None
    except RemoteEntryNotFoundError:
        raise UserError(f"cannot {what}: the repo has no {filename}") from None
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        if status == 401:
            raise UserError(f"cannot {what}: the token is invalid or expired; "
                            f"create a new one at {TOKENS_URL}") from None
        if status == 403:
            raise UserError(f"cannot {what}: {denied}") from None
        raise UserError(f"cannot {what}: the Hub answered HTTP {status}; retry later") from None


@contextmanager
def hub_model(model_id: str) -> Iterator[None]:
    """Around a ``from_pretrained`` of ``model_id``: the Hub's failures as above, and the ``OSError`` that
    transformers and diffusers raise for a model that is neither cached nor reachable, as one line."""
    with hub_errors(f"load '{model_id}'", repo_id=model_id):
        try:
            yield
        except OSError as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(f"cannot load '{model_id}' ({reason[:200]}); it must be in the local Hugging Face "
                            f"cache or the Hub must be reachable: run `hf download {model_id}` while online") from None


def download(repo_id: str, filename: str, what: str, *, revision: str | None = None,
             token: str | None = None) -> Path:
    """``hf_hub_download`` of one file (from the cache alone when the Hub is offline), errors as one line."""
    from huggingface_hub import hf_hub_download

    with hub_errors(what, repo_id=repo_id, filename=filename):
        return Path(hf_hub_download(repo_id, filename, revision=revision, token=resolve_token(token),
                                    local_files_only=hub_offline()))


def is_repo_id(name: str) -> bool:
    """Whether ``name`` is a valid Hub repo id (``OWNER/NAME``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return "/" in name


def resolve_lora(source: str, token: str | None = None, files: Sequence[str] = (LORA_FILE,)) -> Path:
    """The local path of the diffusers LoRA named by ``source``: a local folder (or file), or a Hub repo id; the
    path of its first file when it has several (``files``: an adapter of both experts of a two-expert model,
    :func:`~jagg_core.rundir.adapter_filenames`; the model finds the others beside it).

    Hub LoRAs are downloaded (``files``) into the Hugging Face cache, one folder for all of them, which also serves
    them when offline once downloaded.
    """
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if not (path / files[0]).is_file():
            raise UserError(f"LoRA folder {source} has no {files[0]} (save it with save_lora_weights)")
        return path / files[0]
    if not is_repo_id(source):
        raise UserError(f"LoRA '{source}' is neither a local folder nor a Hub repo id (USER/NAME)")
    return [download(source, name, f"download the LoRA {source}", token=token) for name in files][0]
