"""Incremental detokenization: text grows token by token without re-decoding the whole output."""

from __future__ import annotations

from engine.sequence import Sequence


def append_token_text(tokenizer, seq: Sequence) -> None:
    """Extend `seq.text` with the text of its newest token, once it forms whole characters.

    Decoding a window from `prefix_offset` and diffing against the window without the new
    tokens keeps word-boundary spaces right; a trailing U+FFFD means the token ended inside a
    multi-byte character, so the text waits for the next token.
    """
    ids = seq.output_token_ids
    prefix = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset])
    new = tokenizer.decode(ids[seq.prefix_offset :])
    if len(new) > len(prefix) and not new.endswith("\ufffd"):
        seq.text += new[len(prefix) :]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)


def final_text(tokenizer, seq: Sequence) -> str:
    """The whole output decoded at once (the last token may complete or drop a character)."""
    return tokenizer.decode(seq.output_token_ids)
