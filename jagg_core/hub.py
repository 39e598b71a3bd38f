"""Publish a run's LoRA to the Hugging Face Hub.

    python -m jagg_core.hub push RUN --repo-id USER/NAME [--private] [--checkpoint best|iter_N] [--evaluation DIR]
    python -m jagg_core.hub card RUN --repo-id USER/NAME [--checkpoint best|iter_N] [--evaluation DIR]   # print it

A push creates the repo if needed and uploads, in one commit, the adapter, the model card, the eval samples, the
reward curve, the before/after grid and the config without secrets (see :mod:`jagg_core.model_card`). The adapter
is the latest by default; ``--checkpoint best`` pushes the best one (``RUN/best``: the best eval by
``eval.best_by``, its card saying which iteration and why), ``--checkpoint iter_N`` a checkpoint's
(:mod:`jagg_core.adapters`). ``--evaluation DIR`` adds an evaluation of that adapter (``python -m jagg_core.evaluate
RUN --out DIR``) to the card, its tables and its first samples. It only reads the run directory, so a failed push
changes nothing locally and can simply be retried.

The token is the one passed in (the app's field), else ``HF_TOKEN``, else the one stored by ``hf auth login``.
It is only handed to ``huggingface_hub`` for the HTTP headers: never written, logged, or put in an uploaded file
(a push that would upload it is refused). Hub failures become one-line :class:`UserError` messages that say what
to do (:mod:`jagg_core.hubclient`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard

from .config import RunConfig
from .errors import UserError, exit_on_user_error
from .hubclient import TOKENS_URL, hub_errors, is_repo_id, resolve_token
from .model_card import build_model_card, publish_files, read_run

PROG = "jagg_core.hub"


def _whoami(api: HfApi) -> dict:
    """The token's user, after checking that the token is valid and allowed to write."""
    with hub_errors("sign in to the Hugging Face Hub"):
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


def write_model_card(run_dir: str | Path, repo_id: str, checkpoint: str | None = None,
                     evaluation: str | Path | None = None) -> ModelCard:
    """The model card a push of ``run_dir`` (latest adapter, or ``checkpoint``: ``best`` or ``iter_N``; with the
    ``evaluation`` folder of that adapter) to ``repo_id`` would upload."""
    return build_model_card(read_run(run_dir, checkpoint, evaluation), repo_id)


def push_files(run_dir: str | Path, repo_id: str, checkpoint: str | None = None,
               evaluation: str | Path | None = None) -> dict[str, bytes | Path]:
    """The files a push of ``run_dir`` (as :func:`write_model_card`) to ``repo_id`` would upload: path in the repo ->
    bytes (``README.md`` the model card, its images) or a local file (the adapter's, the samples)."""
    return publish_files(read_run(run_dir, checkpoint, evaluation), repo_id)


def push_run(run_dir: str | Path, repo_id: str, *, private: bool = False, checkpoint: str | None = None,
             token: str | None = None, evaluation: str | Path | None = None) -> str:
    """Upload a run's adapter and model card to ``repo_id`` in one commit; return the repo URL.

    ``repo_id`` is ``USER/NAME`` or ``ORG/NAME`` (a bare ``NAME`` goes under the token's user). ``private`` only
    applies when the repo is created. ``checkpoint`` publishes the best adapter (``best``) or a checkpoint's
    (``iter_N``) instead of the latest; ``evaluation``, its evaluation's folder, adds that to the card. Raises
    :class:`UserError` for anything the user can fix.
    """
    snap = read_run(run_dir, checkpoint, evaluation)  # what the user can fix first: the adapter, then the id
    if not repo_id:
        raise UserError("enter a repo id, e.g. your-name/my-lora")
    if not is_repo_id(repo_id if "/" in repo_id else f"user/{repo_id}"):
        raise UserError(f"'{repo_id}' is not a valid Hub repo id; use USER/NAME with letters, digits, '-', '_', "
                        "'.'")
    token = resolve_token(token)
    if not token:
        raise UserError("no Hugging Face token: set HF_TOKEN, run `hf auth login`, or enter a token "
                        f"with write access (create one at {TOKENS_URL})")
    api = HfApi(token=token)
    me = _whoami(api)
    if "/" not in repo_id:
        repo_id = f"{me['name']}/{repo_id}"

    operations = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=content)
                  for path, content in publish_files(snap, repo_id).items()]
    for operation in operations:
        if _token_in(operation, token.encode()):
            raise UserError(f"refusing to push: the Hugging Face token appears in {operation.path_in_repo}; "
                            "remove it from the run and retry")

    denied = (f"user '{me['name']}' cannot write to it; push to {me['name']}/{repo_id.split('/')[1]} or to an "
              "organization where you have write access")
    with hub_errors(f"push to {repo_id}", denied=denied):
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        at = f", iteration {snap.iteration}" if snap.iteration is not None else ""
        api.create_commit(repo_id, operations, commit_message=f"JAGG Studio: {snap.adapter.label}{at}")
    return str(url)


def push_if_configured(run_dir: str | Path, config: RunConfig, token: str | None = None) -> str | None:
    """Push at the end of a run when ``config.hub.push`` is set; return the repo URL, or None if not configured."""
    if not config.hub.push:
        return None
    return push_run(run_dir, config.hub.repo_id, private=config.hub.private, token=token)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in [("push", "upload a run's LoRA and model card to the Hub"),
                            ("card", "print the model card a push would upload")]:
        command = commands.add_parser(name, help=help_text)
        command.add_argument("run_dir", metavar="RUN", help="run directory")
        command.add_argument("--repo-id", required=True, help="USER/NAME or ORG/NAME")
        command.add_argument("--checkpoint", metavar="best|iter_N",
                             help="publish the best adapter (best: RUN/best, the best eval by eval.best_by) or a "
                                  "checkpoint's (iter_N) instead of the latest adapter")
        command.add_argument("--evaluation", metavar="DIR",
                             help="add this evaluation of the adapter to the card (python -m jagg_core.evaluate's "
                                  "--out folder)")
        if name == "push":
            command.add_argument("--private", action="store_true", help="create the repo as private")
    args = parser.parse_args(argv)
    with exit_on_user_error(PROG):
        if args.command == "push":
            print(push_run(args.run_dir, args.repo_id, private=args.private, checkpoint=args.checkpoint,
                           evaluation=args.evaluation))
        else:
            print(write_model_card(args.run_dir, args.repo_id, args.checkpoint, args.evaluation))


if __name__ == "__main__":
    main()
