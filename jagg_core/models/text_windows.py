"""What each text encoder reads of a prompt, and the prompts that run past it.

A text encoder reads a prompt's first ``limit`` tokens, counted as its pipeline tokenizes the prompt (a chat
template's tokens included); the pipelines cut the rest without a word that reaches the user (diffusers logs it
below the error level this project keeps for the libraries, :mod:`jagg_core.quiet`). Each family names its
encoders' windows (:meth:`jagg_core.models.base.FlowModel.text_windows`); at set-up :func:`read_windows` counts
every prompt's tokens in each, :func:`window_lines` says which prompts run past one, how far, and the setting that
keeps them whole, and :func:`refuse_overlong` stops a run before any prompt is encoded where the family refuses
longer prompts instead of cutting them (Qwen-Image-Edit, whose text and image tokens share one padded length). A
prompt of one's own (``jagg_core.generate``, the page's Try it) and CFG's negative prompt get :func:`prompt_notes`.
The first iteration's doctor fails a run whose ``model.max_sequence_length`` cuts its prompts
(:func:`jagg_core.doctor.text_window_check`); the model card's recipe says what each window read
(:meth:`WindowReading.record`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import UserError

#: the setting of the windows a user can widen
MAX_SEQUENCE_LENGTH = "model.max_sequence_length"


@dataclass(frozen=True)
class TextWindow:
    """One text encoder's window: its first ``limit`` tokens of a prompt."""

    encoder: str                              # as a user knows it: "CLIP", "T5", "Qwen2.5-VL"
    limit: int
    count: Callable[[list[str]], list[int]]   # each prompt's tokens, untruncated, as the pipeline tokenizes it
    setting: str | None = None                # the config key that sets ``limit``; None: the encoder fixes it
    refused: bool = False                     # a longer prompt is refused (else its end is cut)


@dataclass(frozen=True)
class WindowReading:
    """How the prompts of a run fill one window."""

    window: TextWindow
    prompts: int   # distinct prompts counted
    over: int      # how many take more than ``window.limit`` tokens
    longest: int   # tokens of the longest

    def record(self) -> dict:
        """The reading as ``RUN/run_info.json`` keeps it (the model card's recipe says it)."""
        return {"encoder": self.window.encoder, "tokens": self.window.limit, "setting": self.window.setting,
                "prompts": self.prompts, "longer": self.over, "longest": self.longest}

    @property
    def fixable(self) -> bool:
        """Prompts run past a window a setting widens."""
        return self.over > 0 and self.window.setting is not None


def tokens_of(tokenizer) -> Callable[[list[str]], list[int]]:
    """Each text's token count in ``tokenizer``, special tokens included (as the pipelines call it)."""
    return lambda texts: [len(ids) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]] if texts else []


def chat_tokens(tokenizer, **template_options) -> Callable[[list[str]], list[int]]:
    """Each text's token count as one user turn of ``tokenizer``'s chat template with the assistant's turn opened
    (``template_options``, e.g. ``enable_thinking``, as the family's pipeline passes them)."""
    def count(texts: list[str]) -> list[int]:
        templated = [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True, **template_options) for text in texts]
        return tokens_of(tokenizer)(templated)
    return count


def read_windows(windows: list[TextWindow], texts: list[str]) -> list[WindowReading]:
    """Every window's reading of the distinct ``texts``."""
    distinct = list(dict.fromkeys(texts))
    readings = []
    for window in windows:
        counts = window.count(distinct)
        readings.append(WindowReading(window, len(distinct), sum(n > window.limit for n in counts),
                                      max(counts, default=0)))
    return readings


def window_lines(readings: list[WindowReading]) -> list[str]:
    """A line for each window some prompts run past (none where every prompt fits)."""
    lines = []
    for reading in readings:
        window, over = reading.window, reading.over
        if over == 0 or window.refused:
            continue
        if window.setting is None:
            lines.append(f"{window.encoder} reads the first {window.limit} tokens of a prompt (its window is fixed): "
                         f"{over} of {reading.prompts} prompts are longer, the longest {reading.longest} tokens")
        else:
            lines.append(f"{over} of {reading.prompts} prompts are longer than the {window.limit} tokens "
                         f"{window.encoder} reads ({window.setting}) and lose their ends, the longest "
                         f"{reading.longest} tokens: set {window.setting}={reading.longest} to keep them whole")
    return lines


def refuse_overlong(readings: list[WindowReading]) -> None:
    """A :class:`UserError` where prompts are longer than a window that refuses them."""
    for reading in readings:
        window = reading.window
        if window.refused and reading.over:
            raise UserError(f"{reading.over} of {reading.prompts} prompts take more than the {window.limit} text "
                            f"tokens {window.encoder} is given ({window.setting}), the longest {reading.longest}: "
                            f"set {window.setting}={reading.longest} or shorten them")


def prompt_notes(readings: list[WindowReading], what: str = "the prompt") -> list[str]:
    """What the windows cut of one prompt, called ``what`` (a run's settings are fixed by then: the fix is a shorter
    prompt); a :class:`UserError` where a window refuses it."""
    notes = []
    for reading in readings:
        window = reading.window
        if not reading.over:
            continue
        run_setting = f" (the run's {window.setting})" if window.setting else ""
        if window.refused:
            raise UserError(f"{what} takes {reading.longest} text tokens, more than the {window.limit} "
                            f"{window.encoder} is given{run_setting}: shorten it")
        notes.append(f"{window.encoder} reads the first {window.limit} of the {reading.longest} tokens of "
                     f"{what}{run_setting}; the rest is cut")
    return notes
