"""Log positions whose records were imported together with what was derived from them.

``Engine.import_user`` writes a user's turns, notes, episodes and facts with the episodes,
facts, entities and links another store derived from them. The long-term followers (facts,
episodes, entities) must not derive them a second time: a fact extracted again could supersede
the imported history, an episode made again would duplicate one, and entities would count
every mention twice. Each import block takes a contiguous range of log positions; the range is
written to ``meta`` in the same queue, before the block (so on disk no later than its records),
and kept here in RAM so that a follower skips every record inside one.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from typing import Any

from .store import Store, lsn_key

__all__ = ["Imported", "MARKER"]

MARKER = b"imported:"  # meta key prefix, + the range's first lsn (8 bytes) -> its last lsn


class Imported:
    """The imported ranges, sorted by first lsn; ``lsn in imported`` is a binary search."""

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int]] = []

    async def load(self, store: Store) -> None:
        """Read the ranges recorded by earlier imports (at open, before the followers run)."""
        for first, last in await store.read(_read_ranges):
            self.add(first, last)

    def add(self, first: int, last: int) -> None:
        insort(self._ranges, (first, last))

    def __contains__(self, lsn: int) -> bool:
        i = bisect_right(self._ranges, (lsn, 1 << 63)) - 1
        return i >= 0 and self._ranges[i][0] <= lsn <= self._ranges[i][1]

    @staticmethod
    def marker(first: int, last: int) -> tuple[bytes, bytes, bytes, int]:
        """The ``PutState`` put that records a range on disk."""
        return (b"meta", MARKER + lsn_key(first), lsn_key(last), 0)


def _read_ranges(txn: Any, dbs: dict[bytes, Any]) -> list[tuple[int, int]]:
    cursor = txn.cursor(dbs[b"meta"])
    out = []
    if cursor.set_range(MARKER):
        for key, value in cursor:
            if not key.startswith(MARKER):
                break
            out.append((int.from_bytes(key[len(MARKER):], "big"), int.from_bytes(value, "big")))
    return out
