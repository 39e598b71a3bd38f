"""Text-rendering reward: does the image show the text quoted in its prompt?

The target ``t`` is the text inside double quotes in the prompt (several quoted parts are joined
with spaces); ``r`` is what Tesseract reads in the image. Both are lower-cased with whitespace
removed, and

    score = 1 - min(lev(t, r), |t|) / |t|        (in [0, 1]; 1 = exact)

where ``lev`` is the Levenshtein edit distance. Needs the ``tesseract`` program (Debian package
``tesseract-ocr``) and the ``pytesseract`` package.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import torch

from ..errors import UserError
from ..images import to_pil
from .base import Reward

QUOTED = re.compile(r'"([^"]+)"|\u201c([^\u201d]+)\u201d')


def quoted_text(prompt: str) -> str:
    """The text in double (straight or curly) quotes, joined with spaces; '' if there is none."""
    return " ".join(a or b for a, b in QUOTED.findall(prompt))


def levenshtein(a: str, b: str) -> int:
    """The edit distance (insertions, deletions, substitutions) between ``a`` and ``b``."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def text_match(target: str, read: str) -> float:
    """``1 - min(lev(t, r), |t|) / |t|`` on lower-cased text without whitespace."""
    target, read = ("".join(s.lower().split()) for s in (target, read))
    return 1.0 - min(levenshtein(target, read), len(target)) / len(target)


class OcrReward(Reward):
    """Match between the prompt's quoted text and the text Tesseract reads (``lang``: its language)."""

    name = "ocr"

    def read(self, image) -> str:
        import pytesseract

        try:
            return pytesseract.image_to_string(image, lang=self.options.lang)
        except pytesseract.TesseractNotFoundError:
            raise UserError("the ocr reward needs Tesseract: install it with `apt-get install tesseract-ocr`") from None
        except pytesseract.TesseractError as err:
            message = " ".join(str(err.message).split())[:200]
            raise UserError(f"Tesseract failed with lang '{self.options.lang}' ({message}); is its language pack installed "
                            f"(`apt-get install tesseract-ocr-{self.options.lang}`)?") from None

    def __call__(self, images, prompts):
        targets = [quoted_text(prompt) for prompt in prompts]
        for prompt, target in zip(prompts, targets):
            if not "".join(target.split()):
                raise UserError("the ocr reward needs prompts with the text to render in double quotes; "
                                f"got: {prompt[:80]!r}")
        with ThreadPoolExecutor(max_workers=4) as pool:
            reads = list(pool.map(self.read, to_pil(images)))
        return torch.tensor([text_match(t, r) for t, r in zip(targets, reads)], dtype=torch.float32)
