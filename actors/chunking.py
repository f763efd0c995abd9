"""Cutting long texts into pieces the embedding model sees whole (seed 003's chunks).

The model reads at most its window of tokens (256 for MiniLM) and ignores the rest: a sentence
at the end of a long note would never reach a vector. So a text is cut into chunks of at most
CHUNK_CHARS characters, each overlapping the previous one by CHUNK_OVERLAP (seed 003's 640 and
96), cut at a space where one is near; a chunk that still holds more tokens than the window
(Chinese or Japanese, code, long numbers: 640 characters can be 600 tokens) is cut again where
the window ends, by the tokenizer's own offsets, with the same share of overlap. Every chunk is
embedded (:class:`Piece`); the vectors of one record are stored together, in one value, once
the last is in (:class:`Assembly`; see :mod:`actors.ann_index`).

A text that fits (the great majority of chat turns) is its own single chunk, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from .ann_index import encode_vector
from .base.messages import Searchable

__all__ = ["CHUNK_CHARS", "CHUNK_OVERLAP", "MAX_CHUNKS", "Assembly", "Piece", "chunk_texts",
           "split"]

CHUNK_CHARS = 640  # seed 003: characters per chunk at most
CHUNK_OVERLAP = 96  # seed 003: characters a chunk repeats of the one before it
SNAP = 160  # a cut moves back to a space at most this far, so words are not split
# Chunks of one record at most (the vector header counts them in 16 bits): ~35 MB of text,
# far past the longest text the engine takes.
MAX_CHUNKS = 65_536

# How many of each text's characters fit the model's window (a text that fits: its length).
Fit = Callable[[list[str]], list[int]]


def chunk_texts(texts: list[str], fit: Fit | None) -> list[list[str]]:
    """Each text's chunks, in order. ``fit`` is the backend's window check (None: a backend
    without a window of tokens: characters alone decide). Runs in a worker thread: the
    tokenizer is native, the rest a few string operations per long text."""
    fits = fit(texts) if fit is not None else [len(t) for t in texts]
    return [[text] if len(text) <= CHUNK_CHARS and n >= len(text) else split(text, fit)
            for text, n in zip(texts, fits, strict=True)]


def split(text: str, fit: Fit | None) -> list[str]:
    """``text`` cut by characters, then each piece by the window where it does not fit."""
    pieces = _by_chars(text)
    if fit is not None:
        fits = fit(pieces)
        pieces = [part for piece, n in zip(pieces, fits, strict=True)
                  for part in ([piece] if n >= len(piece) else _by_window(piece, n, fit))]
    return pieces[:MAX_CHUNKS]


def _by_chars(text: str) -> list[str]:
    if len(text) <= CHUNK_CHARS:
        return [text]
    out = []
    start = 0
    while True:
        end = start + CHUNK_CHARS
        if end >= len(text):
            out.append(text[start:])
            return out
        space = text.rfind(" ", end - SNAP, end)
        cut = space if space > start else end
        out.append(text[start:cut])
        # The next chunk starts CHUNK_OVERLAP back, at the start of a word when one begins
        # within the overlap.
        back = max(start + 1, cut - CHUNK_OVERLAP)
        space = text.find(" ", back, cut)
        start = space + 1 if space != -1 else back


def _by_window(piece: str, first_fit: int, fit: Fit) -> list[str]:
    """``piece`` cut where the window ends, each part repeating the same share of the one
    before it as the character chunks do."""
    out = []
    rest, n = piece, first_fit
    while n < len(rest):
        n = max(n, 1)
        space = rest.rfind(" ", n * 3 // 4, n)
        cut = space if space > 0 else n
        out.append(rest[:cut])
        rest = rest[cut - cut * CHUNK_OVERLAP // CHUNK_CHARS:]
        n = fit([rest])[0]
    out.append(rest)
    return out


class Piece(NamedTuple):
    """One chunk of a record to embed: the record, the chunk's place and count, its text."""

    record: Searchable
    index: int
    count: int
    text: str


class Assembly:
    """A record's chunk vectors as their batches come in; the stored value (every chunk's
    vector behind one header) once the last is there. A record whose piece failed in one
    batch never completes, so it is left without vectors, like a record that failed whole."""

    def __init__(self) -> None:
        self._parts: dict[int, list[np.ndarray | None]] = {}

    def add(self, pieces: list[Piece], vectors: list[np.ndarray]
            ) -> list[tuple[int, str, bytes]]:
        """Take a batch's vectors; returns the records it completed, as PutVectors items."""
        done = []
        for piece, vector in zip(pieces, vectors, strict=True):
            record = piece.record
            if piece.count == 1:
                done.append((record.lsn, record.user_id, encode_vector(record, vector)))
                continue
            parts = self._parts.setdefault(record.lsn, [None] * piece.count)
            parts[piece.index] = vector
            if all(part is not None for part in parts):
                del self._parts[record.lsn]
                done.append((record.lsn, record.user_id, encode_vector(record, np.stack(parts))))
        return done
