"""Prompt sets: built-in lists, the user's own files, Hub dataset columns; the train/eval split.

``load_prompts(source)`` accepts

* a built-in set name: ``presets/prompts/NAME.txt``, or an image folder ``presets/prompts/NAME/`` (see
  :func:`builtin_prompt_sets`),
* a file: ``.txt`` (one prompt per line), ``.csv`` or ``.jsonl`` (a ``prompt`` column/key),
* ``hf://DATASET[:COLUMN]``: the ``train`` split of a Hub dataset (column ``prompt`` by default),
  through the ``datasets`` library (online, or from its local cache),

and, for image-editing models, sources of :class:`~jagg_core.edit_prompts.EditPrompt` rows (instruction + input
image):

* an image folder holding ``prompts.csv`` (columns ``file``, ``prompt``) or ``prompts.jsonl`` (keys ``file``,
  ``prompt``): each row names an image of the folder (a relative path inside it) and the instruction applied to it;
  an image may have several rows, and a row several images (``a.png;b.png``, or a JSON list),
* ``hf://DATASET:TEXT_COLUMN,IMAGE_COLUMN[,IMAGE_COLUMN...]``: a Hub dataset's instructions and input images
  (``Image`` columns).

Blank prompts are dropped; an empty, oversized or malformed source raises :class:`UserError`.
"""

from __future__ import annotations

import csv
import io
import json
import random
import zipfile
from pathlib import Path, PurePosixPath

from .edit_prompts import EditPrompt, checked_image_bytes, png_bytes
from .errors import UserError

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "presets" / "prompts"
MAX_PROMPTS = 100_000
MAX_FILE_BYTES = 50 * 1024 * 1024
FILE_SUFFIXES = (".txt", ".csv", ".jsonl")
#: the file of an image folder that maps each image to its instruction (the first one present is read)
MAPPING_FILES = ("prompts.csv", "prompts.jsonl")
#: what separates a row's image files in its ``file`` column ('Picture 1' first)
IMAGE_SEPARATOR = ";"
#: an image folder uploaded as one file (the page's upload of an editing prompt set)
ARCHIVE_SUFFIX = ".zip"
#: the most an uploaded image folder may hold once unpacked
MAX_ARCHIVE_BYTES = 2 * 1024 ** 3
#: the folder macOS adds to the zips it makes (left out when one is unpacked)
MACOS_METADATA = "__MACOSX/"


def builtin_prompt_sets() -> list[str]:
    """Names of the built-in prompt sets: text files, and image folders for editing models."""
    folders = (path for path in PROMPTS_DIR.iterdir() if path.is_dir() and _mapping_file(path) is not None)
    return sorted([path.stem for path in PROMPTS_DIR.glob("*.txt")] + [path.name for path in folders])


def load_prompts(source: str) -> list[str]:
    """The prompts of a built-in set, a file, an image folder or a Hub dataset (see the module doc)."""
    if source.startswith("hf://"):
        prompts = _load_hub(source[len("hf://"):], source)
    elif source in builtin_prompt_sets():
        folder = PROMPTS_DIR / source
        prompts = _load_image_folder(folder) if folder.is_dir() else _load_file(PROMPTS_DIR / f"{source}.txt")
    elif Path(source).is_dir():
        prompts = _load_image_folder(Path(source))
    elif Path(source).suffix.lower() in FILE_SUFFIXES or Path(source).is_file():
        prompts = _load_file(Path(source))
    else:
        raise UserError(
            f"unknown prompt source '{source}'; give a built-in set ({', '.join(builtin_prompt_sets()) or 'none'}), "
            f"a .txt/.csv/.jsonl file, an image folder or hf://DATASET[:COLUMN]"
        )
    return _checked(prompts, source)


def _checked(prompts: list, source: str) -> list[str]:
    cleaned = []
    for number, prompt in enumerate(prompts, 1):
        if prompt is None:
            continue
        if not isinstance(prompt, str):
            raise UserError(f"prompt {number} of '{source}' is a {type(prompt).__name__}, not text")
        if isinstance(prompt, EditPrompt):
            cleaned.append(prompt)  # its instruction is cleaned when the row is made
        elif prompt.strip():
            cleaned.append(" ".join(prompt.split()))
    if not cleaned:
        raise UserError(f"prompt source '{source}' holds no prompts")
    if len(cleaned) > MAX_PROMPTS:
        raise UserError(f"prompt source '{source}' holds {len(cleaned)} prompts; the limit is {MAX_PROMPTS}")
    return cleaned


def _load_file(path: Path) -> list:
    text = _read_text(path)
    if path.suffix.lower() == ".txt":
        return text.splitlines()
    return [record["prompt"] for record in _records(text, path, ("prompt",))]


def _read_text(path: Path) -> str:
    """A prompt file's text, once it exists, has a known suffix, fits the size limit and is UTF-8."""
    if not path.is_file():
        raise UserError(f"prompt file '{path}' does not exist")
    suffix = path.suffix.lower()
    if suffix not in FILE_SUFFIXES:
        raise UserError(f"prompt file '{path}' must end in {', '.join(FILE_SUFFIXES)}")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise UserError(f"prompt file '{path}' is {size / 1e6:.0f} MB; the limit is {MAX_FILE_BYTES / 1e6:.0f} MB")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise UserError(f"prompt file '{path}' is not UTF-8 text (byte {err.start})") from None
    return text


def _records(text: str, path: Path, keys: tuple[str, ...]) -> list[dict]:
    """The rows of a ``.csv`` (with a header) or ``.jsonl`` file's ``text``, each holding ``keys``."""
    if path.suffix.lower() == ".csv":
        return _csv_records(text, path, keys)
    return _jsonl_records(text, path, keys)


def _csv_records(text: str, path: Path, keys: tuple[str, ...]) -> list[dict]:
    try:
        reader = csv.DictReader(io.StringIO(text))
        columns = reader.fieldnames or []
        for key in keys:
            if key not in columns:
                raise UserError(f"prompt file '{path}' needs a '{key}' column; it has: {', '.join(columns) or 'none'}")
        return list(reader)
    except csv.Error as err:
        raise UserError(f"prompt file '{path}' is not valid CSV: {err}") from None


def _jsonl_records(text: str, path: Path, keys: tuple[str, ...]) -> list[dict]:
    records = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"line {number} of prompt file '{path}' is not valid JSON: {err.msg}") from None
        if not isinstance(record, dict) or any(key not in record for key in keys):
            wanted = " and ".join(f"a '{key}' key" for key in keys)
            raise UserError(f"line {number} of prompt file '{path}' must be an object with {wanted}")
        records.append(record)
    return records


def _mapping_file(folder: Path) -> Path | None:
    """The image folder's instruction file (:data:`MAPPING_FILES`), or None."""
    return next((folder / name for name in MAPPING_FILES if (folder / name).is_file()), None)


def _load_image_folder(folder: Path) -> list:
    """The editing rows of an image folder: each ``(file, prompt)`` row of its mapping file, the image read from
    the folder (blank instructions are dropped)."""
    mapping = _mapping_file(folder)
    if mapping is None:
        raise UserError(f"image folder '{folder}' needs a {' or '.join(MAPPING_FILES)} that maps each image file to "
                        "its instruction (columns/keys: file, prompt)")
    rows = []
    for number, record in enumerate(_records(_read_text(mapping), mapping, ("file", "prompt")), 1):
        names, instruction = record["file"], record["prompt"]
        where = f"row {number} of '{mapping}'"
        names = names.split(IMAGE_SEPARATOR) if isinstance(names, str) else names
        texts = isinstance(names, list) and all(isinstance(name, str) for name in names)
        if not texts or not isinstance(instruction, str):
            raise UserError(f"{where}: 'prompt' must be text and 'file' a file name (several: joined by "
                            f"'{IMAGE_SEPARATOR}', or a list in JSONL)")
        if not instruction.strip():
            continue
        names = [name.strip() for name in names]
        images = []
        for name in names:
            image = folder / name
            if not name or not image.resolve().is_relative_to(folder.resolve()) or not image.is_file():
                raise UserError(f"{where}: image '{name}' is not a file inside '{folder}'")
            images.append(checked_image_bytes(image.read_bytes(), f"{where}: image '{name}'"))
        rows.append(EditPrompt(" ".join(instruction.split()), tuple(images), "+".join(names)))
    return rows


def unpack_image_folder(archive: Path, folder: Path) -> Path:
    """An image folder uploaded as a ``.zip`` (its mapping file at the top, or in the one folder at the top),
    unpacked into ``folder``: the folder that holds the mapping file. Refused in one line before anything is written:
    not a zip, a member whose path leaves the folder (absolute, ``..``), more than :data:`MAX_PROMPTS` files or
    :data:`MAX_ARCHIVE_BYTES` unpacked; after, a zip without a mapping file where it belongs."""
    name = archive.name
    try:
        with zipfile.ZipFile(archive) as zipped:
            members = [member for member in zipped.infolist()  # not macOS Finder's resource forks
                       if not member.is_dir() and not member.filename.startswith(MACOS_METADATA)]
            for member in members:
                path = PurePosixPath(member.filename.replace("\\", "/"))
                if path.is_absolute() or ".." in path.parts:
                    raise UserError(f"'{name}' holds '{member.filename[:80]}', a path outside its folder")
            unpacked = sum(member.file_size for member in members)  # as declared: zipfile reads no more
            if len(members) > MAX_PROMPTS or unpacked > MAX_ARCHIVE_BYTES:
                raise UserError(f"'{name}' holds {len(members)} files, {unpacked} bytes unpacked; the limits are "
                                f"{MAX_PROMPTS} files and {MAX_ARCHIVE_BYTES} bytes")
            zipped.extractall(folder, members)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, EOFError) as err:
        raise UserError(f"'{name}' is not a readable .zip ({err})") from None
    subfolders = [path for path in folder.iterdir() if path.is_dir()] if folder.is_dir() else []
    tops = [folder, *subfolders] if len(subfolders) == 1 else [folder]  # zipped from inside the folder, or of it
    found = next((top for top in tops if _mapping_file(top)), None)
    if found is None:
        raise UserError(f"'{name}' needs a {' or '.join(MAPPING_FILES)} (columns/keys: file, prompt) at its top or "
                        "in its one top folder, beside the images it names")
    return found


def _load_hub(spec: str, source: str) -> list:
    """A Hub dataset's prompt column (``DATASET[:COLUMN]``), or its editing rows (``DATASET:TEXT,IMAGE[,IMAGE...]``,
    the image columns in the order of the pictures)."""
    dataset_id, _, columns = spec.partition(":")
    text_column, *image_columns = columns.split(",")
    text_column = text_column or "prompt"
    if not dataset_id or not all(image_columns):
        raise UserError(f"prompt source '{source}' must look like hf://DATASET[:COLUMN] or "
                        "hf://DATASET:TEXT_COLUMN,IMAGE_COLUMN[,IMAGE_COLUMN...]")
    dataset = _hub_dataset(dataset_id, [text_column, *image_columns])
    if not image_columns:
        return list(dataset[text_column])
    rows = []
    for number, (instruction, *images) in enumerate(zip(dataset[text_column], *(dataset[c] for c in image_columns)), 1):
        where = f"row {number} of Hub dataset '{dataset_id}'"
        if isinstance(instruction, str) and instruction.strip():
            datas = []
            for column, image in zip(image_columns, images):
                data = image["bytes"] if isinstance(image, dict) else png_bytes(image) if hasattr(image, "save") \
                    else None
                if not isinstance(data, bytes):
                    raise UserError(f"{where}: column '{column}' holds no image")
                datas.append(checked_image_bytes(data, where))
            rows.append(EditPrompt(" ".join(instruction.split()), tuple(datas), f"row {number}"))
    return rows


def _hub_dataset(dataset_id: str, columns: list[str]):
    """The ``train`` split of a Hub dataset that has ``columns``."""
    import datasets

    try:
        dataset = datasets.load_dataset(dataset_id, split="train")
    except Exception as err:  # noqa: BLE001  datasets raises many types for offline / missing / gated
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(
            f"cannot load Hub dataset '{dataset_id}' ({reason[:200]}); check the name, go online or "
            f"run `hf download --repo-type dataset {dataset_id}` first"
        ) from None
    for column in columns:
        if column not in dataset.column_names:
            raise UserError(f"Hub dataset '{dataset_id}' has no column '{column}'; it has: "
                            f"{', '.join(dataset.column_names)}")
    if dataset.num_rows > MAX_PROMPTS:
        raise UserError(f"Hub dataset '{dataset_id}' has {dataset.num_rows} rows; the limit is {MAX_PROMPTS}")
    return dataset


def run_prompts(config) -> tuple[list[str], list[str]]:
    """``(train, eval)`` of a run's :class:`~jagg_core.config.PromptsConfig`: the prompts of ``eval_source`` (taken
    out of training) when given, else ``eval_count`` prompts held out from ``source`` (:func:`split_prompts`); the
    training prompts cut to ``limit`` distinct ones (:func:`limit_prompts`)."""
    prompts = load_prompts(config.source)
    if config.eval_source is None:
        train, held_out = split_prompts(prompts, config.eval_count, config.split_seed)
    else:
        held_out = list(dict.fromkeys(load_prompts(config.eval_source)))
        excluded = set(held_out)
        train = [p for p in prompts if p not in excluded]
        if not train:
            raise UserError("every training prompt is also an eval prompt; the eval prompts must leave some for "
                            "training")
    return limit_prompts(train, config.limit, config.split_seed), held_out


def limit_prompts(train: list, limit: int | None, seed: int) -> list:
    """``train`` with only ``limit`` of its distinct prompts, drawn with ``random.Random(seed)`` from them sorted
    (repeats and order kept); all of it without a limit or with fewer distinct prompts."""
    distinct = sorted(set(train))
    if limit is None or limit >= len(distinct):
        return train
    kept = set(random.Random(seed).sample(distinct, limit))
    return [p for p in train if p in kept]


def split_prompts(prompts: list[str], eval_count: int, seed: int) -> tuple[list[str], list[str]]:
    """``(train, eval)``: ``eval_count`` distinct prompts held out for the fixed-seed eval samples.

    The eval set is drawn with ``random.Random(seed)`` from the sorted distinct prompts, so it
    depends only on the set of prompts and the seed. ``train`` keeps every other prompt (with
    repeats and in the given order); no eval prompt appears in it.
    """
    distinct = sorted(set(prompts))
    if eval_count < 1:
        raise UserError(f"prompts.eval_count must be at least 1, got {eval_count}")
    if eval_count >= len(distinct):
        raise UserError(
            f"prompts.eval_count is {eval_count} but the prompt set has only {len(distinct)} distinct prompts; "
            f"lower eval_count so that some prompts are left for training"
        )
    held_out = random.Random(seed).sample(distinct, eval_count)
    excluded = set(held_out)
    return [p for p in prompts if p not in excluded], held_out
