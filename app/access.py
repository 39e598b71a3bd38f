"""Who may control jobs on this page.

Locally (no ``SPACE_ID`` in the environment) everyone who can open the page may. On a Hugging Face
Space only the signed-in Space owner (``SPACE_AUTHOR_NAME``, else the namespace of ``SPACE_ID``) and
the users listed in ``JAGG_ALLOWED_USERS`` (comma-separated) may start, stop, resume, push or delete runs and
generate with an adapter; everyone else, signed in or not, can watch. The signed-in user comes from Gradio's OAuth session
(``hf_oauth: true`` in the README's Space metadata).
"""

from __future__ import annotations

import os

ALLOWED_USERS_ENV = "JAGG_ALLOWED_USERS"


def controllers() -> set[str] | None:
    """The user names allowed to control jobs, or None where everyone is (not on a Space)."""
    space = os.environ.get("SPACE_ID")
    if not space:
        return None
    owner = os.environ.get("SPACE_AUTHOR_NAME") or space.split("/")[0]
    listed = {name.strip() for name in os.environ.get(ALLOWED_USERS_ENV, "").split(",") if name.strip()}
    return {owner, *listed}


def refusal(username: str | None) -> str | None:
    """Why ``username`` (None: not signed in) may not control jobs here, or None if they may."""
    allowed = controllers()
    if allowed is None or username in allowed:
        return None
    who = f"you are signed in as {username}" if username else "you are not signed in"
    return (f"only the Space's owner and the users in {ALLOWED_USERS_ENV} can start, stop, resume, push, "
            f"delete or generate ({who}); anyone can watch")
