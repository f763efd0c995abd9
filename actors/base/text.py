"""Text as the analysers must see it (the text index's terms, the entities' names)."""

from __future__ import annotations

import unicodedata

__all__ = ["composed", "folded"]


def composed(text: str) -> str:
    """``text`` in Unicode's composed form (NFC). Word patterns and tantivy's simple tokenizer
    cut a word at a combining mark, so a decomposed "São" (S, a, U+0303, o: what macOS and
    some keyboards send) would be the two words "sa" and "o", and "São Paulo" the place "Sa"
    and the person "Paulo". Canonically equivalent text, so nothing a reader sees changes."""
    return text if text.isascii() else unicodedata.normalize("NFC", text)


def folded(text: str) -> str:
    """``text`` as two spellings of the same words compare: composed, case folded, its
    spacing collapsed (a fact's category and key, a note's duplicates, recall's same
    content)."""
    return " ".join(composed(text).casefold().split())
