"""A word-level :class:`~transformers.CLIPTokenizer` over the caption vocabulary.

CLIP's tokenizer is a BPE whose words end in ``</w>``. Here every caption word is one token: the
vocabulary holds the special tokens, every character piece and every prefix of every word, and
the merges join a word's characters left to right, so each word of
:data:`~jagg_core.shapes_world.WORDS` encodes to exactly one id. ``save_pretrained`` writes
files that ``CLIPTokenizer.from_pretrained`` reads back offline.
"""

from __future__ import annotations

from transformers import CLIPTokenizer

from ..shapes_world import WORDS

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def _add_word(pieces: list[str], vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    """Add the merges (and their results to the vocabulary) that join ``pieces`` left to right."""
    for piece in pieces:
        vocab.setdefault(piece, len(vocab))
    merged = pieces[0]
    for piece in pieces[1:]:
        if (merged, piece) not in merges:
            merges.append((merged, piece))
        merged += piece
        vocab.setdefault(merged, len(vocab))


def build_tokenizer(words: tuple[str, ...] = WORDS, max_length: int = 16) -> CLIPTokenizer:
    """A CLIP tokenizer with one token per word of ``words``, padding to ``max_length``.

    The merges start as each word's characters joined left to right; where an earlier merge of
    another word fires first inside a word, merges joining the resulting pieces are appended,
    until every word is one token.
    """
    vocab: dict[str, int] = {BOS: 0, EOS: 1}
    merges: list[tuple[str, str]] = []
    for word in words:
        _add_word(list(word[:-1]) + [word[-1] + "</w>"], vocab, merges)
    for _ in range(10):
        tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)
        split = {w: tokenizer.tokenize(w) for w in words}
        split = {w: pieces for w, pieces in split.items() if len(pieces) != 1}
        if not split:
            return tokenizer
        for pieces in split.values():
            _add_word(pieces, vocab, merges)
    raise RuntimeError(f"cannot make single tokens of {sorted(split)}")
