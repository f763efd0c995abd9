"""A stored vector's bytes, and the filters a search applies to their headers.

Each stored vector value is a 16-byte header (:data:`HEADER`) followed by the vector as
float16 (schema 2): half the bytes of float32 on disk and in every snapshot, for a cosine error
around 1e-7 on unit vectors; searches run on float32 copies in RAM. A long text's value holds
one vector per chunk (:mod:`actors.chunking`) behind its one header, whose ``extra`` counts the
chunks past the first (0 in a value written before chunks: one vector, as before); each chunk
is a row of its record's partition (:func:`decode_rows`), and a search returns each record
once, at its best chunk, and says which chunk that was.

The header carries what a search filters on (time, kind, role, a code of the session), so
:class:`Filters` is a mask over headers. The Embedder writes these values
(:func:`encode_vector`); the AnnIndex reads them back (:func:`decode_vectors`).
"""

from __future__ import annotations

import copy
import hashlib
from datetime import datetime

import numpy as np

from ..base.messages import Searchable

__all__ = ["HEADER", "KINDS", "STORED", "ROLE_CODES", "PARTS", "KIND_AT", "part_of",
           "session_code", "encode_vector", "decode_vectors", "decode_rows", "Filters",
           "NO_FILTERS"]

HEADER = np.dtype([("at_ms", "<i8"), ("kind", "u1"), ("role", "u1"), ("extra", "<u2"),
                   ("session", "<u4")])
KINDS = {"turn": 0, "episode": 1, "fact": 2, "note": 3}
STORED = np.dtype("<f2")  # vectors on disk (schema 2; schema 1 stored float32)
ROLE_CODES = {"user": 0, "assistant": 1, "system": 2, "tool": 3}
# A user's partitions and the kinds each holds: turns, and every other kind.
PARTS = {"turn": ("turn",), "other": tuple(k for k in KINDS if k != "turn")}
KIND_AT = HEADER.fields["kind"][1]  # the byte of a stored value that holds its kind


def part_of(value: bytes) -> str:
    """The partition a stored vector value belongs to, by its header's kind."""
    return "turn" if value[KIND_AT] == KINDS["turn"] else "other"


def session_code(session_id: str) -> int:
    """A 32-bit code of a session id, for filtering (hits are checked against the record)."""
    return int.from_bytes(hashlib.blake2b(session_id.encode(), digest_size=4).digest(), "little")


def _ms(at: datetime) -> int:
    return int(at.timestamp() * 1000)


def encode_vector(record: Searchable, vector: np.ndarray) -> bytes:
    """A record's stored value: its header, then its vector, or one vector per chunk (a
    ``chunks x dim`` array)."""
    vectors = np.asarray(vector, dtype=STORED)
    header = np.zeros(1, dtype=HEADER)
    header[0] = (_ms(record.at), KINDS[record.kind], ROLE_CODES.get(record.role, 255),
                 len(vectors) - 1 if vectors.ndim == 2 else 0, session_code(record.session_id))
    return header.tobytes() + vectors.tobytes()


def decode_vectors(values: bytes, count: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(headers, matrix) from ``count`` concatenated stored values of one vector each."""
    row = HEADER.itemsize + STORED.itemsize * dim
    raw = np.frombuffer(values, dtype=np.uint8).reshape(count, row)
    headers = raw[:, : HEADER.itemsize].copy().view(HEADER).reshape(count)
    matrix = raw[:, HEADER.itemsize :].copy().view(STORED).reshape(count, dim).astype(np.float32)
    return headers, matrix


def decode_rows(lsns: list[int], values: bytes, dim: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Index rows from concatenated stored values: (lsn, chunk, header, vector) per row, a
    value of several chunks giving several rows (each with its record's header)."""
    count = len(lsns)
    size = STORED.itemsize * dim
    if len(values) == count * (HEADER.itemsize + size):  # no value holds chunks
        headers, matrix = decode_vectors(values, count, dim)
        return (np.array(lsns, dtype=np.int64), np.zeros(count, dtype=np.int32), headers,
                matrix)
    row_lsns, chunks, starts, heads = [], [], [], []
    at = 0
    for lsn in lsns:
        header = np.frombuffer(values, dtype=HEADER, count=1, offset=at)
        k = int(header["extra"][0]) + 1
        for chunk in range(k):
            row_lsns.append(lsn)
            chunks.append(chunk)
            starts.append(at + HEADER.itemsize + chunk * size)
            heads.append(header)
        at += HEADER.itemsize + k * size
    raw = np.frombuffer(values, dtype=np.uint8)
    index = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(size)
    matrix = raw[index].view(STORED).reshape(len(starts), dim).astype(np.float32)
    return (np.array(row_lsns, dtype=np.int64), np.array(chunks, dtype=np.int32),
            np.concatenate(heads), matrix)


class Filters:
    """What a vector search may return, beyond its user."""

    __slots__ = ("session", "since_ms", "until_ms", "roles", "kinds", "lsns", "exclude",
                 "_names", "_any")

    def __init__(self, session_id: str | None = None, since: datetime | None = None,
                 until: datetime | None = None, roles: tuple[str, ...] | None = None,
                 kinds: tuple[str, ...] | None = None, lsns: list[int] | None = None,
                 exclude: list[int] | None = None) -> None:
        self.session = None if session_id is None else session_code(session_id)
        self.since_ms = None if since is None else _ms(since)
        self.until_ms = None if until is None else _ms(until)
        self.roles = None if roles is None else np.array([ROLE_CODES[r] for r in roles])
        self.kinds = None if kinds is None else np.array([KINDS[k] for k in kinds])
        # Only these records (e.g. those with a tag, from the full-text index's term lists).
        self.lsns = None if lsns is None else np.array(lsns, dtype=np.int64)
        # Never these records (e.g. what a time-travelling recall's store did not know yet).
        self.exclude = None if not exclude else np.array(exclude, dtype=np.int64)
        # Asked of every partition of every search: answered from these, not the arrays.
        self._names = None if kinds is None else frozenset(kinds)
        self._any = not (session_id is None and since is None and until is None
                         and roles is None and kinds is None and lsns is None
                         and self.exclude is None)

    def any(self) -> bool:
        return self._any

    def admits(self, part: str) -> bool:
        """Whether any kind of this partition may be returned."""
        return self._names is None or not self._names.isdisjoint(PARTS[part])

    def within(self, part: str) -> Filters:
        """These filters for a search of one partition: without the kind filter when it
        admits every kind the partition holds (a mask that keeps every row would keep the
        graph from searching unfiltered)."""
        if self._names is None or not self._names.issuperset(PARTS[part]):
            return self
        out = copy.copy(self)
        out.kinds = out._names = None
        out._any = not (out.session is None and out.since_ms is None and out.until_ms is None
                        and out.roles is None and out.lsns is None and out.exclude is None)
        return out

    def mask(self, meta: np.ndarray, lsns: np.ndarray) -> np.ndarray:
        keep = np.ones(len(meta), dtype=bool)
        if self.lsns is not None:
            keep &= np.isin(lsns, self.lsns)
        if self.exclude is not None:
            keep &= ~np.isin(lsns, self.exclude)
        if self.session is not None:
            keep &= meta["session"] == self.session
        if self.since_ms is not None:
            keep &= meta["at_ms"] >= self.since_ms
        if self.until_ms is not None:
            keep &= meta["at_ms"] <= self.until_ms
        if self.roles is not None:
            keep &= np.isin(meta["role"], self.roles)
        if self.kinds is not None:
            keep &= np.isin(meta["kind"], self.kinds)
        return keep


NO_FILTERS = Filters()
