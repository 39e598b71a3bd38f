"""What a compositional prompt asks for, read from its words: objects, their counts and colours, and where one is.

The ``geneval`` reward (:mod:`jagg_core.rewards.geneval`) checks an image against these requirements, as GenEval
(Ghosh et al. 2023) and Flow-GRPO's GenEval task check theirs against a detector. This module reads the prompts alone
(no deep-learning import), so a prompt set it cannot read is refused before a launch.

Grammar (lower case, a final full stop dropped)::

    prompt   = ["a photo of "] phrase [" " relation " " phrase] [" " setting]
    phrase   = amount " " [colour " "] noun
    amount   = "a" | "an" | "one" | "two" | ... | "ten"
    colour   = red | orange | yellow | green | blue | purple | pink | brown | black | white   (GenEval's ten)
    noun     = one to three words, none of them a grammar word (the plural after two or more); a colour word is a
               noun where no noun follows it ("an orange", "a red orange")
    relation = "and" | "to the left of" | "left of" | "to the right of" | "right of" | "above" | "on top of"
             | "below" | "under" | "beneath" | "next to" | "beside" | "near" | "in front of" | "behind"
    setting  = "on a table"

which reads GenEval's six templates ("a photo of a bench", "a photo of four giraffes", "a photo of a cup and a
dog", "a photo of a red car and a blue bowl", "a photo of a cat left of a dog") and the built-in ``compositional``
prompts ("three green teddy bears in front of a pumpkin", "a black clock and a pink cat on a table").

Requirements, as GenEval's: an object with "a"/"an"/"one" is there at least once; with two or more, exactly that many
times; with a colour, at least that many of it have the colour. A relation left of, right of, above (on top of) or
below (under, beneath) is checked between the two objects' boxes; "and", "next to", "beside", "near", "in front of"
and "behind" (depth, which a box does not show) ask only that both are there. A setting is not checked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import UserError

#: GenEval's colours
COLOURS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
#: amount -> count
AMOUNTS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
           "nine": 9, "ten": 10}
#: relation words -> the relation between the first object's box and the second's (None: both there, nothing more)
RELATIONS = {"to the left of": "left of", "left of": "left of", "to the right of": "right of",
             "right of": "right of", "above": "above", "on top of": "above", "below": "below", "under": "below",
             "beneath": "below", "and": None, "next to": None, "beside": None, "near": None, "in front of": None,
             "behind": None}
#: settings a prompt may end with, not checked
SETTINGS = ("on a table",)
PREFIX = "a photo of "
#: words a noun cannot hold: they belong to the grammar
GRAMMAR_WORDS = frozenset({*AMOUNTS, *(w for r in RELATIONS for w in r.split()), "the", "with", "in", "on", "photo"})
#: plural -> singular where dropping the final "s" or "es" is wrong
IRREGULAR_PLURALS = {"people": "person", "men": "man", "women": "woman", "children": "child", "mice": "mouse",
                     "geese": "goose", "teeth": "tooth", "feet": "foot", "knives": "knife", "wolves": "wolf",
                     "leaves": "leaf", "shelves": "shelf", "buses": "bus", "sheep": "sheep", "fish": "fish",
                     "skis": "skis", "scissors": "scissors", "glasses": "glass", "dishes": "dish"}

_PARTS = re.compile(rf"(?P<amount>{'|'.join(AMOUNTS)}) (?:(?P<colour>{'|'.join(COLOURS)}) )?"
                    r"(?P<noun>[a-z]+(?: [a-z]+){0,2})")


@dataclass(frozen=True)
class ObjectRequirement:
    """``count`` of ``noun`` (singular), exactly (``exact``) or at least, ``colour`` of at least ``count`` of them."""

    noun: str
    count: int
    exact: bool
    colour: str | None = None

    def checks(self) -> int:
        """How many checks it makes: its count, and its colour."""
        return 1 + (self.colour is not None)


@dataclass(frozen=True)
class PromptRequirements:
    """What a prompt asks for: its objects (one or two) and the relation of the first to the second (None: none
    checked)."""

    objects: tuple[ObjectRequirement, ...]
    relation: str | None = None

    def checks(self) -> int:
        """How many checks the prompt makes (the denominator of its partial score)."""
        return sum(item.checks() for item in self.objects) + (self.relation is not None)

    @property
    def task(self) -> str:
        """GenEval's task of such a prompt: ``single_object``, ``counting`` (two or more of it), ``colors`` (with its
        colour), ``two_object``, ``position`` (with a relation checked) or ``color_attr`` (two, with a colour)."""
        if len(self.objects) == 1:
            only = self.objects[0]
            return "counting" if only.exact else "colors" if only.colour else "single_object"
        if self.relation is not None:
            return "position"
        return "color_attr" if any(item.colour for item in self.objects) else "two_object"


def singular(noun: str) -> str:
    """``noun`` with its last word singular: "teddy bears" -> "teddy bear", "boxes" -> "box", "knives" -> "knife"."""
    *head, last = noun.split(" ")
    if last in IRREGULAR_PLURALS:
        last = IRREGULAR_PLURALS[last]
    elif last.endswith("ies") and len(last) > 4:
        last = last[:-3] + "y"
    elif last.endswith(("ches", "shes", "sses", "xes", "zes")):
        last = last[:-2]
    elif last.endswith("s") and not last.endswith("ss"):
        last = last[:-1]
    return " ".join([*head, last])


def read_phrase(phrase: str) -> ObjectRequirement | None:
    """An ``amount [colour] noun`` phrase's requirement; None when its noun holds a grammar word."""
    parts = _PARTS.fullmatch(phrase)
    if parts is None or GRAMMAR_WORDS.intersection(parts["noun"].split(" ")):
        return None
    count = AMOUNTS[parts["amount"]]
    noun = singular(parts["noun"]) if count > 1 else parts["noun"]
    return ObjectRequirement(noun, count, exact=count > 1, colour=parts["colour"])


def read_prompt(prompt: str) -> PromptRequirements | None:
    """The requirements of ``prompt`` (module docstring), or None when it does not follow the grammar. It is read as
    one phrase, else split at a relation's words with a phrase on each side."""
    text = " ".join(str(prompt).lower().split()).removesuffix(".").removeprefix(PREFIX)
    for setting in SETTINGS:
        text = text.removesuffix(" " + setting)
    readings = [(text,)] + [(text[:found.start()], relation, text[found.end():])
                            for relation in RELATIONS for found in re.finditer(f" {relation} ", text)]
    for reading in readings:
        objects = [read_phrase(phrase) for phrase in reading[0::2]]
        if all(objects):
            return PromptRequirements(tuple(objects), RELATIONS[reading[1]] if len(reading) == 3 else None)
    return None


def read_prompts(prompts: list[str], reader: str = "the geneval reward") -> list[PromptRequirements]:
    """Each prompt's requirements; the first that does not follow the grammar is a :class:`UserError` naming
    ``reader``, the reward or judge that needs it."""
    read = [read_prompt(prompt) for prompt in prompts]
    if None in read:
        unread = str(prompts[read.index(None)])
        raise UserError(f"{reader} cannot read the prompt {unread[:80]!r}: it expects '[a photo of] AMOUNT [COLOUR] "
                        f"OBJECT [RELATION AMOUNT [COLOUR] OBJECT]' with AMOUNT a, an or one to ten, COLOUR one of "
                        f"{', '.join(COLOURS)}, RELATION one of {', '.join(RELATIONS)}; the built-in prompt "
                        "sets geneval and compositional follow it")
    return read
