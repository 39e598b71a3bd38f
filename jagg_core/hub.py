"""Publish a run's LoRA to the Hugging Face Hub, and fetch a LoRA from it.

    python -m jagg_core.hub push RUN --repo-id USER/NAME [--private] [--checkpoint iter_N]
    python -m jagg_core.hub card RUN --repo-id USER/NAME [--checkpoint iter_N]   # print the model card

A push creates the repo if needed and uploads, in one commit, the adapter, the model card, the eval samples, the
reward curve, the before/after grid and the config without secrets (see :mod:`jagg_core.model_card`). It only
reads the run directory, so a failed push changes nothing locally and can simply be retried.

The token is the one passed in (the app's field), else ``HF_TOKEN``, else the one stored by ``hf auth login``.
It is only handed to ``huggingface_hub`` for the HTTP headers: never written, logged, or put in an uploaded file
(a push that would upload it is refused). Hub failures become one-line :class:`UserError` messages that say what
to do.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from huggingface_hub import CommitOperationAdd, constants, HfApi, ModelCard, get_token, hf_hub_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
)
from huggingface_hub.utils import validate_repo_id

from .config import RunConfig
from .errors import UserError, exit_on_user_error
from .model_card import ADAPTER_FILE, build_model_card, publish_files, read_run

try:  # the HTTP client huggingface_hub uses: httpx2 from huggingface_hub 2.x, httpx before
    from httpx2 import TransportError
except ImportError:
    from httpx import TransportError

TOKENS_URL = "https://huggingface.co/settings/tokens"
PROG = "jagg_core.hub"


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set or the Hub's host does not resolve: then only the local
    cache is used, instead of retrying a connection that cannot succeed."""
    if constants.HF_HUB_OFFLINE:
        return True
    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname, 443)
    except OSError:
        return True
    return False


def resolve_token(token: str | None = None) -> str | None:
    """The token to use: ``token`` if given, else ``HF_TOKEN``, else the one stored by ``hf auth login``."""
    return token or os.environ.get("HF_TOKEN") or get_token()


@contextmanager
def _hub_errors(what: str, denied: str = "your token has no access to it") -> Iterator[None]:
    """Turn the Hub client's failures during ``what`` into one-line UserErrors; ``denied`` explains a 403."""
    try:
        yield
    except OfflineModeIsEnabled:
        raise UserError(f"cannot {what}: Hugging Face offline mode is on; unset HF_HUB_OFFLINE and retry") from None
    except (TransportError, ConnectionError):
        raise UserError(f"cannot {what}: the Hugging Face Hub is unreachable; check your connection "
                        "and retry") from None
    except LocalEntryNotFoundError:
        raise UserError(f"cannot {what}: the Hub is unreachable and it is not in the local cache; check your "
                        "connection or use a local folder") from None
    except GatedRepoError:
        raise UserError(f"cannot {what}: the repo is gated; accept its terms on the Hub and retry") from None
    except RepositoryNotFoundError:
        raise UserError(f"cannot {what}: no such Hub repo, or it is private; check the name, or use a token "
                        "that can read it") from None
    except RemoteEntryNotFoundError:
        raise UserError(f"cannot {what}: the repo has no {ADAPTER_FILE} (is it a diffusers LoRA?)") from None
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        if status == 401:
            raise UserError(f"cannot {what}: the token is invalid or expired; "
                            f"create a new one at {TOKENS_URL}") from None
        if status == 403:
            raise UserError(f"cannot {what}: {denied}") from None
        raise UserError(f"cannot {what}: the Hub answered HTTP {status}; retry later") from None


def _whoami(api: HfApi) -> dict:
    """The token's user, after checking that the token is valid and allowed to write."""
    with _hub_errors("sign in to the Hugging Face Hub"):
        me = api.whoami()
    if me.get("auth", {}).get("accessToken", {}).get("role") == "read":
        raise UserError(f"the Hugging Face token is read-only; create a token with write access at {TOKENS_URL}")
    return me


def _token_in(operation: CommitOperationAdd, needle: bytes, chunk_size: int = 1 << 20) -> bool:
    """Whether ``needle`` occurs anywhere in the file of ``operation`` (read in chunks)."""
    tail = b""
    with operation.as_file() as file:
        while chunk := file.read(chunk_size):
            if needle in tail + chunk:
                return True
            tail = chunk[-(len(needle) - 1):] if len(needle) > 1 else b""
    return False


def write_model_card(run_dir: str | Path, repo_id: str, checkpoint: str | None = None) -> ModelCard:
    """The model card a push of ``run_dir`` (latest adapter, or ``checkpoint``) to ``repo_id`` would upload."""
    return build_model_card(read_run(run_dir, checkpoint), repo_id)


def push_run(run_dir: str | Path, repo_id: str, *, private: bool = False, checkpoint: str | None = None,
             token: str | None = None) -> str:
    """Upload a run's adapter and model card to ``repo_id`` in one commit; return the repo URL.

    ``repo_id`` is ``USER/NAME`` or ``ORG/NAME`` (a bare ``NAME`` goes under the token's user). ``private`` only
    applies when the repo is created. ``checkpoint`` (``iter_N``) publishes that checkpoint instead of the latest
    adapter. Raises :class:`UserError` for anything the user can fix.
    """
    token = resolve_token(token)
    if not token:
        raise UserError("no Hugging Face token: set HF_TOKEN, run `hf auth login`, or enter a token "
                        f"with write access (create one at {TOKENS_URL})")
    snap = read_run(run_dir, checkpoint)
    api = HfApi(token=token)
    me = _whoami(api)
    if "/" not in repo_id:
        repo_id = f"{me['name']}/{repo_id}"
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise UserError(f"'{repo_id}' is not a valid Hub repo id; use USER/NAME with letters, digits, '-', '_', "
                        "'.'") from None

    operations = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=content)
                  for path, content in publish_files(snap, repo_id).items()]
    for operation in operations:
        if _token_in(operation, token.encode()):
            raise UserError(f"refusing to push: the Hugging Face token appears in {operation.path_in_repo}; "
                            "remove it from the run and retry")

    denied = (f"user '{me['name']}' cannot write to it; push to {me['name']}/{repo_id.split('/')[1]} or to an "
              "organization where you have write access")
    with _hub_errors(f"push to {repo_id}", denied):
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        label = snap.checkpoint or "latest adapter"
        at = f", iteration {snap.iteration}" if snap.iteration is not None else ""
        api.create_commit(repo_id, operations, commit_message=f"JAGG Studio: {label}{at}")
    return str(url)


def push_if_configured(run_dir: str | Path, config: RunConfig, token: str | None = None) -> str | None:
    """Push at the end of a run when ``config.hub.push`` is set; return the repo URL, or None if not configured."""
    if not config.hub.push:
        return None
    return push_run(run_dir, config.hub.repo_id, private=config.hub.private, token=token)


def resolve_lora(source: str, token: str | None = None) -> Path:
    """The local path of the diffusers LoRA named by ``source``: a local folder (or file), or a Hub repo id.

    Hub LoRAs are downloaded (``pytorch_lora_weights.safetensors``) into the Hugging Face cache, which also
    serves them when offline once downloaded.
    """
    path = Path(source).expanduser()
    if path.is_file():
        return path
    if path.is_dir():
        if not (path / ADAPTER_FILE).is_file():
            raise UserError(f"LoRA folder {source} has no {ADAPTER_FILE} (save it with save_lora_weights)")
        return path / ADAPTER_FILE
    try:
        validate_repo_id(source)
    except HFValidationError:
        raise UserError(f"LoRA '{source}' is neither a local folder nor a Hub repo id (USER/NAME)") from None
    with _hub_errors(f"download the LoRA {source}"):
        return Path(hf_hub_download(source, ADAPTER_FILE, token=resolve_token(token), local_files_only=hub_offline()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in [("push", "upload a run's LoRA and model card to the Hub"),
                            ("card", "print the model card a push would upload")]:
        command = commands.add_parser(name, help=help_text)
        command.add_argument("run_dir", metavar="RUN", help="run directory")
        command.add_argument("--repo-id", required=True, help="USER/NAME or ORG/NAME")
        command.add_argument("--checkpoint", help="publish this checkpoint (iter_N) instead of the latest adapter")
        if name == "push":
            command.add_argument("--private", action="store_true", help="create the repo as private")
    args = parser.parse_args(argv)
    with exit_on_user_error(PROG):
        if args.command == "push":
            print(push_run(args.run_dir, args.repo_id, private=args.private, checkpoint=args.checkpoint))
        else:
            print(write_model_card(args.run_dir, args.repo_id, args.checkpoint))


if __name__ == "__main__":
    main()
