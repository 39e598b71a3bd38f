"""Prompt sets: built-in lists, the user's own files, Hub dataset columns; the train/eval split.

``load_prompts(source)`` accepts

* a built-in set name: ``presets/prompts/NAME.txt`` (see :func:`builtin_prompt_sets`),
* a file: ``.txt`` (one prompt per line), ``.csv`` or ``.jsonl`` (a ``prompt`` column/key),
* ``hf://DATASET[:COLUMN]``: the ``train`` split of a Hub dataset (column ``prompt`` by default),
  through the ``datasets`` library (online, or from its local cache).

Blank prompts are dropped; an empty, oversized or malformed source raises :class:`UserError`.
"""

from __future__ import annotations

import csv
import io
import json
import random
from pathlib import Path

from .errors import UserError

PROMPTS_DIR = Path(__file__).resolve().parent.parent / "presets" / "prompts"
MAX_PROMPTS = 100_000
MAX_FILE_BYTES = 50 * 1024 * 1024
FILE_SUFFIXES = (".txt", ".csv", ".jsonl")


def builtin_prompt_sets() -> list[str]:
    """Names of the built-in prompt sets."""
    return sorted(path.stem for path in PROMPTS_DIR.glob("*.txt"))


def load_prompts(source: str) -> list[str]:
    """The prompts of a built-in set, a file or a Hub dataset column (see the module doc)."""
    if source.startswith("hf://"):
        prompts = _load_hub_column(source[len("hf://"):], source)
    elif source in builtin_prompt_sets():
        prompts = _load_file(PROMPTS_DIR / f"{source}.txt")
    elif Path(source).suffix.lower() in FILE_SUFFIXES or Path(source).is_file():
        prompts = _load_file(Path(source))
    else:
        raise UserError(
            f"unknown prompt source '{source}'; give a built-in set ({', '.join(builtin_prompt_sets()) or 'none'}), "
            f"a .txt/.csv/.jsonl file or hf://DATASET[:COLUMN]"
        )
    return _checked(prompts, source)


def _checked(prompts: list, source: str) -> list[str]:
    cleaned = []
    for number, prompt in enumerate(prompts, 1):
        if prompt is None:
            continue
        if not isinstance(prompt, str):
            raise UserError(f"prompt {number} of '{source}' is a {type(prompt).__name__}, not text")
        if prompt.strip():
            cleaned.append(" ".join(prompt.split()))
    if not cleaned:
        raise UserError(f"prompt source '{source}' holds no prompts")
    if len(cleaned) > MAX_PROMPTS:
        raise UserError(f"prompt source '{source}' holds {len(cleaned)} prompts; the limit is {MAX_PROMPTS}")
    return cleaned


def _load_file(path: Path) -> list:
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
    if suffix == ".txt":
        return text.splitlines()
    if suffix == ".csv":
        return _csv_prompts(text, path)
    return _jsonl_prompts(text, path)


def _csv_prompts(text: str, path: Path) -> list:
    try:
        reader = csv.DictReader(io.StringIO(text))
        columns = reader.fieldnames or []
        if "prompt" not in columns:
            raise UserError(f"prompt file '{path}' needs a 'prompt' column; it has: {', '.join(columns) or 'none'}")
        return [row["prompt"] for row in reader]
    except csv.Error as err:
        raise UserError(f"prompt file '{path}' is not valid CSV: {err}") from None


def _jsonl_prompts(text: str, path: Path) -> list:
    prompts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"line {number} of prompt file '{path}' is not valid JSON: {err.msg}") from None
        if not isinstance(record, dict) or "prompt" not in record:
            raise UserError(f"line {number} of prompt file '{path}' must be an object with a 'prompt' key")
        prompts.append(record["prompt"])
    return prompts


def _load_hub_column(spec: str, source: str) -> list:
    dataset_id, _, column = spec.partition(":")
    column = column or "prompt"
    if not dataset_id:
        raise UserError(f"prompt source '{source}' must look like hf://DATASET[:COLUMN]")
    import datasets

    try:
        dataset = datasets.load_dataset(dataset_id, split="train")
    except Exception as err:  # noqa: BLE001  datasets raises many types for offline / missing / gated
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(
            f"cannot load Hub dataset '{dataset_id}' ({reason[:200]}); check the name, go online or "
            f"run `hf download --repo-type dataset {dataset_id}` first"
        ) from None
    if column not in dataset.column_names:
        columns = ", ".join(dataset.column_names)
        raise UserError(f"Hub dataset '{dataset_id}' has no column '{column}'; it has: {columns}")
    if dataset.num_rows > MAX_PROMPTS:
        raise UserError(f"Hub dataset '{dataset_id}' has {dataset.num_rows} rows; the limit is {MAX_PROMPTS}")
    return list(dataset[column])


def run_prompts(config) -> tuple[list[str], list[str]]:
    """``(train, eval)`` of a run's :class:`~jagg_core.config.PromptsConfig`: the prompts of ``eval_source`` (taken
    out of training) when given, else ``eval_count`` prompts held out from ``source`` (:func:`split_prompts`)."""
    prompts = load_prompts(config.source)
    if config.eval_source is None:
        return split_prompts(prompts, config.eval_count, config.split_seed)
    held_out = list(dict.fromkeys(load_prompts(config.eval_source)))
    excluded = set(held_out)
    train = [p for p in prompts if p not in excluded]
    if not train:
        raise UserError("every training prompt is also an eval prompt; the eval prompts must leave some for training")
    return train, held_out


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
