"""A Hub base model's first download: which files a run needs, how much is left to fetch, whether the disk has room,
and a download that reports its progress and continues where it stopped. No deep-learning library is imported.

**The files** (:func:`pipeline_files`) are those ``DiffusionPipeline.from_pretrained`` fetches for a pipeline
loaded as :mod:`jagg_core.models` loads it (no ``variant``, safetensors preferred), taken from the repo's file list:

- ``model_index.json`` and, at the root, ``scheduler_config.json``, ``config.json``, ``pipeline.py`` and the
  tokenizer/processor files diffusers allows there (:data:`ROOT_FILES`);
- every component of ``model_index.json`` (its value a ``[library, class]`` pair, not ``[null, null]``):
  a component folder holding weights gives its ``config.json``, every other one (scheduler, tokenizers) all its files;
- the weight files, named as diffusers and transformers save them (:data:`WEIGHT_FILE`: ``diffusion_pytorch_model``,
  ``model``, ``pytorch_model`` or ``weights``, sharded ``-00001-of-00003`` or not) and their ``.index.json``, in one
  format: safetensors when every component folder with weights has a safetensors weight file, else ``.bin``;
- never: the other format, ``*.msgpack``, ``*.onnx``/``*.pb``, variants (``*.fp16.safetensors``), single-file
  checkpoints at the root (``flux1-dev.safetensors``, ``*.ckpt``), ``model_index.json``'s ``_ignore_files``, READMEs
  and pictures.

So once they are in the cache, ``from_pretrained`` finds the pipeline complete and fetches nothing more.

**The size left** (:func:`plan_download`): the files' sizes from ``HfApi.model_info(files_metadata=True)``, less
what the Hugging Face cache (``huggingface_hub.constants.HF_HUB_CACHE``) holds: a file linked in the commit's
snapshot, a blob of the same content (``blobs/<sha256>`` of an LFS file, ``blobs/<git blob id>`` otherwise), or the
bytes of an interrupted download (``blobs/<blob>.incomplete``).

**The room** (:func:`check_disk_room`): the cache's disk must have free ``left + max(MARGIN_MIN_BYTES, MARGIN_FRACTION
x left)``, 2 GB or 5 % to spare (the run's checkpoints and other writers often share that disk).

**The download** (:func:`download_model`): ``WORKERS`` files at a time, each appended to its
``blobs/<blob>.incomplete`` from the length already there (an HTTP ``Range`` request, by huggingface_hub's ``http_get``,
which also retries a dropped connection from where it broke), renamed to the blob when complete, then linked into the
snapshot by ``hf_hub_download`` (it finds the blob and downloads nothing). huggingface_hub's own downloads write to a
temporary file of the process and delete it when they fail, so a killed or failed run would start its 20-60 GB
again; here the partial file outlives the process and the next start or ``--resume`` continues it. A file is
written under huggingface_hub's lock of that blob, so two runs (or a run and a diffusers download) never write one
file together. Files go over plain HTTPS (the Hub's CDN), not Xet, whose downloads do not resume.
"""

from __future__ import annotations

import errno
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError
from .host import free_disk
from .hubclient import hub_errors, resolve_token
from .model_index import read_model_index

#: a weight file's name, as diffusers' ``variant_compatible_siblings`` matches it without a variant
WEIGHT_FILE = re.compile(r"(diffusion_pytorch_model|pytorch_model|model|weights)(-\d{5}-of-\d{5})?"
                         r"\.(safetensors|bin|onnx|pb)$")
#: the index of a sharded weight file
WEIGHT_INDEX = re.compile(r"(diffusion_pytorch_model|pytorch_model|model|weights)\.(safetensors|bin|onnx|pb)"
                          r"\.index\.json$")
#: endings that make a file count as weights when diffusers decides which component folders hold weights
WEIGHT_ENDINGS = ("safetensors", "bin", "onnx", "pb", "flashpack")
#: the root files diffusers fetches besides the components' folders
ROOT_FILES = frozenset({"model_index.json", "scheduler_config.json", "config.json", "pipeline.py",
                        "chat_template.jinja", "generation_config.json", "preprocessor_config.json",
                        "processor_config.json", "tokenizer.json", "tokenizer_config.json"})
#: the formats never fetched, besides the weight format not chosen
NEVER = ("msgpack", "onnx", "pb")
GB = 1e9  # download sizes in decimal units, as the Hub shows them
MB = 1e6
MARGIN_MIN_BYTES = 2 * GB
MARGIN_FRACTION = 0.05
WORKERS = 4  # files downloaded at once
RATE_WINDOW_S = 5.0  # the rate is measured over the last seconds
REPORT_EVERY_S = 1.0


def amount(n_bytes: float, of: float | None = None) -> str:
    """``23.8 GB`` (or ``8.2 MB`` below 0.1 GB); with ``of``, ``3.2 of 23.8 GB`` in the unit of ``of``."""
    scale, unit = (GB, "GB") if (n_bytes if of is None else of) >= 0.1 * GB else (MB, "MB")
    if of is None:
        return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes / scale:.1f} of {of / scale:.1f} {unit}"


def pipeline_components(index: dict) -> set[str]:
    """The components a pipeline loads: the keys of its ``model_index.json`` given as ``[library, class]``."""
    return {key for key, value in index.items()
            if isinstance(value, list) and key != "_class_name" and value and value[0] is not None}


def pipeline_files(index: dict, filenames: Iterable[str]) -> set[str]:
    """The files of a repo (``filenames``) that ``from_pretrained`` fetches for the pipeline ``index``
    (its ``model_index.json``), by the rules of the module docstring."""
    filenames = set(filenames) - set(index.get("_ignore_files", []))
    pairs = {key for key, value in index.items() if isinstance(value, list) and key != "_class_name"}
    components = pipeline_components(index)

    def folder(path: str) -> str:
        return path.split("/")[0] if "/" in path else ""

    direct = {path for path in filenames if path.count("/") == 1}
    weighted = {folder(path) for path in direct if path.endswith(WEIGHT_ENDINGS)} & components
    safetensors = all(any(path.endswith(".safetensors") and WEIGHT_FILE.match(path.split("/")[1])
                          for path in direct if folder(path) == component) for component in weighted)
    dropped = re.compile(rf"\.({'|'.join(('bin' if safetensors else 'safetensors',) + NEVER)})(\.index\..*json)?$")

    def wanted(path: str) -> bool:
        name, top = path.rsplit("/", 1)[-1], folder(path)
        if dropped.search(path) or (top in pairs and top not in components):
            return False
        if WEIGHT_FILE.match(name) or WEIGHT_INDEX.match(name):
            return True
        if top in weighted:
            return path == f"{top}/config.json"
        return top in components or path in ROOT_FILES

    return {path for path in filenames if wanted(path)}


@dataclass(frozen=True)
class HubFile:
    """One file of the plan: its size and blob name (the LFS sha256, else the git blob id, as the cache names it),
    ``have``: its bytes in the cache, ``linked``: already in the commit's snapshot."""

    path: str
    size: int
    blob: str
    have: int
    linked: bool


@dataclass(frozen=True)
class DownloadPlan:
    """What a Hub model's run needs from the Hub: the files at one commit, and how much of them the cache holds."""

    repo_id: str
    commit: str
    files: tuple[HubFile, ...]

    @property
    def total(self) -> int:
        return sum(file.size for file in self.files)

    @property
    def done(self) -> int:
        return sum(file.have for file in self.files)

    @property
    def left(self) -> int:
        """Bytes still to download: each blob once (files of the same content share it in the cache)."""
        return sum({file.blob: file.size - file.have for file in self.files}.values())

    @property
    def pending(self) -> list[HubFile]:
        """The files not yet in the snapshot, largest first (a blob already downloaded is only linked)."""
        return sorted((file for file in self.files if not file.linked), key=lambda file: -file.size)

    def summary(self) -> str:
        """``the base model OWNER/NAME: 23.8 GB to download (of 33.1 GB)``."""
        return f"the base model {self.repo_id}: {amount(self.left)} to download (of {amount(self.total)})"


def storage_folder(repo_id: str) -> Path:
    """The model's folder in the Hugging Face cache (``models--OWNER--NAME``)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name
    return Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")


def plan_download(repo_id: str, revision: str | None) -> DownloadPlan | None:
    """The files ``repo_id`` at ``revision`` needs and what the cache holds of them, asked of the Hub (online only);
    None when the Hub will not list the files of a model whose cached snapshot has every component (the cache then
    serves it, as ``from_pretrained`` would). A Hub error raises a one-line :class:`UserError`."""
    from huggingface_hub import HfApi, try_to_load_from_cache
    index = read_model_index(repo_id, revision)
    try:
        with hub_errors(f"list the files of '{repo_id}'", repo_id=repo_id):
            info = HfApi().model_info(repo_id, revision=revision, files_metadata=True, token=resolve_token())
    except UserError:
        if in_cache(repo_id, revision, index):
            return None
        raise
    siblings = {sibling.rfilename: sibling for sibling in info.siblings or []}
    blobs = storage_folder(repo_id) / "blobs"
    files = []
    for path in sorted(pipeline_files(index, siblings)):
        sibling = siblings[path]
        blob = sibling.lfs.sha256 if sibling.lfs else sibling.blob_id
        linked = isinstance(try_to_load_from_cache(repo_id, path, revision=info.sha), str)
        partial = blobs / f"{blob}.incomplete"
        have = (sibling.size if linked or (blobs / blob).is_file()
                else min(partial.stat().st_size, sibling.size) if partial.is_file() else 0)
        files.append(HubFile(path, sibling.size, blob, have, linked))
    return DownloadPlan(repo_id, info.sha, tuple(files))


def in_cache(repo_id: str, revision: str | None, index: dict) -> bool:
    """Whether the cached snapshot of ``repo_id`` (``index``: its model_index.json) has a folder for every component
    (what ``from_pretrained`` loads offline)."""
    from huggingface_hub import try_to_load_from_cache
    cached_index = try_to_load_from_cache(repo_id, "model_index.json", revision=revision)
    snapshot = Path(cached_index).parent if isinstance(cached_index, str) else None
    return snapshot is not None and all((snapshot / component).is_dir() for component in pipeline_components(index))


def check_cached(repo_id: str, revision: str | None) -> None:
    """With the Hub offline, a run can only start from the cache: a one-line :class:`UserError` when the cache does
    not hold ``repo_id`` (its model_index.json, then every component)."""
    index = read_model_index(repo_id, revision)
    if not in_cache(repo_id, revision, index):
        raise UserError(f"cannot load model '{repo_id}': the Hub is unreachable and the local cache holds only part "
                        f"of it; check your connection, or run `hf download {repo_id}` while online")


def check_disk_room(plan: DownloadPlan) -> None:
    """Refuse, in one line, a download the Hugging Face cache's disk has no room for (with the margin above)."""
    from huggingface_hub import constants
    if plan.left == 0:
        return
    cache = Path(constants.HF_HUB_CACHE).expanduser().absolute()
    free = free_disk(cache)
    margin = max(MARGIN_MIN_BYTES, MARGIN_FRACTION * plan.left)
    if free < plan.left + margin:
        raise UserError(f"cannot download the base model {plan.repo_id}: it needs {amount(plan.left)} (and "
                        f"{amount(margin)} to spare) in the Hugging Face cache {cache}, whose disk has {amount(free)} "
                        "free; free some space there, or set HF_HOME to a folder on a larger disk and start again")


@dataclass(frozen=True)
class Transfer:
    """A download's progress: bytes of the model in the cache (``done``) of ``total``, ``rate`` in bytes/s."""

    done: int
    total: int
    rate: float

    def line(self, model: str) -> str:
        """``downloading OWNER/NAME: 3.2 of 23.8 GB, 41 MB/s, about 8 min left``."""
        words = (f"downloading {model}: {amount(self.done, of=self.total)}, "
                 f"{self.rate / MB:.{0 if self.rate >= 10 * MB else 1}f} MB/s")
        if self.rate > 0 and self.done < self.total:
            words += f", about {max(1, round((self.total - self.done) / self.rate / 60))} min left"
        return words


class _Aborted(Exception):
    """Raised in a download thread once the download as a whole stops (an error elsewhere, a stop signal)."""


class _Bytes:
    """Each pending file's bytes on disk, shared by the download threads; ``done``: the plan's total so far."""

    def __init__(self, plan: DownloadPlan):
        self.lock = threading.Lock()
        self.base = sum(file.have for file in plan.files if file.linked)
        self.files = {file.path: file.have for file in plan.pending}

    def set(self, path: str, size: int) -> None:
        with self.lock:
            self.files[path] = size

    @property
    def done(self) -> int:
        with self.lock:
            return self.base + sum(self.files.values())


class _CountingFile:
    """The partial file as ``http_get`` writes it: each write records the file's length (so a restart from byte 0
    after a server ignored the Range is counted right) and stops the thread once ``abort`` is set."""

    def __init__(self, handle, path: str, counts: _Bytes, abort: threading.Event):
        self.handle, self.path, self.counts, self.abort = handle, path, counts, abort

    def write(self, data: bytes) -> int:
        if self.abort.is_set():
            raise _Aborted
        written = self.handle.write(data)
        self.counts.set(self.path, self.handle.tell())
        return written

    def __getattr__(self, name):  # tell, seek, truncate
        return getattr(self.handle, name)


def _fetch(plan: DownloadPlan, file: HubFile, token: str | None, counts: _Bytes, abort: threading.Event) -> None:
    """One file into the cache: appended to its partial blob from where it stopped, renamed, linked."""
    from huggingface_hub import constants, hf_hub_download, hf_hub_url
    from huggingface_hub.file_download import http_get, repo_folder_name
    from huggingface_hub.utils import WeakFileLock, build_hf_headers, silent_tqdm

    blob = storage_folder(plan.repo_id) / "blobs" / file.blob
    lock = Path(constants.HF_HUB_CACHE) / ".locks" / repo_folder_name(repo_id=plan.repo_id, repo_type="model")
    lock.mkdir(parents=True, exist_ok=True)
    blob.parent.mkdir(parents=True, exist_ok=True)
    with WeakFileLock(lock / f"{file.blob}.lock"):  # huggingface_hub's lock of this blob
        if not blob.is_file():
            partial = blob.with_name(f"{file.blob}.incomplete")
            with partial.open("ab") as handle:
                if handle.tell() > file.size:  # not this file's bytes: start it again
                    handle.seek(0)
                    handle.truncate()
                counting = _CountingFile(handle, file.path, counts, abort)
                counts.set(file.path, handle.tell())
                headers = {**build_hf_headers(token=token), "Accept-Encoding": "identity"}
                http_get(hf_hub_url(plan.repo_id, file.path, revision=plan.commit), counting,
                         resume_size=handle.tell(), headers=headers, expected_size=file.size,
                         tqdm_class=silent_tqdm)  # the progress is ours
            partial.replace(blob)
    counts.set(file.path, file.size)
    hf_hub_download(plan.repo_id, file.path, revision=plan.commit, token=token)


def download_model(plan: DownloadPlan, report: Callable[[Transfer], None] | None = None) -> Transfer:
    """Download the plan's pending files into the cache, calling ``report`` at the start and then about every
    :data:`REPORT_EVERY_S` seconds; returns the end's :class:`Transfer`. ``rate`` = bytes gained over the last
    :data:`RATE_WINDOW_S` seconds / their duration.

    The caller's thread waits and reports, so a stop signal (``StopRequested``) interrupts it at once; the
    download threads then stop at their next chunk, leaving their partial files for the next start. A Hub error
    or a full disk raises a one-line :class:`UserError`."""
    token = resolve_token()
    counts = _Bytes(plan)
    abort = threading.Event()
    todo: queue.SimpleQueue[HubFile] = queue.SimpleQueue()
    for file in plan.pending:
        todo.put(file)
    errors: list[BaseException] = []

    def work() -> None:
        while not abort.is_set():
            try:
                file = todo.get_nowait()
            except queue.Empty:
                return
            try:
                _fetch(plan, file, token, counts, abort)
            except _Aborted:
                return
            except BaseException as err:  # noqa: BLE001  handed to the caller's thread
                errors.append(err)
                abort.set()
                return

    threads = [threading.Thread(target=work, daemon=True, name=f"download-{i}")
               for i in range(min(WORKERS, len(plan.pending)))]
    for thread in threads:
        thread.start()
    samples: deque[tuple[float, int]] = deque()

    def measure() -> Transfer:
        now, done = time.monotonic(), counts.done
        samples.append((now, done))
        while now - samples[0][0] > RATE_WINDOW_S:
            samples.popleft()
        then, before = samples[0]
        return Transfer(done, plan.total, (done - before) / (now - then) if now > then else 0.0)

    report = report or (lambda transfer: None)
    try:
        report(measure())
        while alive := [thread for thread in threads if thread.is_alive()]:
            alive[0].join(REPORT_EVERY_S)
            if alive[0].is_alive():  # a second has passed
                report(measure())
    except BaseException:
        abort.set()
        raise
    if errors:
        _raise_one_line(errors[0], plan)
    return measure()


def _raise_one_line(error: BaseException, plan: DownloadPlan) -> None:
    """A download thread's failure as the caller's one-line error."""
    from huggingface_hub import constants
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        raise UserError(f"cannot download the base model {plan.repo_id}: the disk of the Hugging Face cache "
                        f"{constants.HF_HUB_CACHE} is full; free some space there, or set HF_HOME to a folder on a "
                        "larger disk, and start again: the download continues where it stopped") from None
    try:
        with hub_errors(f"download the base model {plan.repo_id}", repo_id=plan.repo_id):
            raise error
    except UserError as err:
        raise UserError(f"{err} (what is downloaded is kept: the next start continues from there)") from None
