"""The messages actors exchange: frozen, tagged Structs, one union per actor.

Persisted records live in ``engine._records``; nothing here is ever written to disk as is.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

from engine._records import Turn

__all__ = ["AppendTurn", "Forget", "PutVectors", "EmbedRequest", "StoreOp", "EmbedderOp"]


class AppendTurn(msgspec.Struct, frozen=True, tag=True):
    """Write one turn. ``key`` and ``value`` are encoded on the trio thread at ingest, so the
    writer thread holds the GIL only for LMDB's own C loop.

    Attributes:
        turn: the record (its ``lsn`` orders the log).
        key: the turn's key in the ``turns`` database.
        value: the turn encoded as msgpack.
        started_at: the session's first turn time, for its SessionInfo.
        id_key: the turn's key in the ``ids`` database.
    """

    turn: Turn
    key: bytes
    value: bytes
    started_at: datetime
    id_key: bytes

    @property
    def lsn(self) -> int:
        return self.turn.lsn


class Forget(msgspec.Struct, frozen=True, tag=True):
    """Delete a whole session (``session_id`` set) or a whole user (``session_id`` None), and log
    a tombstone at ``lsn`` that lists the deleted log sequence numbers and nothing of the user."""

    lsn: int
    user_id: str
    session_id: str | None


class PutVectors(msgspec.Struct, frozen=True, tag=True):
    """Store embeddings of logged records and advance the embedded watermark, atomically.

    Derived data: it takes no log sequence number. A vector whose record was deleted while it
    was being computed is dropped by the writer, so a forgotten user's vectors never come back.

    Attributes:
        items: (lsn, key in ``vectors``, float32 bytes) per record.
        watermark: every record up to this lsn is embedded (or not searchable).
        done: set once committed.
    """

    items: list[tuple[int, bytes, bytes]]
    watermark: int
    done: Any = None

    lsn = None  # not part of the log


class EmbedRequest(msgspec.Struct, frozen=True, tag=True):
    """Embed ``texts``; the model thread calls ``reply`` with an ``outcome`` of the vectors.

    Attributes:
        texts: what to embed.
        query: a caller is waiting on the hot path: served before background work.
        reply: the one-shot answer; hands the outcome to the waiting trio task.
    """

    texts: tuple[str, ...]
    query: bool
    reply: Any


StoreOp = AppendTurn | Forget | PutVectors
EmbedderOp = EmbedRequest
