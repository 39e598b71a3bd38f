"""A small in-process fake of the Hugging Face Hub HTTP API, for tests.

It implements only what ``huggingface_hub`` calls to push a commit and download a file:

    GET  /api/whoami-v2                               who owns the token
    GET  /api/agent-harnesses                         the client's user-agent registry (empty)
    POST /api/repos/create                            create a model repo (409 if it exists)
    GET  /api/models/{owner}/{name}[/revision/{rev}]  repo info (create_repo(exist_ok=True) after a 403); with
                                                      ?blobs=true each file's size, blobId and LFS sha256
    POST /api/validate-yaml                           model card metadata rules (see validate_card_metadata)
    POST /api/models/{owner}/{name}/preupload/{rev}   answers "regular" for every file: no LFS/Xet path
    POST /api/models/{owner}/{name}/commit/{rev}      NDJSON commit with inline base64 files
    HEAD|GET /{owner}/{name}/resolve/{rev}/{path}     file download; a GET honours ``Range: bytes=START-[END]``
                                                      (206)

Tokens map to users (``FakeHub.add_token``); a token may be read-only. Like the real Hub, an unknown token gets
401, writing to a namespace that is not the user's (or one of their orgs) gets 403, and a missing or private repo
of someone else gets 404 ``RepoNotFound``. A gated repo (``add_repo(..., gated=True, granted=USERS)``) lists its
files to anyone but serves them only to the users who accepted its licence: 401 ``GatedRepo`` without a token, 403
``GatedRepo`` with another user's. Every request body is kept in ``FakeHub.bodies`` so tests can check what was
sent, and requests to routes the fake lacks in ``FakeHub.unrouted``.

Files are stored as the Hub stores them: weights (:data:`LFS_ENDINGS`) in LFS, their ETag and blob the content's
sha256, the others in git, their ETag the git blob id. Each file GET is recorded in ``FakeHub.downloads`` (the
file, the Range asked, the bytes sent). Faults for download tests: ``drops[path] = Drop(at, then_unavailable)``
makes the next GET of ``path`` send the file up to byte ``at`` and close the connection (then answer 503 to the
file's GETs while ``path`` is in ``unavailable``); ``holds[path] = threading.Event()`` makes a GET of ``path`` send
its headers and wait for the event before the body.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

import yaml

# The repo-id and pipeline-tag rules the Hub applies to model card metadata (a subset: what our cards use).
REPO_ID = re.compile(r"^[\w.-]{1,96}/[\w.-]{1,96}$")
PIPELINE_TAGS = {"text-to-image", "image-to-image", "unconditional-image-generation", "text-generation"}
YAML_BLOCK = re.compile(r"^\s*---\r?\n([\s\S]*?)\r?\n---[ \t]*(\r?\n|$)")
#: files kept in LFS, as the Hub's default .gitattributes says
LFS_ENDINGS = (".safetensors", ".bin", ".ckpt", ".msgpack", ".onnx", ".pb", ".pt", ".pth")
RANGE = re.compile(r"bytes=(\d+)-(\d*)")


def validate_card_metadata(readme: str) -> list[str]:
    """Return the reasons the README's YAML metadata would be rejected by the Hub (empty if it is well formed)."""
    match = YAML_BLOCK.match(readme)
    if not match:
        return ["no YAML metadata block"]
    try:
        meta = yaml.safe_load(match.group(1))
    except yaml.YAMLError as err:
        return [f"invalid YAML: {err}"]
    if not isinstance(meta, dict):
        return ["metadata must be a mapping"]
    errors = []
    for key in ("library_name", "pipeline_tag", "license"):
        if key in meta and not isinstance(meta[key], str):
            errors.append(f"{key} must be a string")
    if "pipeline_tag" in meta and meta["pipeline_tag"] not in PIPELINE_TAGS:
        errors.append(f"unknown pipeline_tag {meta['pipeline_tag']!r}")
    tags = meta.get("tags", [])
    if not (isinstance(tags, list) and all(isinstance(t, str) and t for t in tags)):
        errors.append("tags must be a list of non-empty strings")
    base = meta.get("base_model", [])
    for repo in [base] if isinstance(base, str) else base:
        if not (isinstance(repo, str) and REPO_ID.match(repo)):
            errors.append(f"base_model {repo!r} is not a Hub repo id")
    for item in meta.get("widget", []):
        if not (isinstance(item, dict) and isinstance(item.get("text"), str)
                and isinstance(item.get("output"), dict) and isinstance(item["output"].get("url"), str)):
            errors.append(f"widget entry {item!r} needs text and output.url")
    return errors


@dataclass
class Repo:
    owner: str
    private: bool
    files: dict[str, bytes] = field(default_factory=dict)
    commits: list[str] = field(default_factory=list)
    gated: bool = False
    granted: set[str] = field(default_factory=set)  # users who accepted a gated repo's licence

    @property
    def sha(self) -> str:
        return hashlib.sha1("".join(self.commits).encode()).hexdigest()

    def blob(self, path: str) -> str:
        """The file's ETag: the sha256 of an LFS file, the git blob id of the others."""
        data = self.files[path]
        if path.endswith(LFS_ENDINGS):
            return hashlib.sha256(data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def sibling(self, path: str) -> dict:
        """The file's entry in the repo info with ?blobs=true."""
        data = self.files[path]
        if not path.endswith(LFS_ENDINGS):
            return {"rfilename": path, "size": len(data), "blobId": self.blob(path)}
        return {"rfilename": path, "size": len(data), "blobId": hashlib.sha1(path.encode()).hexdigest(),
                "lfs": {"size": len(data), "sha256": self.blob(path), "pointerSize": 134}}


@dataclass
class Drop:
    """Close the connection once the file is sent up to byte ``at``; then the file is unavailable if asked."""

    at: int
    then_unavailable: bool = False


@dataclass
class Download:
    """A file GET: the file, the Range header asked (None for all of it) and the bytes sent."""

    path: str
    range: str | None
    sent: int


@dataclass
class Token:
    user: str
    role: str = "write"
    orgs: tuple[str, ...] = ()


class FakeHub:
    """The server's state, and the server itself (``with FakeHub() as hub: ... hub.url``)."""

    def __init__(self):
        self.tokens: dict[str, Token] = {}
        self.repos: dict[str, Repo] = {}
        self.bodies: list[bytes] = []
        self.unrouted: list[str] = []  # requests the fake does not implement (tests assert there are none)
        self.downloads: list[Download] = []
        self.drops: dict[str, Drop] = {}
        self.unavailable: set[str] = set()
        self.holds: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def add_token(self, token: str, user: str, role: str = "write", orgs: tuple[str, ...] = ()) -> None:
        self.tokens[token] = Token(user, role, orgs)

    def add_repo(self, repo_id: str, files: dict[str, bytes] | None = None, private: bool = False,
                 gated: bool = False, granted: tuple[str, ...] = ()) -> Repo:
        repo = self.repos[repo_id] = Repo(repo_id.split("/")[0], private, dict(files or {}), ["initial"], gated,
                                          set(granted))
        return repo

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # --- access rules -------------------------------------------------------------------------------------------

    def can_write(self, token: Token | None, namespace: str) -> bool:
        return token is not None and token.role != "read" and namespace in (token.user, *token.orgs)

    def can_read(self, token: Token | None, repo: Repo) -> bool:
        return not repo.private or (token is not None and repo.owner in (token.user, *token.orgs))


class _Reply(Exception):
    """Raised by a route to answer with an error status."""

    def __init__(self, status: int, message: str, code: str | None = None):
        self.status, self.message, self.code = status, message, code


def _make_handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep test output quiet
            pass

        # --- plumbing -------------------------------------------------------------------------------------------

        def _body(self) -> bytes:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with hub.lock:
                hub.bodies.append(body)
            return body

        def _send(self, status: int, payload=b"", headers: dict | None = None, head: bool = False):
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, str(value))
            if not isinstance(payload, bytes):
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not head:
                self.wfile.write(data)

        def _token(self) -> Token | None:
            """The caller's token; 401 for a token the Hub does not know."""
            auth = self.headers.get("Authorization", "")
            if not auth.startswith("Bearer "):
                return None
            token = hub.tokens.get(auth.removeprefix("Bearer "))
            if token is None:
                raise _Reply(401, "Invalid credentials in Authorization header")
            return token

        def _repo(self, repo_id: str, token: Token | None) -> Repo:
            repo = hub.repos.get(repo_id)
            if repo is None or not hub.can_read(token, repo):
                raise _Reply(404, "Repository not found", "RepoNotFound")
            return repo

        def _dispatch(self, method: str):
            path, _, query = self.path.partition("?")
            self.query = parse_qs(query)
            body = self._body() if method == "POST" else b""
            try:
                token = self._token()
                for pattern, route_method, route in ROUTES:
                    match = re.fullmatch(pattern, path)
                    if match and route_method == method.replace("HEAD", "GET"):
                        return route(self, token, body, *match.groups(), head=method == "HEAD")
                hub.unrouted.append(f"{method} {path}")
                raise _Reply(404, f"no fake route for {method} {path}")
            except _Reply as reply:
                headers = {"X-Error-Message": reply.message}
                if reply.code:
                    headers["X-Error-Code"] = reply.code
                self._send(reply.status, {"error": reply.message}, headers, head=method == "HEAD")

        def do_GET(self):
            self._dispatch("GET")

        def do_HEAD(self):
            self._dispatch("HEAD")

        def do_POST(self):
            self._dispatch("POST")

        # --- routes ---------------------------------------------------------------------------------------------

        def whoami(self, token, body, head=False):
            if token is None:
                raise _Reply(401, "Invalid credentials in Authorization header")
            self._send(200, {
                "type": "user", "name": token.user, "orgs": [{"name": org} for org in token.orgs],
                "auth": {"type": "access_token", "accessToken": {"displayName": "test", "role": token.role}},
            })

        def agent_harnesses(self, token, body, head=False):
            self._send(200, {"standardEnvVars": [], "harnesses": {}})

        def create_repo(self, token, body, head=False):
            request = json.loads(body)
            namespace = request.get("organization") or (token.user if token else None)
            if not hub.can_write(token, namespace):
                raise _Reply(403, f"You don't have the rights to create a model under the namespace {namespace}")
            repo_id = f"{namespace}/{request['name']}"
            with hub.lock:
                exists = repo_id in hub.repos
                if not exists:
                    hub.repos[repo_id] = Repo(namespace, request.get("visibility") == "private")
            reply = {"url": f"{hub.url}/{repo_id}", "name": repo_id}
            if exists:  # the real Hub also answers the URL with its 409
                self._send(409, {**reply, "error": "You already created this model repo"})
            else:
                self._send(200, reply)

        def repo_info(self, token, body, repo_id, revision=None, head=False):
            repo = self._repo(repo_id, token)
            blobs = self.query.get("blobs") == ["True"] or self.query.get("blobs") == ["true"]
            self._send(200, {"id": repo_id, "sha": repo.sha, "private": repo.private, "gated": repo.gated and "auto",
                             "siblings": [repo.sibling(name) if blobs else {"rfilename": name}
                                          for name in repo.files]})

        def validate_yaml(self, token, body, head=False):
            errors = validate_card_metadata(json.loads(body)["content"])
            self._send(400 if errors else 200, {"errors": [{"message": e} for e in errors], "warnings": []})

        def _writable_repo(self, repo_id: str, token: Token | None) -> Repo:
            repo = self._repo(repo_id, token)
            if not hub.can_write(token, repo.owner):
                raise _Reply(403, f"You don't have write access to {repo_id}")
            return repo

        def preupload(self, token, body, repo_id, revision, head=False):
            self._writable_repo(repo_id, token)
            files = json.loads(body)["files"]
            self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                       for f in files]})

        def commit(self, token, body, repo_id, revision, head=False):
            repo = self._writable_repo(repo_id, token)
            lines = [json.loads(line) for line in body.splitlines() if line.strip()]
            if lines[0]["key"] != "header" or any(line["key"] != "file" for line in lines[1:]):
                raise _Reply(400, "the fake Hub only accepts a header and inline files")
            with hub.lock:
                for line in lines[1:]:
                    repo.files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                repo.commits.append(lines[0]["value"]["summary"])
            self._send(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{repo.sha}", "commitOid": repo.sha,
                             "pullRequestUrl": None})

        def resolve(self, token, body, repo_id, revision, filename, head=False):
            repo = self._repo(repo_id, token)
            if repo.gated and (token is None or token.user not in repo.granted):
                raise _Reply(401 if token is None else 403, f"Access to model {repo_id} is restricted; you must "
                             "accept its licence to access it", "GatedRepo")
            if filename not in repo.files:
                raise _Reply(404, "Entry not found", "EntryNotFound")
            data = repo.files[filename]
            headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{repo.blob(filename)}"', "Accept-Ranges": "bytes"}
            if head:
                return self._send(200, data, headers, head=True)
            if filename in hub.unavailable:
                raise _Reply(503, "Service temporarily unavailable")
            asked = self.headers.get("Range")
            start, end = 0, len(data)
            if asked:
                first, last = RANGE.fullmatch(asked).groups()
                start, end = int(first), int(last) + 1 if last else len(data)
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
            with hub.lock:
                drop = hub.drops.pop(filename, None)
            hold = hub.holds.get(filename)
            self.send_response(206 if asked else 200)
            for key, value in {**headers, "Content-Length": end - start}.items():
                self.send_header(key, str(value))
            self.end_headers()
            if hold is not None:
                hold.wait()
            sent = data[start:end] if drop is None else data[start:drop.at]
            with hub.lock:  # before the bytes go: the client may be done with them before this thread goes on
                hub.downloads.append(Download(filename, asked, len(sent)))
                if drop is not None and drop.then_unavailable:
                    hub.unavailable.add(filename)
            self.wfile.write(sent)
            if drop is not None:  # the connection breaks before the file's end
                self.wfile.flush()
                self.close_connection = True

    repo = r"([\w.-]+/[\w.-]+)"
    ROUTES = [
        (r"/api/whoami-v2", "GET", Handler.whoami),
        (r"/api/agent-harnesses", "GET", Handler.agent_harnesses),
        (r"/api/repos/create", "POST", Handler.create_repo),
        (r"/api/validate-yaml", "POST", Handler.validate_yaml),
        (rf"/api/models/{repo}", "GET", Handler.repo_info),
        (rf"/api/models/{repo}/revision/([^/]+)", "GET", Handler.repo_info),
        (rf"/api/models/{repo}/preupload/([^/]+)", "POST", Handler.preupload),
        (rf"/api/models/{repo}/commit/([^/]+)", "POST", Handler.commit),
        (rf"/{repo}/resolve/([^/]+)/(.+)", "GET", Handler.resolve),
    ]
    return Handler
