"""The Markdown reference of every config key, from the schema of :mod:`jagg_core.config`.

    python -m jagg_core.config_reference                    # print it
    python -m jagg_core.config_reference --update docs/config.md  # write it between the page's markers

One table per section (key, default, description); a key's description is its ``Field(description=...)``, followed
by its allowed values (a ``Literal``) and its numeric range (``ge``/``gt``/``le``/``lt``). Then every reward of the
catalog (:data:`~jagg_core.rewards.catalog.CATALOG`): what it scores, its scoring model's size, the range a working
model's samples score in, and its ``options`` in the same kind of table.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from .config import SEED_BOUND, RunConfig, section_type, yaml_value
from .errors import UserError, exit_on_user_error

REFERENCE_BEGIN, REFERENCE_END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def _literal_choices(annotation: Any) -> list:
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    return [choice for arg in get_args(annotation) for choice in _literal_choices(arg)]


def _bound(value: Any) -> str:
    return "2^63" if value == SEED_BOUND else f"{value:g}"


def _range(field: FieldInfo) -> str:
    """The numeric bounds of a field: ``>= 1``, ``(0, 2]``, ``[0, 2^63)``; empty without bounds."""
    low = high = None
    for item in field.metadata:
        for attr, bracket in (("ge", "["), ("gt", "(")):
            if getattr(item, attr, None) is not None:
                low = (bracket, getattr(item, attr))
        for attr, bracket in (("le", "]"), ("lt", ")")):
            if getattr(item, attr, None) is not None:
                high = (bracket, getattr(item, attr))
    if low and high:
        return f"{low[0]}{_bound(low[1])}, {_bound(high[1])}{high[0]}"
    if low:
        return f"{'>=' if low[0] == '[' else '>'} {_bound(low[1])}"
    if high:
        return f"{'<=' if high[0] == ']' else '<'} {_bound(high[1])}"
    return ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    return f"`{yaml_value(value)}`"


def _doc(model: type[BaseModel]) -> str:
    """A section's docstring as one Markdown paragraph."""
    return " ".join((model.__doc__ or "").split()).replace("``", "`")


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    return ["| key | default | description |", "|---|---|---|", *_rows(model, prefix)]


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    """A section's keys; a key holding a list of sections (``eval.judges``) is followed by its items' keys
    (``eval.judges[].name``). The top level's sections have their own tables."""
    rows = []
    for name, field in model.model_fields.items():
        nested = section_type(field.annotation)
        if nested is not None and (model is RunConfig or get_origin(field.annotation) is not list):
            continue
        text = (field.description or "").rstrip(".")
        choices = _literal_choices(field.annotation)
        if choices:
            text += ". Allowed: " + ", ".join(f"`{yaml_value(choice)}`" for choice in choices)
        bounds = _range(field)
        if bounds:
            text += f". Range: `{bounds}`"
        rows.append(f"| `{prefix}{name}` | {_cell(_default(field))} | {_cell(text)}. |")
        if nested is not None:
            rows += _rows(nested, f"{prefix}{name}[].")
    return rows


def config_reference() -> str:
    """The Markdown reference of every config key: one table per section (key, default, description), from the
    schema. ``docs/config.md`` is this text between its markers."""
    lines = ["### top level", "", _doc(RunConfig), "", *_table(RunConfig, "")]
    for name, field in RunConfig.model_fields.items():
        section = section_type(field.annotation)
        if section is None:
            continue
        intro = _doc(section)
        if get_origin(field.annotation) is list:
            intro += f" Default: `{yaml_value(field.get_default(call_default_factory=True))}`."
            prefix = f"{name}[]."
        else:
            prefix = f"{name}."
        lines += ["", f"### {name}", "", intro, "", *_table(section, prefix)]
    return "\n".join([*lines, "", *reward_reference()]) + "\n"


def reward_reference() -> list[str]:
    """The rewards of the catalog, each a paragraph and its options' table: the lines of the reference's last
    section."""
    from .rewards.catalog import CATALOG, NoOptions

    lines = ["### the rewards and their options", "",
             "A name for `rewards[].name` or `eval.judges[].name`, and the keys its `options` take (unknown ones are "
             "refused before launch)."]
    for entry in CATALOG.values():
        facts = [f"{entry.about[0].upper()}{entry.about[1:]}."]
        if entry.device_params_m:
            facts.append(f"Scoring models: {entry.device_params_m:g} M parameters.")
        low, high = entry.expected_range
        scores = ("" if low is None and high is None else f"at most {high:g}" if low is None
                  else f"at least {low:g}" if high is None else f"{low:g} to {high:g}")
        if scores:
            facts.append(f"A working model's samples score {scores} (the doctor checks the base model's).")
        table = ["No options."] if entry.options is NoOptions else _table(entry.options, "options.")
        lines += ["", f"#### `{entry.name}`", "", " ".join(facts), "", *table]
    return lines


def update_reference(path: str | Path) -> bool:
    """Rewrite the part of the Markdown file ``path`` between the reference markers; True if it changed."""
    path = Path(path)
    text = path.read_text()
    head, begin, rest = text.partition(REFERENCE_BEGIN + "\n")
    _, end, tail = rest.partition(REFERENCE_END)
    if not begin or not end:
        raise UserError(f"{path} lacks the lines {REFERENCE_BEGIN} and {REFERENCE_END}")
    updated = head + begin + config_reference() + end + tail
    if updated == text:
        return False
    path.write_text(updated)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jagg_core.config_reference",
                                     description="Print the Markdown config reference, or write it into a file.")
    parser.add_argument("--update", metavar="FILE", help="write the reference between the config-reference "
                        "markers of FILE (docs/config.md) instead of printing it")
    args = parser.parse_args(argv)
    if args.update:
        with exit_on_user_error(parser.prog):
            print(f"{args.update}: {'updated' if update_reference(args.update) else 'already up to date'}")
    else:
        print(config_reference(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
